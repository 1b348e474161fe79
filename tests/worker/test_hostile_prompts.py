"""Issue 27, finding 3: a prompt or tools as big as the body cap allows no longer stall a worker.

A real SmolLM2 worker refuses a 7.8 MB message and 4 MB of tools by counting characters against
its context (no template render, no tokenizer), and answers /health all the while it tokenizes
the largest prompt it does take. Through `modelyard serve`, the same requests from one tenant
leave the shared public replica serving (same process, no restart) for another tenant.
Unbounded request fields are 400s that name them (unknown ones: `test_no_silent_drops.py`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.engine.models.loader import read_model_config
from modelyard.engine.tokenizer import Tokenizer
from tests.conftest import WorkerProcess
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
    platform_running,
    tiny_models_env,
)

# A hostile input must not hold any process's event loop (tests/loop_stalls.py).
pytestmark = pytest.mark.usefixtures("no_loop_stalls")

MODEL = "smollm2"
HUGE_MESSAGE = "a" * 7_800_000  # under the 8 MiB body cap


def huge_tools(total_chars: int = 4_000_000) -> list[dict[str, Any]]:
    """About `total_chars` of tool definitions: 100 functions with long descriptions and
    parameter schemas."""
    each = total_chars // 100
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "d" * (each // 2),
                "parameters": {
                    "type": "object",
                    "properties": {"x": {"type": "string", "description": "p" * (each // 2)}},
                },
            },
        }
        for i in range(100)
    ]


def error_of(r: httpx.Response) -> dict[str, Any]:
    return dict(r.json()["error"])


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        **extra,
    }


@pytest.fixture(scope="module")
def budget_chars(smollm2_worker: WorkerProcess, smollm2_folder: Path) -> int:
    """The characters the worker's context can hold: max_model_len × the tokenizer's bound."""
    max_model_len = httpx.get(f"{smollm2_worker.url}/health").json()["max_model_len"]
    tokenizer = Tokenizer.load(smollm2_folder, read_model_config(smollm2_folder))
    return int(max_model_len) * tokenizer.max_chars_per_token()


def test_a_huge_message_and_huge_tools_are_refused_by_their_characters(
    smollm2_worker: WorkerProcess, budget_chars: int
) -> None:
    url = f"{smollm2_worker.url}/v1/chat/completions"
    assert len(HUGE_MESSAGE) > budget_chars
    r = httpx.post(url, json=chat(HUGE_MESSAGE), timeout=120)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    # Counted in characters, before any tokenizer ran (a token count would need one).
    assert f"at most {budget_chars} characters" in err["message"], err
    r = httpx.post(url, json=chat("Hi", tools=huge_tools()), timeout=120)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["code"] == "context_length_exceeded" and err["param"] == "tools", err
    assert "characters" in err["message"]
    # Completions and the Responses API take the same bound.
    r = httpx.post(
        f"{smollm2_worker.url}/v1/completions",
        json={"model": MODEL, "prompt": HUGE_MESSAGE, "max_tokens": 2},
        timeout=120,
    )
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text
    assert "characters" in error_of(r)["message"]
    r = httpx.post(
        f"{smollm2_worker.url}/v1/responses",
        json={"model": MODEL, "input": HUGE_MESSAGE, "max_output_tokens": 2},
        timeout=120,
    )
    assert r.status_code == 400, r.text
    assert error_of(r)["code"] == "context_length_exceeded" and error_of(r)["param"] == "input"
    ok = httpx.post(url, json=chat("What is the capital of France?"), timeout=120)
    assert ok.status_code == 200, ok.text
    assert smollm2_worker.proc.poll() is None


async def _health_answers_during(url: str, body: dict[str, Any]) -> tuple[int, httpx.Response]:
    """Send `body` to chat and poll /health on other connections until it is answered: how
    many health answers arrived while it was in flight, and its response."""
    async with httpx.AsyncClient(timeout=300) as big, httpx.AsyncClient(timeout=300) as probe:
        request = asyncio.create_task(big.post(f"{url}/v1/chat/completions", json=body))
        answered = 0
        while not request.done():
            health = asyncio.create_task(probe.get(f"{url}/health"))
            await asyncio.wait({request, health}, return_when=asyncio.FIRST_COMPLETED)
            if not request.done():
                assert (await health).status_code == 200
                answered += 1
            else:
                health.cancel()
        return answered, await request


def test_health_answers_while_the_longest_legal_prompt_is_tokenized(
    smollm2_worker: WorkerProcess, budget_chars: int
) -> None:
    # Just under the character bound: it is rendered and tokenized (seconds of tokenizer
    # work), then found longer than the context in tokens.
    text = ("hello world " * (budget_chars // 12))[: budget_chars - 1000]
    answered, r = asyncio.run(_health_answers_during(smollm2_worker.url, chat(text)))
    # The platform kills a replica after 3 failed probes; here probes kept being answered.
    assert answered >= 10, answered
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded", r.text
    assert "resulted in" in error_of(r)["message"]  # counted in tokens: it was tokenized


DEEP = json.loads('{"a":' * 100 + "{}" + "}" * 100)  # 101 objects deep


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"user": "u" * 10_000}, "user"),
        ({"prompt_cache_key": "k" * 10_000}, "prompt_cache_key"),
        ({"modalities": ["text"] * 100}, "modalities"),
        ({"messages": [{"role": "user", "content": "hi", "name": "n" * 10_000}]}, "messages"),
        ({"logit_bias": {"1" * 5000: 1.0}}, "logit_bias"),
        ({"guided_json": DEEP}, "guided_json"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]},
            "tools[0].function.parameters",
        ),
    ],
)
def test_unbounded_fields_are_a_400_naming_them(
    smollm2_worker: WorkerProcess, body: dict[str, Any], param: str
) -> None:
    payload = {**chat("Hi"), **body}
    r = httpx.post(f"{smollm2_worker.url}/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error" and (err["param"] or "").startswith(param), err


# ----- through `modelyard serve`: the shared public replica survives -------------------------


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, cache_dir: Path
) -> Iterator[PlatformProcess]:
    env = {
        **tiny_models_env(models_dir),
        # Probes as the platform ran them, but quicker: a worker whose loop stalls for
        # a few seconds fails 3 in a row and is killed.
        "MODELYARD_HEALTH_PROBE_TIMEOUT_S": "0.5",
    }
    with platform_running(tmp_path_factory.mktemp("data"), env) as p:
        yield p


def test_one_tenants_huge_prompts_leave_the_shared_replica_serving_another(
    platform: PlatformProcess, models_dir: Path
) -> None:
    admin = platform.api()
    endpoint = deploy(admin, "tiny", str(models_dir / "tiny"), public=True)
    before = admin.get(f"/v1/endpoints/{endpoint}").json()["replicas"]
    (replica,) = before["items"]
    assert platform.worker_pids() == [replica["pid"]]
    keys = {
        name: create_key(admin, create_tenant(admin, name), scopes=["inference"])["key"]
        for name in ("attacker", "bystander")
    }
    attacker = platform.api(keys["attacker"])
    url = "/v1/chat/completions"
    message = {"model": "tiny", "messages": [{"role": "user", "content": HUGE_MESSAGE}]}
    tools = {**chat("Hi", tools=huge_tools()), "model": "tiny"}
    for body in (message, tools, message):
        r = attacker.post(url, json=body, timeout=120)
        assert r.status_code == 400, r.text
        assert error_of(r)["code"] == "context_length_exceeded", r.text
    r = platform.api(keys["bystander"]).post(url, json={**chat("Hello"), "model": "tiny"})
    assert r.status_code == 200, r.text
    after = admin.get(f"/v1/endpoints/{endpoint}").json()["replicas"]
    assert after["restarts"] == before["restarts"] == 0, after
    assert [(r["id"], r["pid"]) for r in after["items"]] == [(replica["id"], replica["pid"])]
    assert platform.worker_pids() == [replica["pid"]]
