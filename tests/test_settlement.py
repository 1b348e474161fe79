"""Every token the client received is billed, through a real `modelyard serve` in both platform
modes (issue 27, finding 5): an endpoint's name cannot turn the Open Inference Protocol into
another route, a client that leaves a tool-call stream (chat or Responses) is billed what it got,
and OIP inference on an embedding model is metered in tokens and held to the quota and TPM.

Streamed events carry the worker's token stamp (`: tokens N`, a comment clients ignore); what a
client received is the stamp of the last event it read."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import update

from modelyard.store.db import Database
from modelyard.store.tables import Endpoint
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
    tiny_models_env,
    usage_rows,
    wait_request_ids,
)
from tests.tiny_encoders import minilm_folder
from tests.tiny_models import build_model

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
    env = {**platform_env, **tiny_models_env(models)}
    data = tmp_path_factory.mktemp("settlement-data")
    p = PlatformProcess(data, env).start()
    try:
        admin = p.api()
        deploy(admin, TINY, str(models / TINY), public=True)
        deploy(admin, "minilm", str(minilm_folder()), public=True)
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
    # A valid OIP body goes to /v2/models/<the name, one segment>/infer: an LLM has none.
    r = t.http.post(f"/v2/models/{legacy}/infer", json=oip_body("hi"))
    assert r.status_code == 404 and "choices" not in r.text, r.text
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
        body = {"model": TINY, "input": "note", "tools": [NOTE_RESPONSES],
                "tool_choice": "required", "max_output_tokens": MAX_TOKENS, "stream": True}  # fmt: skip
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
    t = Tenant(platform, quota=400)
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
    for _ in range(400 // tokens + 2):
        r = t.http.post("/v2/models/minilm/infer", json=oip_body(*texts))
        statuses.append(r.status_code)
        if r.status_code == 429:
            assert "quota" in r.text
            break
    assert statuses[-1] == 429 and set(statuses[:-1]) <= {200}
    # And the key's TPM.
    limited = Tenant(platform, tpm_limit=tokens * 2)
    codes = [
        limited.http.post("/v2/models/minilm/infer", json=oip_body(*texts)).status_code
        for _ in range(4)
    ]
    assert 429 in codes and codes[0] == 200
