"""No request field is dropped silently (docs/api.md has the table): each OpenAI field of chat,
completions, embeddings, files and batches is honoured or refused with a 400 naming it, an
argument OpenAI does not know either gets OpenAI's own 400, and vLLM's extras stay accepted.

Chat and completions run against a real SmolLM2 worker; embeddings, files and batches against a
real platform (SQLite mode) through its gateway.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import WorkerProcess
from tests.platform_harness import (
    PlatformProcess,
    batch_line,
    create_key,
    create_tenant,
    jsonl,
    tiny_models_env,
)

MODEL = "smollm2"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def url(smollm2_worker: WorkerProcess) -> str:
    return smollm2_worker.url


def chat(url: str, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


# The fields the issue found accepted and ignored, and the other OpenAI fields this server does
# not offer: each is refused with its name as `param` when it asks for something.
REFUSED = [
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("prediction", {"type": "content", "content": "Hello"}),
    ("reasoning_effort", "low"),
    ("verbosity", "low"),
    ("service_tier", "flex"),
    ("store", True),
    ("metadata", {"k": "v"}),
    ("web_search_options", {}),
    ("prompt_cache_retention", "24h"),
]
# Accepted at the values that ask for nothing, or with no effect a client could observe.
ACCEPTED = [
    ("modalities", ["text"]),
    ("service_tier", "auto"),
    ("service_tier", "default"),
    ("store", False),
    ("metadata", {}),
    ("logit_bias", {}),
    ("user", "u-1"),
    ("safety_identifier", "s-1"),
    ("prompt_cache_key", "k-1"),
    ("stream_options", None),
    ("parallel_tool_calls", True),
]
# vLLM's extras, honoured.
VLLM_EXTRAS = [
    ("top_k", 5),
    ("min_p", 0.1),
    ("repetition_penalty", 1.1),
    ("stop_token_ids", [2]),
    ("ignore_eos", True),
    ("skip_special_tokens", False),
    ("priority", 3),
    ("cache_salt", "tenant-a"),
    ("guided_choice", ["yes", "no"]),
]


@pytest.mark.parametrize(("field", "value"), REFUSED, ids=[f for f, _ in REFUSED])
def test_chat_fields_not_offered_are_refused_by_name(url: str, field: str, value: Any) -> None:
    r = chat(url, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_chat_fields_that_ask_for_nothing_and_vllm_extras_are_accepted(url: str) -> None:
    for field, value in ACCEPTED + VLLM_EXTRAS:
        r = chat(url, **{field: value})
        assert r.status_code == 200, (field, r.text)
    r = chat(url, guided_choice=["yes", "no"], max_tokens=5)
    assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")


def test_logit_bias_is_honoured_and_checked(url: str, smollm2_folder: Path) -> None:
    """+100 on one token makes greedy decoding pick it every time; -100 on the token greedy
    decoding picks first makes it never come; ids outside the vocabulary, values outside
    [-100, 100] and keys that are not ids are 400s naming logit_bias. Chat and completions."""
    from modelyard.engine.models.loader import read_model_config
    from modelyard.engine.tokenizer import Tokenizer

    vocab = Tokenizer.load(smollm2_folder, read_model_config(smollm2_folder)).backend
    equals = vocab.token_to_id("=")
    forced = chat(url, max_tokens=4, temperature=0, logit_bias={str(equals): 100}).json()
    assert forced["choices"][0]["message"]["content"] == "===="
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0,
            "logit_bias": {str(equals): 100}}  # fmt: skip
    completion = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
    assert completion["choices"][0]["text"] == "==="
    plain = chat(url, max_tokens=4, temperature=0, logprobs=True).json()["choices"][0]
    first = vocab.encode(plain["message"]["content"], add_special_tokens=False).ids[0]
    banned = chat(url, max_tokens=4, temperature=0, logprobs=True,
                  logit_bias={str(first): -100}).json()["choices"][0]  # fmt: skip
    assert banned["logprobs"]["content"][0]["token"] != plain["logprobs"]["content"][0]["token"]
    too_many = {str(i): 1 for i in range(301)}
    for bias in ({"49152": 1}, {"5": 101}, {"5": -100.5}, {"x": 1}, {"-1": 1}, too_many):
        r = chat(url, logit_bias=bias)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", (bias, r.text)


def test_unknown_arguments_get_openais_own_answer(url: str) -> None:
    r = chat(url, frobnicate=1)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"] == "Unrecognized request argument supplied: frobnicate"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "frobnicate": 1}
    r = httpx.post(f"{url}/v1/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Unrecognized request argument supplied: frobnicate"
    # Nested objects too, by their path.
    r = chat(url, messages=[{"role": "user", "content": "Hi", "colour": "red"}])
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].colour"
    r = chat(url, stream=True, stream_options={"include_usage": True, "extra": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.extra"


def test_messages_fields_are_rendered_or_refused(url: str) -> None:
    # An assistant message's output-only fields echoed back by an SDK are accepted ...
    history = [
        *HI,
        {"role": "assistant", "content": "Hello!", "refusal": None, "annotations": [],
         "audio": None, "function_call": None, "tool_calls": None},
        {"role": "user", "content": "Bye"},
    ]  # fmt: skip
    assert chat(url, messages=history).status_code == 200
    # ... audio in the history is not (text only), nor non-text content parts, nor a tool
    # result that names no call.
    history[1]["audio"] = {"id": "audio_1"}
    r = chat(url, messages=history)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].audio"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert chat(url, messages=image).status_code == 400
    r = chat(url, messages=[*HI, {"role": "tool", "content": "42"}])
    assert r.status_code == 400 and "tool_call_id" in r.json()["error"]["message"]


def test_completion_fields_not_offered_are_refused_by_name(url: str) -> None:
    for field, value in (("suffix", "!"), ("echo", True), ("best_of", 3)):
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, field: value}
        r = httpx.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 400, (field, r.text)
        assert r.json()["error"]["param"] == field


# ----- embeddings, files and batches, through the platform -------------------------------------


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, cache_dir: Path
) -> Iterator[tuple[PlatformProcess, openai.OpenAI, str]]:
    p = PlatformProcess(tmp_path_factory.mktemp("drops-data"), tiny_models_env(models_dir))
    p.start()
    try:
        tenant = create_tenant(p.api(), f"drops-{time.time_ns()}")
        key = create_key(p.api(), tenant, scopes=["inference"])["key"]
        yield p, p.openai(key), key
    finally:
        p.stop()


def test_gateway_refuses_unknown_arguments_before_any_model(
    platform: tuple[PlatformProcess, openai.OpenAI, str],
) -> None:
    p, _, key = platform
    api = p.api(key)
    for path, body in (
        ("/v1/embeddings", {"model": "nomic", "input": "x", "truncate": True}),
        ("/v1/chat/completions", {"model": "tiny", "messages": HI, "functionz": []}),
        ("/v1/responses", {"model": "tiny", "input": "x", "previous_response_idx": "r"}),
    ):
        r = api.post(path, json=body)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["message"].startswith("Unrecognized request argument supplied")
    r = api.post("/v1/responses", json={"model": "tiny", "input": "x", "store": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"


def test_files_list_order_after_and_limit(
    platform: tuple[PlatformProcess, openai.OpenAI, str],
) -> None:
    _, client, _ = platform
    ids = []
    for i in range(3):
        data = jsonl([batch_line(f"r{i}")])
        ids.append(client.files.create(file=(f"f{i}.jsonl", data), purpose="batch").id)
        time.sleep(0.01)  # distinct creation times
    asc = [f.id for f in client.files.list(order="asc") if f.id in ids]
    desc = [f.id for f in client.files.list(order="desc") if f.id in ids]
    assert asc == ids and desc == ids[::-1]
    page = client.files.list(order="asc", after=ids[0], limit=1)
    assert [f.id for f in page.data] == [ids[1]] and page.has_more


def test_file_expiry_and_unknown_upload_fields_are_refused(
    platform: tuple[PlatformProcess, openai.OpenAI, str],
) -> None:
    p, client, key = platform
    with pytest.raises(openai.BadRequestError) as err:
        client.files.create(
            file=("x.jsonl", jsonl([batch_line("a")])),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 3600},
        )
    assert err.value.body["param"] == "expires_after"  # type: ignore[index]
    files = {"file": ("x.jsonl", jsonl([batch_line("a")]))}
    r = p.api(key).post("/v1/files", data={"purpose": "batch", "colour": "red"}, files=files)
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Unrecognized request argument supplied: colour"


def test_batch_create_refuses_fields_it_does_not_honour(
    platform: tuple[PlatformProcess, openai.OpenAI, str],
) -> None:
    p, client, key = platform
    file_id = client.files.create(file=("b.jsonl", jsonl([batch_line("a")])), purpose="batch").id
    body = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "output_expires_after": {"anchor": "created_at", "seconds": 3600},
    }
    r = p.api(key).post("/v1/batches", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "output_expires_after"
    body.pop("output_expires_after")
    r = p.api(key).post("/v1/batches", json={**body, "endpoint": "/v1/responses"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "endpoint"
