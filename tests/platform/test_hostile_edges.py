"""What a hostile tenant reaches at the platform's edges (issue 27), on a real `modelyard
serve` in both store modes: a request whose own grammar fails inside an engine step is that
request's 400 and costs no other tenant anything (the replica is neither benched by the
gateway's breaker nor killed for failed steps), every time it is asked for (a matcher that broke
is never reused); hostile grammars sent at once (a lexer bomb, a rule chain deep enough to
overflow a thread's stack) are their own 400s while another tenant is served; a prompt cut by
`no_progress_timeout_s` in its prefill is billed for its prompt; a tenant's model name reaches
an admin's terminal (`modelyard endpoints list`/`show`) and spreadsheet (usage CSV) inert; a
metrics-only key reads no configuration.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.platform_harness import (
    PlatformProcess,
    batch_line,
    create_key,
    create_tenant,
    deploy,
    jsonl,
    platform_running,
    read_jsonl,
    tiny_models_env,
    usage_rows,
    wait_batch,
    wait_request_ids,
    wait_status,
    wait_usage,
)

# A regex whose matcher gives up inside the step that samples its first token (llguidance:
# "lexer error: too many expressions constructed"): the request's own doing.
BROKEN_GRAMMAR = "(x{1000}){1000}"
# 2,800 chained Lark rules (48 kB, under the 64 kB spec bound): compiled recursively, this
# overflowed a default 8 MiB thread stack and killed the worker with SIGSEGV.
DEEP_GRAMMAR = "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}?\n' for i in range(2799)) + 'r2799: "z"'
# Terminal escapes (title, clear screen, a hyperlink), rich markup and a spreadsheet formula.
EVIL_NAME = '=HYPERLINK("http://x")\x1b]0;pwned\x07\x1b[2J\x1b]8;;http://x\x1b\\[bold]b[/bold]\r'
NO_PROGRESS = {"no_progress_timeout_s": 1e-3}
CHAT = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def platform(
    platform_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, models_dir: Path
) -> Iterator[PlatformProcess]:
    env = {
        **tiny_models_env(models_dir),
        **platform_env,
        # A replica whose breaker is open shows as a prompt 429 instead of a long wait.
        "MODELYARD_ADMISSION_TIMEOUT_S": "3",
    }
    with platform_running(tmp_path_factory.mktemp("data"), env) as p:
        yield p


@pytest.fixture(scope="module")
def world(platform: PlatformProcess, models_dir: Path) -> dict[str, Any]:
    admin = platform.api()
    tiny = str(models_dir / "tiny")
    a, b = create_tenant(admin, "hostile"), create_tenant(admin, "bystander")
    a_admin = create_key(admin, a, scopes=["admin", "inference"])["key"]
    world: dict[str, Any] = {
        "public": deploy(admin, "tiny", tiny, wait=False, public=True),
        # Every request here runs out of `no_progress_timeout_s` before its first token.
        "slow": deploy(admin, "tiny-slow", tiny, wait=False, public=True, engine=NO_PROGRESS),
        # (A name like EVIL_NAME is refused at deploy since endpoint names have a pattern.)
        "evil": deploy(platform.api(a_admin), "hostile/model", tiny, wait=False),
        "a_admin": a_admin,
        "a_inference": create_key(admin, a, scopes=["inference"])["key"],
        "a_metrics": create_key(admin, a, scopes=["metrics"])["key"],
        "b_inference": create_key(admin, b, scopes=["inference"])["key"],
    }
    for endpoint in ("public", "slow", "evil"):
        wait_status(admin, world[endpoint], "ready")
    return world


def _post(platform: PlatformProcess, key: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{platform.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json=body,
        timeout=120,
    )


def test_a_failing_grammar_fails_its_request_alone(
    platform: PlatformProcess, world: dict[str, Any]
) -> None:
    workers = platform.worker_pids()
    # ignore_eos: an end of text sampled first goes to the matcher too (which refuses it).
    hostile = {**CHAT, "model": "tiny", "ignore_eos": True}
    # One after another (each is a step of its own that fails), more than the breaker's
    # minimum of outcomes and the engine's streak of failed steps; streamed and not. The same
    # pattern each time: the cached grammar gives each request a fresh matcher, never the one
    # that broke (which "completed" empty: a 200 with no text).
    answers = [
        _post(
            platform,
            world["a_inference"],
            {**hostile, "guided_regex": BROKEN_GRAMMAR, "stream": i % 2 == 1},
        )
        for i in range(10)
    ]
    for r in answers:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert '"code": "structured_output_failed"' in r.text.replace('":"', '": "'), r.text
        else:
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "structured_output_failed", error
            assert error["param"] == "response_format"
    # Another tenant on the same public model: served at once, by the same worker.
    r = _post(platform, world["b_inference"], {**CHAT, "model": "tiny"})
    assert r.status_code == 200, r.text
    assert platform.worker_pids() == workers


def test_hostile_grammars_at_once_are_their_own_400s(
    platform: PlatformProcess, world: dict[str, Any]
) -> None:
    workers = platform.worker_pids()
    hostile = [
        {**CHAT, "model": "tiny", "ignore_eos": True, "guided_regex": BROKEN_GRAMMAR},
        {**CHAT, "model": "tiny", "guided_grammar": DEEP_GRAMMAR},
    ] * 3
    with ThreadPoolExecutor(len(hostile) + 1) as pool:
        sent = [pool.submit(_post, platform, world["a_inference"], body) for body in hostile]
        bystander = _post(platform, world["b_inference"], {**CHAT, "model": "tiny"})
        answers = [future.result() for future in sent]
    assert bystander.status_code == 200, bystander.text
    for r in answers:
        # The lexer bomb breaks in its first step (structured_output_failed); the rule chain
        # compiles (on a thread with room for its recursion) and runs its few tokens.
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            assert r.json()["error"]["code"] == "structured_output_failed", r.text
    assert [r.status_code for r in answers[::2]] == [400] * 3
    assert platform.worker_pids() == workers  # no replica died or was killed


def test_a_prefill_cut_by_no_progress_is_billed(
    platform: PlatformProcess, world: dict[str, Any]
) -> None:
    body = {**CHAT, "model": "tiny-slow", "messages": [{"role": "user", "content": "a b " * 200}]}
    r = _post(platform, world["b_inference"], body)
    assert r.status_code == 504, r.text
    assert r.json()["error"]["code"] == "no_progress_timeout"
    request_id = r.headers["x-request-id"]
    (row,) = [
        row
        for row in wait_request_ids(platform.api(), [request_id])
        if row["request_id"] == request_id
    ]
    assert int(row["prompt_tokens"]) > 200 and int(row["completion_tokens"]) == 0
    assert row["status_code"] == "504"


def test_a_responses_prefill_cut_by_no_progress_is_billed(
    platform: PlatformProcess, world: dict[str, Any]
) -> None:
    r = httpx.post(
        f"{platform.url}/v1/responses",
        headers={"authorization": f"Bearer {world['b_inference']}"},
        json={"model": "tiny-slow", "input": "a b " * 200, "max_output_tokens": 4},
        timeout=120,
    )
    assert r.status_code == 504, r.text
    request_id = r.headers["x-request-id"]
    (row,) = [
        row
        for row in wait_request_ids(platform.api(), [request_id])
        if row["request_id"] == request_id
    ]
    assert int(row["prompt_tokens"]) > 200 and int(row["completion_tokens"]) == 0


def test_a_batch_item_cut_by_no_progress_is_billed(
    platform: PlatformProcess, world: dict[str, Any]
) -> None:
    client = platform.openai(world["b_inference"])
    line = batch_line("slow", content="a b " * 200, model="tiny-slow")
    upload = client.files.create(file=("in.jsonl", io.BytesIO(jsonl([line]))), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = wait_batch(client, batch.id, {"completed", "failed"})
    (item,) = read_jsonl(client, done.error_file_id) + read_jsonl(client, done.output_file_id)
    assert item["response"]["status_code"] == 504, item

    def billed(rows: list[dict[str, str]]) -> bool:
        return any(
            row["model"] == "tiny-slow" and row["status_code"] == "504" and row["batch"] in
            ("1", "true", "True") and int(row["prompt_tokens"]) > 200
            for row in rows
        )  # fmt: skip

    wait_usage(platform.api(), billed)


def _cli(platform: PlatformProcess, *args: str) -> str:
    env = {
        **os.environ,
        "MODELYARD_URL": platform.url,
        "MODELYARD_API_KEY": platform.admin_key,
        "COLUMNS": "400",
    }
    done = subprocess.run(
        [sys.executable, "-m", "modelyard.cli", *args],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_tenant_names_reach_the_admin_inert(
    platform: PlatformProcess, world: dict[str, Any]
) -> None:
    # Terminal escapes, markup and formulas never become a name: refused at deploy.
    r = platform.api(world["a_admin"]).post(
        "/v1/models/deploy", json={"model_name": EVIL_NAME, "model_artifact": "x"}
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model_name"
    for args in (("endpoints", "list"), ("endpoints", "show", world["evil"])):
        out = _cli(platform, *args)
        assert "\x1b" not in out and "\x07" not in out and "\r" not in out, repr(out)
        assert "hostile/model" in out, out


def test_a_metrics_key_reads_no_configuration(
    platform: PlatformProcess, world: dict[str, Any]
) -> None:
    reads = [
        "/v1/endpoints",
        f"/v1/endpoints/{world['evil']}",
        "/v1/models",
        "/v1/models/tiny",
        "/v1/webhooks/secret",
    ]
    metrics_key = {"authorization": f"Bearer {world['a_metrics']}"}
    for path in reads:
        r = httpx.get(platform.url + path, headers=metrics_key)
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "insufficient_scope"
    # Its own /metrics it still reads; an inference key still lists its endpoints.
    r = httpx.get(f"{platform.url}/metrics", headers=metrics_key)
    assert r.status_code == 200
    r = httpx.get(
        f"{platform.url}/v1/endpoints", headers={"authorization": f"Bearer {world['a_inference']}"}
    )
    assert r.status_code == 200 and world["evil"] in {e["endpoint_id"] for e in r.json()["data"]}


def test_a_stored_formula_leaves_the_usage_export_as_text(
    platform: PlatformProcess, world: dict[str, Any]
) -> None:
    """A model name that starts like a formula can no longer be deployed, but rows from before
    that bound (or written by anyone who can write the database) still reach an admin's
    spreadsheet: the export quotes the cell, so a spreadsheet shows it as text."""
    from sqlalchemy import create_engine, insert

    from modelyard.store.repository import now
    from modelyard.store.tables import UsageRecord

    url = platform.env.get("MODELYARD_DATABASE_URL") or (
        f"sqlite:///{platform.data_dir / 'modelyard.db'}"
    )
    row = {
        "request_id": f"legacy-{os.getpid()}-{id(world)}", "tenant_id": "tn-legacy",
        "key_id": "key-legacy", "endpoint_id": None, "model": EVIL_NAME[:200],
        "version_id": None, "kind": "chat.completions", "prompt_tokens": 1,
        "completion_tokens": 1, "cached_tokens": 0, "latency_ms": 1.0, "ttft_ms": None,
        "status_code": 200, "status": "ok", "batch": False, "created_at": now(),
    }  # fmt: skip
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(insert(UsageRecord).values(**row))
    finally:
        engine.dispose()
    rows = {r["request_id"]: r for r in usage_rows(platform.api())}
    cell = rows[row["request_id"]]["model"]
    assert cell.startswith("'=HYPERLINK(") and cell[1:] == row["model"], repr(cell)
