"""Every token the client received is billed, through a real `modelyard serve` in both platform
modes (issue 27, finding 5): an endpoint's name cannot turn the Open Inference Protocol into
another route, a client that leaves a tool-call stream (chat or Responses) is billed what it got,
OIP inference on an embedding model is metered in tokens and held to the quota and TPM, and a
property over every route (streamed or not, tool calls, OIP, embeddings, clients that leave)
holds: each usage row is the tokens its client received.

Streamed events carry the worker's token stamp (`: tokens N`, a comment clients ignore); what a
client received is the stamp of the last event it read."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import update

from modelyard.gateway.reservation import reservation_bound
from modelyard.store.db import Database
from modelyard.store.tables import Endpoint
from tests.platform_harness import (
    PlatformProcess,
    batch_line,
    create_key,
    create_tenant,
    deploy,
    jsonl,
    tiny_models_env,
    usage_rows,
    wait_batch,
    wait_request_ids,
    wait_status,
    wait_usage,
)
from tests.tiny_encoders import minilm_folder
from tests.tiny_models import build_model

# A hostile input must not hold any process's event loop (tests/loop_stalls.py).
pytestmark = pytest.mark.usefixtures("no_loop_stalls")

TINY = "tiny"
HOSTILE = "x/../../../v1/completions#"
# A compact template that renders tools itself (the tiny model's 512-token context has no room
# for the default tool prompt).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>"
    "{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A call whose arguments take many tokens: the stream is long enough to leave in the middle.
NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 200, "maxLength": 400}},
            "required": ["text"],
        },
    },
}
NOTE_RESPONSES = {"type": "function", "name": "note", "parameters": NOTE["function"]["parameters"]}
MAX_TOKENS = 300


def oip_body(*texts: str) -> dict[str, Any]:
    return {"inputs": [{"name": "text", "shape": [len(texts)], "datatype": "BYTES",
                        "data": list(texts)}]}  # fmt: skip


@pytest.fixture(scope="module")
def platform(
    platform_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, cache_dir: Path
) -> Iterator[PlatformProcess]:
    """Serves `tiny` (tools rendered by its template), `minilm` (embeddings) and `legacy`: an
    LLM endpoint named, in the database, as no deploy may name one now (a row from before names
    were checked), so the platform is started twice."""
    models = tmp_path_factory.mktemp("settlement-models")
    build_model(models / TINY, "llama")
    settings_file = models / TINY / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    settings_file.write_text(json.dumps({**settings, "chat_template": TOOLS_TEMPLATE}))
    env = {**platform_env, **tiny_models_env(models), "MODELYARD_BATCH_POLL_INTERVAL_S": "0.2"}
    data = tmp_path_factory.mktemp("settlement-data")
    p = PlatformProcess(data, env).start()
    try:
        admin = p.api()
        served = [
            deploy(admin, TINY, str(models / TINY), public=True),
            deploy(admin, "minilm", str(minilm_folder()), public=True),
        ]
        legacy = deploy(admin, "legacy", str(models / TINY), public=True)
    finally:
        p.stop()
    url = env.get("MODELYARD_DATABASE_URL") or f"sqlite:///{(data / 'modelyard.db').resolve()}"
    db = Database(url)
    with db.session() as s:
        s.execute(update(Endpoint).where(Endpoint.id == legacy).values(model_name=HOSTILE))
    db.dispose()
    p = PlatformProcess(data, env).start()
    try:
        p.legacy = legacy  # type: ignore[attr-defined]
        for endpoint in served:  # serving again once restarted (its replicas start anew)
            wait_status(p.api(), endpoint, "ready")
        yield p
    finally:
        p.stop()


class Tenant:
    def __init__(self, platform: PlatformProcess, quota: int | None = None, **key: Any) -> None:
        admin = platform.api()
        self.id = create_tenant(admin, f"settle-{time.time_ns()}", quota)
        self.api = platform.api(create_key(admin, self.id, scopes=["admin", "inference"])["key"])
        self.key = create_key(admin, self.id, scopes=["inference"], **key)["key"]
        self.http = platform.api(self.key)


def billed(tenant: Tenant, request_id: str) -> dict[str, str]:
    rows = wait_request_ids(tenant.api, [request_id])
    (row,) = [r for r in rows if r["request_id"] == request_id]
    return row


def leave_stream(
    platform: PlatformProcess, key: str, path: str, body: dict[str, Any], marker: str, wanted: int
) -> tuple[str, int, int]:
    """Stream `body`, read until `wanted` events holding `marker` came, then drop the
    connection: the request id, the last token stamp read and the marked events read."""
    with httpx.stream(
        "POST", f"{platform.url}{path}", json=body,
        headers={"authorization": f"Bearer {key}"}, timeout=60,
    ) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        request_id = r.headers["x-request-id"]
        stamp, seen = 0, 0
        for line in r.iter_lines():
            if line.startswith(": tokens "):
                stamp = int(line.removeprefix(": tokens "))
            seen += marker in line
            if seen >= wanted:
                break
    return request_id, stamp, seen


def test_a_path_in_a_name_is_refused_at_deploy(platform: PlatformProcess) -> None:
    admin = platform.api()
    for name in (HOSTILE, "..", "a/./b", "a?b", "a\x1b[31m", "a b"):
        r = admin.post("/v1/models/deploy", json={"model_name": name, "model_artifact": "x"})
        assert r.status_code in (400, 422) and "model_name" in r.text, (name, r.text)


def test_a_name_reaches_no_other_route_than_its_own(platform: PlatformProcess) -> None:
    t = Tenant(platform)
    legacy = platform.legacy  # type: ignore[attr-defined]
    # A completions body to the OIP route of the endpoint named like a path: it used to reach
    # the worker's /v1/completions (a 200 completion metered as an OIP call of 0 tokens).
    sneak = {"model": HOSTILE, "prompt": "hi", "max_tokens": 8}
    r = t.http.post(f"/v2/models/{legacy}/infer", json=sneak)
    assert r.status_code == 400 and "choices" not in r.text, r.text
    # A valid OIP body never reaches the worker: the gateway knows a chat model serves no
    # /v2/models/<name>/infer and says which routes it does serve.
    r = t.http.post(f"/v2/models/{legacy}/infer", json=oip_body("hi"))
    assert r.status_code == 400 and "choices" not in r.text, r.text
    assert "is a chat model" in r.text and "/v1/chat/completions" in r.text, r.text
    assert not [row for row in usage_rows(t.api) if row["endpoint_id"] == legacy]


@pytest.mark.parametrize("route", ["chat", "responses"])
def test_a_client_leaving_a_tool_call_stream_is_billed_what_it_received(
    platform: PlatformProcess, route: str
) -> None:
    t = Tenant(platform, quota=1_000_000)
    if route == "chat":
        body: dict[str, Any] = {
            "model": TINY, "messages": [{"role": "user", "content": "note"}], "tools": [NOTE],
            "tool_choice": "required", "max_tokens": MAX_TOKENS, "stream": True,
        }  # fmt: skip
        path, marker = "/v1/chat/completions", '"arguments":"'
    else:
        body = {"model": TINY, "input": "note", "tools": [NOTE_RESPONSES], "stream": True,
                "tool_choice": "required", "max_output_tokens": MAX_TOKENS}  # fmt: skip
        path, marker = "/v1/responses", "response.function_call_arguments.delta"
    request_id, received, seen = leave_stream(platform, t.key, path, body, marker, 12)
    assert seen >= 12  # the stream was left in the middle of the call's arguments
    row = billed(t, request_id)
    assert row["status"] == "client_disconnected"
    assert int(row["prompt_tokens"]) > 0
    assert int(row["completion_tokens"]) > 0  # used to be 0: only text deltas were counted
    # Billed: the stamp of the last event that went to the client, so at least what it read
    # (events still in the socket's buffers went to it too).
    assert 0 < received <= int(row["completion_tokens"]) <= MAX_TOKENS


def test_oip_embeddings_are_billed_in_tokens_against_quota_and_tpm(
    platform: PlatformProcess,
) -> None:
    texts = ["The cat sat on the mat.", "Quantum computing uses qubits."]
    t = Tenant(platform, quota=150)
    reference = platform.openai(t.key).embeddings.with_raw_response.create(
        model="minilm", input=texts
    )
    tokens = reference.parse().usage.prompt_tokens
    r = t.http.post("/v2/models/minilm/infer", json=oip_body(*texts))
    assert r.status_code == 200, r.text
    assert r.json()["parameters"]["usage"]["prompt_tokens"] == tokens
    row = billed(t, r.headers["x-request-id"])
    assert row["kind"] == "oip.infer" and int(row["prompt_tokens"]) == tokens > 0
    # The quota holds OIP calls too: they are refused once it is spent.
    statuses = []
    for _ in range(150 // tokens + 2):
        r = t.http.post("/v2/models/minilm/infer", json=oip_body(*texts))
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert "quota" in r.text
            break
    assert statuses[-1] == 429 and set(statuses[:-1]) <= {200}
    # And the key's TPM: room for one call's reservation (its upper bound) and a half.
    bound = reservation_bound("embeddings", {"input": texts}, 0)
    limited = Tenant(platform, tpm_limit=bound + bound // 2)
    codes = [
        limited.http.post("/v2/models/minilm/infer", json=oip_body(*texts)).status_code
        for _ in range(4)
    ]
    assert 429 in codes and codes[0] == 200


def test_batch_items_count_against_the_quota(platform: PlatformProcess) -> None:
    """Batch items settle through the same accounting: their committed rows count against
    the tenant's quota (they used to raise an AttributeError each and count nothing)."""
    # One item (its prompt and 20 tokens) uses more than the quota of 30 on its own.
    t = Tenant(platform, quota=30)
    client = platform.openai(t.key)
    lines = [batch_line(f"i{i}", max_tokens=20, model=TINY, ignore_eos=True) for i in range(3)]
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_batch(client, batch.id, {"completed", "failed"})
    assert batch.status == "completed", batch
    rows = wait_usage(t.api, lambda rows: len(rows) >= 1)
    used = sum(int(r["prompt_tokens"]) + int(r["completion_tokens"]) for r in rows)
    assert used >= 30  # the items admitted before the quota was spent spent it
    # What the items used is on the tenant's quota: the next request is refused.
    body = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = t.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota", r.text


# ----- the property: usage rows are the tokens the client received ---------------------------

PICK = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
            "required": ["color", "ok"],
        },
    },
}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, dict[str, Any], int | None]:
    """A route, its body, and after how many events a streaming client leaves (None: never)."""
    route = draw(st.sampled_from(["chat", "completions", "responses", "embeddings", "oip"]))
    if route in ("embeddings", "oip"):
        texts = draw(st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=3))
        if route == "oip":
            return route, oip_body(*texts), None
        return route, {"model": "minilm", "input": texts}, None
    stream = draw(st.booleans())
    tool = draw(st.sampled_from([None, PICK, NOTE]))
    max_tokens = draw(st.integers(1, 24))
    leave = draw(st.one_of(st.none(), st.integers(1, 12))) if stream else None
    prompt = draw(st.text(min_size=1, max_size=30))
    if route == "completions":
        body: dict[str, Any] = {"model": TINY, "prompt": prompt, "max_tokens": max_tokens}
    elif route == "chat":
        body = {"model": TINY, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens}  # fmt: skip
        if tool is not None:
            body |= {"tools": [tool], "tool_choice": "required"}
    else:
        body = {"model": TINY, "input": prompt, "max_output_tokens": max(max_tokens, 16)}
        if tool is not None:
            f = tool["function"]
            flat = {"type": "function", "name": f["name"], "parameters": f["parameters"]}
            body |= {"tools": [flat], "tool_choice": "required"}
    if stream:
        body["stream"] = True
        if route != "responses" and leave is None:
            body["stream_options"] = {"include_usage": True}
    return route, body, leave


_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
          "responses": "/v1/responses", "embeddings": "/v1/embeddings",
          "oip": "/v2/models/minilm/infer"}  # fmt: skip


def received(
    platform: PlatformProcess, key: str, route: str, body: dict[str, Any], leave: int | None
) -> tuple[str, int | None, int | None, int]:
    """Send one request as a client would; its request id, the prompt and completion tokens it
    was told of (None where a stream it left never told it), and the last token stamp read."""
    headers = {"authorization": f"Bearer {key}"}
    url = f"{platform.url}{_PATHS[route]}"
    if not body.get("stream"):
        r = httpx.post(url, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        answer = r.json()
        usage = answer["parameters"]["usage"] if route == "oip" else answer["usage"]
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
        return r.headers["x-request-id"], prompt, completion, completion
    prompt = completion = None
    stamp, stamps, events = 0, 0, 0
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        request_id = r.headers["x-request-id"]
        for line in r.iter_lines():
            if line.startswith(": tokens "):
                stamp, stamps = int(line.removeprefix(": tokens ")), stamps + 1
            if not line.startswith("data: "):
                continue
            events += 1
            assert stamps == events, (route, body)  # every event says what it brings the bill to
            data = line.removeprefix("data: ")
            if data != "[DONE]":
                obj = json.loads(data)
                usage = obj.get("usage") or (obj.get("response") or {}).get("usage")
                if usage:
                    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
                    completion = usage.get("completion_tokens", usage.get("output_tokens"))
            if leave is not None and events >= leave:
                break
    return request_id, prompt, completion, stamp


# Derandomized (the same examples every run, as CI needs); `MODELYARD_HYPOTHESIS_PROFILE=explore`
# for fresh random examples and more of them.
EXPLORE = os.environ.get("MODELYARD_HYPOTHESIS_PROFILE") == "explore"


@settings(
    max_examples=30 * (5 if EXPLORE else 1),
    derandomize=not EXPLORE,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(batch=st.lists(requests(), min_size=1, max_size=3))
def test_usage_rows_are_the_tokens_the_client_received(
    platform: PlatformProcess, batch: list[tuple[str, dict[str, Any], int | None]]
) -> None:
    t = Tenant(platform)
    sent = [(route, body, leave, *received(platform, t.key, route, body, leave))
            for route, body, leave in batch]  # fmt: skip
    rows = {r["request_id"]: r for r in wait_request_ids(t.api, [s[3] for s in sent])}
    assert len(rows) == len(sent)
    for route, body, leave, request_id, prompt, completion, stamp in sent:
        row = rows[request_id]
        billed = (int(row["prompt_tokens"]), int(row["completion_tokens"]))
        what = (route, body, leave, row)
        if prompt is not None:  # the client was told the usage: exactly that is billed
            assert billed == (prompt, completion), what
            if body.get("stream"):
                assert stamp == completion, what  # the last stamp is the final count
        else:  # it left the stream: billed the stamp of the last event that went to it
            assert billed[0] > 0, what
            cap = body.get("max_tokens") or body.get("max_output_tokens")
            assert stamp <= billed[1] <= cap, what
