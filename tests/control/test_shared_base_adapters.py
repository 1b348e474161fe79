"""Tenants' LoRA adapters on the public `smollm2` that `modelyard serve` deploys, in both store
modes: each tenant pushes adapters against it and calls them by name (greedy tokens equal to
the base with the adapter merged by `peft`), versions move and pin, no tenant sees or calls
another's (chat, completions, responses, batch lines, /v1/models, usage), usage rows name the
adapter, a wrong rank or shape is refused at push, and a third tenant's 20 adapters cycle
through the replica's 4 slots under concurrent load with every request answered.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.platform_harness import (
    PlatformProcess,
    batch_line,
    create_key,
    create_tenant,
    jsonl,
    read_jsonl,
    wait_batch,
    wait_usage,
)

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

PROMPT = [504, 3458, 282, 4649, 314, 253, 1345, 30]  # token ids
N_TOKENS = 5
SLOTS = 4
pytestmark = pytest.mark.timeout(600)  # serve with the bundled models, 4 references: slow on 2 vCPU


def make_adapters(model: Any, out: Path, seeds: list[int]) -> list[Path]:
    """PEFT adapters (rank 4 on q and v) with random weights, one folder per seed."""
    config = peft.LoraConfig(init_lora_weights=False, r=4, lora_alpha=8,
                             target_modules=["q_proj", "v_proj"])  # fmt: skip
    peft_model = peft.get_peft_model(copy.deepcopy(model), config)
    folders = []
    for seed in seeds:
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_" in name:
                    p.normal_(0.0, 0.05 if "lora_A" in name else 0.5)
        folders.append(out / f"a{seed}")
        peft_model.save_pretrained(folders[-1])
    return folders


def reshaped(
    source: Path, out: Path, rank: int | None = None, in_features: int | None = None
) -> Path:
    """A copy of an adapter with every weight at another rank, or one A of another width."""
    out.mkdir(parents=True)
    config = json.loads((source / "adapter_config.json").read_text())
    tensors = load_file(source / "adapter_model.safetensors")
    for key, t in tensors.items():
        if rank is not None:
            shape = (rank, t.shape[1]) if "lora_A" in key else (t.shape[0], rank)
            tensors[key] = torch.zeros(shape)
        elif in_features is not None and "lora_A" in key:
            tensors[key] = torch.zeros(t.shape[0], in_features)
            in_features = None
    config["r"] = rank or config["r"]
    (out / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, out / "adapter_model.safetensors")
    return out


def merged_greedy(model: Any, adapter: Path | None) -> list[int]:
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(copy.deepcopy(model), adapter).merge_and_unload()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([PROMPT])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_TOKENS,
                         do_sample=False, pad_token_id=0)  # fmt: skip
    return list(out[0, len(PROMPT) :].tolist())


def manifest(folder: Path) -> dict[str, dict[str, Any]]:
    files = {}
    for f in sorted(folder.iterdir()):
        if f.is_file():
            files[f.name] = {
                "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
                "size": f.stat().st_size,
            }
    return files


def push(
    api: httpx.Client, folder: Path, name: str, base: str | None = "smollm2"
) -> httpx.Response:
    """Upload the folder's files and create a version (what `modelyard models push` does)."""
    files = manifest(folder)
    for rel, meta in files.items():
        r = api.put(f"/v1/blobs/{meta['sha256']}", content=(folder / rel).read_bytes())
        assert r.status_code in (200, 201), r.text
    body: dict[str, Any] = {"files": files, **({"base_model": base} if base else {})}
    return api.post(f"/v1/registry/models/{name}/versions", json=body)


class Tenant:
    def __init__(self, platform: PlatformProcess, name: str) -> None:
        admin = platform.api()
        self.id = create_tenant(admin, name)
        self.key = create_key(admin, self.id, scopes=["admin", "inference"])["key"]
        self.api = platform.api(self.key)
        self.client = platform.openai(self.key)

    def complete(self, model: str, max_tokens: int = N_TOKENS) -> Any:
        return self.client.completions.create(
            model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip


@pytest.fixture(scope="module")
def folders(smollm2_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("adapters")
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32)
    a, a2, b, *many = make_adapters(model, root, [1, 2, 3, *range(100, 120)])
    # B names no base_model on push: its adapter_config.json says which.
    config = json.loads((b / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "HuggingFaceTB/smollm2"
    (b / "adapter_config.json").write_text(json.dumps(config))
    return {
        "a": a, "a2": a2, "b": b, "many": many,
        "big": reshaped(a, root / "big", rank=32),  # over max_lora_rank (16)
        "wrong": reshaped(a, root / "wrong", in_features=100),  # smollm2's hidden size is 576
        "ref_a": merged_greedy(model, a), "ref_a2": merged_greedy(model, a2),
        "ref_b": merged_greedy(model, b), "ref_base": merged_greedy(model, None),
    }  # fmt: skip


@pytest.fixture(scope="module")
def platform(
    platform_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, cache_dir: Path
) -> Iterator[PlatformProcess]:
    env = {
        **platform_env,
        # Float32 weights: the references below are transformers' float32 merged models.
        "MODELYARD_WORKER_ENGINE": json.dumps(
            {"kv_cache_memory": "64MiB", "dtype": "float32", "quantization": "none"}
        ),
        "MODELYARD_BUNDLED_MAX_LORAS": str(SLOTS),
    }
    p = PlatformProcess(tmp_path_factory.mktemp("data"), env, default_models=True)
    try:
        p.start(timeout=300)
        yield p
    except BaseException:
        print(p.output())
        raise
    finally:
        p.stop()


def tokens(text: str, tokenizer: Any) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_tenants_call_their_own_adapters_on_the_public_base(
    platform: PlatformProcess, folders: dict[str, Any], smollm2_folder: Path
) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_folder)
    alice, bob = Tenant(platform, "alice"), Tenant(platform, "bob")
    r = push(alice.api, folders["a"], "support-bot")
    assert r.status_code == 201 and r.json()["base_model"] == "smollm2", r.text
    r = push(bob.api, folders["b"], "support-bot", base=None)  # same name, another tenant
    assert r.status_code == 201 and r.json()["base_model"] == "smollm2", r.text

    def greedy(t: Tenant, model: str) -> str:
        return str(t.complete(model).choices[0].text)

    try:
        assert greedy(alice, "support-bot") == tok.decode(folders["ref_a"])
        assert greedy(bob, "support-bot") == tok.decode(folders["ref_b"])
        assert greedy(alice, "smollm2") == tok.decode(folders["ref_base"])
        # Versions: v2 takes the name's calls; `:1` pins the first.
        assert push(alice.api, folders["a2"], "support-bot").json()["version"] == 2
        v2 = alice.complete("support-bot")
        assert v2.choices[0].text == tok.decode(folders["ref_a2"]) and v2.model == "support-bot:2"
        assert greedy(alice, "support-bot:1") == tok.decode(folders["ref_a"])
        assert greedy(alice, "smollm2:support-bot") == tok.decode(folders["ref_a2"])
        chat = alice.client.chat.completions.create(
            model="support-bot", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert chat.choices[0].message.content is not None and chat.model == "support-bot:2"
        stream = alice.client.chat.completions.create(
            model="support-bot", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            stream=True,
        )  # fmt: skip
        assert {chunk.model for chunk in stream} == {"support-bot:2"}
        answer = alice.client.responses.create(
            model="support-bot:1", input="Hi", max_output_tokens=2
        )
        assert answer.output_text is not None
    except BaseException:
        print(platform.output())
        raise

    # Bob's "support-bot" is his own; Alice's second version and her legal bot do not exist for him.
    assert push(alice.api, folders["a"], "legal-bot").status_code == 201
    carol = Tenant(platform, "carol")  # no adapters at all
    # Each name answers as a name that does not exist does: 404 `model_not_found`, the same
    # words but the name (through the base too, refused before a replica is asked).
    unknown = {"legal-bot": "no-such-model", "support-bot:2": "support-bot:9",
               "smollm2:legal-bot": "smollm2:no-such-adapter",
               "smollm2:no-such-adapter": "no-such-model"}  # fmt: skip

    def seen(exc: pytest.ExceptionInfo[openai.APIStatusError], model: str) -> tuple[Any, ...]:
        body = exc.value.body
        assert isinstance(body, dict), body
        return exc.value.status_code, body["code"], body["message"].replace(f"`{model}`", "?")

    for model, nonexistent in unknown.items():
        for t in (bob, carol) if model != "support-bot:2" else (bob,):
            with pytest.raises(openai.APIStatusError) as missing:
                t.complete(nonexistent)
            expected = seen(missing, nonexistent)
            assert expected[:2] == (404, "model_not_found"), expected
            with pytest.raises(openai.APIStatusError) as refused:
                t.complete(model)
            assert seen(refused, model) == expected
            with pytest.raises(openai.APIStatusError) as chat:
                t.client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
                )
            assert seen(chat, model) == expected
            with pytest.raises(openai.APIStatusError) as responses:
                t.client.responses.create(model=model, input="Hi", max_output_tokens=2)
            assert seen(responses, model) == expected
    with pytest.raises(openai.NotFoundError):
        bob.complete("legal-bot")
    internal = f"{alice.id}."  # an internal name is never accepted from a client
    with pytest.raises(openai.NotFoundError):
        bob.complete(f"smollm2:{internal}mv-0123456789abcdef")
    listed = {m.id for m in alice.client.models.list().data}
    assert {"support-bot", "legal-bot", "smollm2"} <= listed
    assert "legal-bot" not in {m.id for m in bob.client.models.list().data}
    assert bob.api.get("/v1/models/legal-bot").status_code == 404
    assert alice.api.get("/v1/models/legal-bot").json()["parent"] == "smollm2"

    # Batch lines: Alice's adapter answers her lines; Bob's naming it fail as unknown (404).
    for t, ok in ((alice, True), (bob, False)):
        lines = [batch_line("x", model="legal-bot", max_tokens=2),
                 batch_line("y", model="smollm2:legal-bot", max_tokens=2)]  # fmt: skip
        f = t.client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = t.client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_batch(t.client, batch.id, {"completed", "failed"}, timeout=180)
        out = read_jsonl(t.client, done.output_file_id) + read_jsonl(t.client, done.error_file_id)
        statuses = sorted((o.get("response") or {}).get("status_code") for o in out)
        assert statuses == ([200, 200] if ok else [404, 404]), out
        assert ok or "model_not_found" in json.dumps(out), out

    # Usage rows name the adapter beside the base endpoint; each tenant sees only its own.
    rows = wait_usage(alice.api, lambda rs: sum(r["adapter"] != "" for r in rs) >= 7)
    adapters = {r["adapter"] for r in rows if r["adapter"]}
    assert {"support-bot:1", "support-bot:2", "legal-bot:1"} <= adapters
    assert all(r["model"] == "smollm2" for r in rows)
    groups = {
        g["model"] for g in alice.api.get("/v1/usage", params={"group_by": "model"}).json()["data"]
    }
    assert {"support-bot", "legal-bot", "smollm2"} <= groups
    # A key's limits apply to an adapter as to any model.
    limited = platform.openai(create_key(platform.api(), alice.id, rpm_limit=1)["key"])
    limited.completions.create(model="legal-bot", prompt=PROMPT, max_tokens=1)
    with pytest.raises(openai.RateLimitError):
        limited.completions.create(model="legal-bot", prompt=PROMPT, max_tokens=1)
    bob_rows = wait_usage(bob.api, lambda rs: len(rs) >= 1)
    assert {r["adapter"] for r in bob_rows} <= {"support-bot:1", ""}
    assert all(r["tenant_id"] == bob.id for r in bob_rows)


def test_an_adapter_that_does_not_fit_the_base_is_refused_at_push(
    platform: PlatformProcess, folders: dict[str, Any], tmp_path: Path
) -> None:
    dave = Tenant(platform, "dave")
    # Only LoRA is served: another PEFT method, or none named, is refused naming peft_type.
    for i, peft_type in enumerate(("PREFIX_TUNING", None, 7)):
        other = tmp_path / f"peft-{i}"
        shutil.copytree(folders["a"], other)
        config = json.loads((other / "adapter_config.json").read_text())
        config.pop("peft_type")
        if peft_type is not None:
            config["peft_type"] = peft_type
        (other / "adapter_config.json").write_text(json.dumps(config))
        r = push(dave.api, other, f"not-lora-{i}")
        assert r.status_code == 400 and r.json()["error"]["param"] == "peft_type", r.text
        assert "LORA" in r.json()["error"]["message"], r.text
    r = push(dave.api, folders["big"], "too-big")  # r=32 > the replica's max_lora_rank 16
    assert r.status_code == 400 and r.json()["error"]["param"] == "r", r.text
    r = push(dave.api, folders["wrong"], "wrong-shape")  # made for another model's shapes
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "adapter_model.safetensors", r.text
    r = push(dave.api, folders["a"], "orphan", base="no-such-base")
    assert r.status_code == 400 and r.json()["error"]["param"] == "base_model", r.text
    names = {m["name"] for m in dave.api.get("/v1/registry/models").json()["data"]}
    assert not names & {"too-big", "wrong-shape", "orphan", "not-lora-0", "not-lora-1"}


def test_twenty_adapters_cycle_through_four_slots_under_load(
    platform: PlatformProcess, folders: dict[str, Any], platform_mode: str
) -> None:
    if platform_mode != "sqlite-memory":
        pytest.skip("slots cycle in the replica, whatever the store: one mode is enough")
    erin = Tenant(platform, "erin")
    names = [f"bot-{i}" for i in range(len(folders["many"]))]
    for name, folder in zip(names, folders["many"], strict=True):
        assert push(erin.api, folder, name).status_code == 201
    calls = names[::2] + names[1::2]  # 8 at a time: more adapters in flight than slots
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda m: erin.complete(m, max_tokens=2), calls))
    assert [a.model for a in answers] == [f"{m}:1" for m in calls]
    assert all(a.usage.completion_tokens == 2 for a in answers)
    # The listing (API and CLI): each adapter's base and state; at most the 4 slots' worth are
    # loaded on the one replica (from its next health report), the rest cold.
    deadline = time.monotonic() + 60
    listed = adapter_list(platform, erin)
    while not any(a["loaded_replicas"] for a in listed):
        assert time.monotonic() < deadline, listed
        time.sleep(0.2)
        listed = adapter_list(platform, erin)
    assert sorted(a["name"] for a in listed) == sorted(names)
    assert {a["base_model"] for a in listed} == {"smollm2"}
    loaded = [a for a in listed if a["loaded_replicas"]]
    assert 1 <= len(loaded) <= SLOTS and loaded[0]["state"] == "loaded on 1 of 1 replicas"
    assert sum(a["state"] == "cold" for a in listed) == len(names) - len(loaded)
    others = Tenant(platform, "frank").api.get("/v1/registry/adapters").json()["data"]
    assert others == []  # erin's are hers only


def adapter_list(platform: PlatformProcess, tenant: Tenant) -> list[dict[str, Any]]:
    """`modelyard models adapters --json` with the tenant's key."""
    env = {**os.environ, "MODELYARD_URL": platform.url, "MODELYARD_API_KEY": tenant.key}
    cmd = [sys.executable, "-m", "modelyard.cli", "models", "adapters", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))
