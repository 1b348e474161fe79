"""What a hostile tenant reaches at the platform's edges (issue 27), on a real `modelyard
serve` in both store modes: a request whose own grammar fails inside an engine step is that
request's 400 and costs no other tenant anything (the replica is neither benched by the
gateway's breaker nor killed for failed steps); a prompt cut by `no_progress_timeout_s` in its
prefill is billed for its prompt; a tenant's model name reaches an admin's terminal (`modelyard
endpoints list`/`show`) and spreadsheet (usage CSV) inert; a metrics-only key reads no
configuration.
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
    tiny_models_env,
    wait_request_ids,
    wait_status,
)

# A regex whose matcher gives up inside the step that samples its first token (llguidance:
# "lexer error: too many expressions constructed"): the request's own doing.
BROKEN_GRAMMAR = "(x{1000}){1000}"
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
    p = PlatformProcess(tmp_path_factory.mktemp("data"), env).start()
    try:
        yield p
    finally:
        p.stop()


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
        "evil": deploy(platform.api(a_admin), EVIL_NAME, tiny, wait=False),
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
    # minimum of outcomes and the engine's streak of failed steps; streamed and not. Each its
    # own pattern: a fresh compile, not the cached one.
    answers = [
        _post(
            platform,
            world["a_inference"],
            {**hostile, "guided_regex": f"{BROKEN_GRAMMAR}{i}", "stream": i % 2 == 1},
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
    for args in (("endpoints", "list"), ("endpoints", "show", world["evil"])):
        out = _cli(platform, *args)
        assert "\x1b" not in out and "\x07" not in out and "\r" not in out, repr(out)
        assert "\\x1b]0;pwned\\x07" in out, out  # shown, as escapes
        assert "[bold]b[/bold]" in out  # markup printed as it is, not obeyed
    # The usage export: the name is a text cell, never a formula.
    r = _post(platform, world["a_inference"], {**CHAT, "model": EVIL_NAME})
    assert r.status_code == 200, r.text
    request_id = r.headers["x-request-id"]
    wait_request_ids(platform.api(), [request_id])
    export = platform.api().get("/v1/usage/export").text
    (row,) = [r for r in csv.DictReader(io.StringIO(export)) if r["request_id"] == request_id]
    assert row["model"] == "'" + EVIL_NAME


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
