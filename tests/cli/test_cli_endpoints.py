"""`modelyard endpoints list|show|rollout|traffic|promote|rollback` and `modelyard audit list`
against a real `modelyard serve`, run as a user runs them (subprocesses, output to a pipe, so the
progress comes as plain lines): readable tables, `--json`, a rollout followed until the new
version serves, the audit log as a table, JSON and CSV."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelyard.cli_commands.endpoint_tables import (
    canary_summary,
    check_line,
    progress_line,
    slo_line,
    traffic_summary,
    version_rows,
)
from modelyard.registry_client import RegistryClient
from tests.platform_harness import PlatformProcess, tiny_models_env


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, cache_dir: Path
) -> Iterator[PlatformProcess]:
    p = PlatformProcess(tmp_path_factory.mktemp("cli-ep-data"), tiny_models_env(models_dir))
    p.start()
    try:
        yield p
    finally:
        p.stop()


def run(platform: PlatformProcess, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "MODELYARD_URL": platform.url,
        "MODELYARD_API_KEY": platform.admin_key,
        "COLUMNS": "220",  # tables wide enough that ids and cells stay on one line
    }
    return subprocess.run(
        [sys.executable, "-m", "modelyard.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def ok(platform: PlatformProcess, *args: str) -> str:
    done = run(platform, *args)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def as_json(platform: PlatformProcess, *args: str) -> Any:
    return json.loads(ok(platform, *args, "--json"))


@pytest.fixture(scope="module")
def versions(platform: PlatformProcess, models_dir: Path) -> list[str]:
    """`demo:1` and `demo:2` in the registry (the same files: two versions all the same)."""
    registry = RegistryClient(platform.url, platform.admin_key)
    return [str(registry.push(models_dir / "tiny", "demo")["id"]) for _ in range(2)]


@pytest.fixture(scope="module")
def endpoint(platform: PlatformProcess, versions: list[str]) -> str:
    out = ok(platform, "deploy", "demo", "demo:1", "--max-replicas", "2")
    assert "demo: ready · replicas 1/1" in out.splitlines()[-1], out
    [listed] = as_json(platform, "endpoints", "list")
    return str(listed["endpoint_id"])


def test_list_and_show_read_as_tables_and_as_json(
    platform: PlatformProcess, endpoint: str, versions: list[str]
) -> None:
    table = ok(platform, "endpoints", "list")
    row = next(line for line in table.splitlines() if endpoint in line)
    assert "demo" in row and "ready" in row and "1/1" in row and "demo:1 100%" in row, table

    shown = ok(platform, "endpoints", "show", endpoint)
    assert "Versions" in shown and "Replicas" in shown, shown
    version_row = next(line for line in shown.splitlines() if versions[0] in line and "%" in line)
    assert "demo:1" in version_row and "100%" in version_row and "1/1" in version_row, shown

    view = as_json(platform, "endpoints", "show", endpoint)
    assert view["endpoint_id"] == endpoint and view["version_id"] == versions[0]
    assert view["status"] == "ready"


def test_rollout_is_followed_until_the_new_version_serves(
    platform: PlatformProcess, endpoint: str, versions: list[str]
) -> None:
    done = run(platform, "endpoints", "rollout", endpoint, "demo:2")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"rolling {endpoint} out to demo:2"), lines
    assert any("rolling_out" in line for line in lines), lines  # progress while it loads
    assert lines[-1].startswith("✓ demo: ready"), lines
    view = as_json(platform, "endpoints", "show", endpoint)
    assert view["version_id"] == versions[1] and view["model_artifact"] == "demo:2"

    events = as_json(platform, "audit", "list", "--target-id", endpoint)
    assert [e["action"] for e in events] == ["endpoint.rollout", "endpoint.deploy"]
    rollout = events[0]
    assert rollout["before"]["version_id"] == versions[0]
    assert rollout["after"]["version_id"] == versions[1]


def test_a_canary_from_the_cli(
    platform: PlatformProcess, endpoint: str, versions: list[str]
) -> None:
    """After the rollout above demo:2 is stable: a 10 % canary of demo:1, followed until it
    serves; the split moved; promoted; rolled back to demo:2, kept warm. Each step shows in the
    tables and in the audit log."""
    one, two = versions
    done = run(platform, "endpoints", "rollout", endpoint, "demo:1", "--weight", "10")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"rolling {endpoint} out to a 10% canary of demo:1", lines
    assert lines[-1].startswith("✓ demo: ready") and "traffic demo:2 90% · demo:1 10%" in lines[-1]
    view = as_json(platform, "endpoints", "show", endpoint)
    assert view["traffic"] == {two: 90, one: 10}
    assert view["versions"]["canary"]["version_id"] == one
    row = next(line for line in ok(platform, "endpoints", "list").splitlines() if endpoint in line)
    assert "demo:2 90% · demo:1 10%" in row and "demo:1 10% serving" in row, row
    shown = ok(platform, "endpoints", "show", endpoint)
    assert "Canary" in shown and "error rate ≤ stable +" in shown and "canary" in shown, shown

    out = ok(platform, "endpoints", "traffic", endpoint, f"{two}=50", f"{one}=50")
    assert out.strip() == f"{endpoint}: traffic set · traffic demo:2 50% · demo:1 50%", out
    out = ok(platform, "endpoints", "promote", endpoint)
    assert out == f"{endpoint}: promoted · traffic demo:1 100% · demo:2 0% warm\n", out
    assert as_json(platform, "endpoints", "show", endpoint)["version_id"] == one

    # Back to demo:2, kept warm since the promotion: at once, nothing loads.
    out = ok(platform, "endpoints", "rollback", endpoint, "--reason", "answers look off")
    assert re.fullmatch(rf"{endpoint}: rolled back in [0-9.]+ ms · traffic demo:2 100%\n", out)
    view = as_json(platform, "endpoints", "show", endpoint)
    assert view["version_id"] == two and view["last_rollback"]["to_version_id"] == two
    shown = ok(platform, "endpoints", "show", endpoint)
    assert "last rollback" in shown and "demo:1 → demo:2: answers look off" in shown, shown

    events = as_json(platform, "audit", "list", "--target-id", endpoint)
    assert [e["action"] for e in reversed(events)][2:] == [
        "endpoint.version_add",
        "endpoint.traffic",
        "endpoint.promote",
        "endpoint.rollback",
    ]
    traffic = next(e for e in events if e["action"] == "endpoint.traffic")
    assert traffic["before"]["traffic"] == {two: 90, one: 10}
    assert traffic["after"]["traffic"] == {two: 50, one: 50}


def test_audit_list_as_table_json_and_csv(platform: PlatformProcess, endpoint: str) -> None:
    table = ok(platform, "audit", "list")
    deploy_row = next(line for line in table.splitlines() if "endpoint.deploy" in line)
    assert endpoint in deploy_row and "created" in deploy_row, table
    pushes = as_json(platform, "audit", "list", "--action", "model_version.push")
    assert len(pushes) == 2 and {e["after"]["ref"] for e in pushes} == {"demo:1", "demo:2"}

    events = as_json(platform, "audit", "list", "--limit", "1000")
    rows = list(csv.DictReader(io.StringIO(ok(platform, "audit", "list", "--csv"))))
    assert [int(r["id"]) for r in rows] == [e["id"] for e in events]
    assert [r["action"] for r in rows] == [e["action"] for e in events]

    refused = run(platform, "audit", "list", "--action", "Not An Action")
    assert refused.returncode == 1 and refused.stderr.startswith("error: action"), refused.stderr
    assert "Traceback" not in refused.stderr


def test_bad_arguments_are_refused_before_any_request(
    platform: PlatformProcess, endpoint: str
) -> None:
    done = run(platform, "endpoints", "traffic", endpoint, "a=50", "b=40")
    assert done.returncode == 1 and "add up to 90, not 100" in done.stderr, done.stderr
    done = run(platform, "endpoints", "traffic", endpoint, "a:50")
    assert done.returncode == 1 and "VERSION=PERCENT" in done.stderr, done.stderr
    done = run(platform, "endpoints", "rollout", endpoint, "demo:1", "--replicas", "2")
    assert done.returncode == 1 and "--weight" in done.stderr, done.stderr
    done = run(platform, "endpoints", "show", "ep-missing")
    assert done.returncode == 1 and "not found" in done.stderr, done.stderr


def test_tables_read_versions_weights_and_load_progress_from_the_view() -> None:
    """The readers over a view with a canary (the versions API's shape), a replica loading with
    its progress, and a field this CLI does not know: the right cells, no crash."""
    slo = {"max_error_rate_delta": 0.05, "max_p95_ratio": 1.5, "min_samples": 50,
           "window_s": 60.0, "steps": [5, 25, 100]}  # fmt: skip
    check = {"judged": False, "canary_requests": 3, "canary_error_rate": 0.0,
             "canary_p95_ms": 12.0, "stable_requests": 40, "stable_error_rate": 0.025,
             "stable_p95_ms": 10.0}  # fmt: skip
    view = {
        "endpoint_id": "ep-1",
        "model_name": "demo",
        "status": "ready",
        "version_id": "v-1",
        "model_artifact": "demo:1",
        "traffic": {"v-1": 90, "v-2": 10},
        "last_rollback": None,
        "versions": {
            "weights": {"v-1": 90, "v-2": 10},
            "canary": {
                "version_id": "v-2",
                "model_artifact": "demo:2",
                "weight": 10,
                "status": "starting",
                "next_step": 25,
            },
            "items": [
                {
                    "version_id": "v-1",
                    "model_artifact": "demo:1",
                    "role": "stable",
                    "weight": 90,
                    "state": "serving",
                    "replicas": {"ready": 1, "live": 1},
                },
                {
                    "version_id": "v-2",
                    "model_artifact": "demo:2",
                    "role": "canary",
                    "weight": 10,
                    "state": "serving",
                    "replicas": {"ready": 0, "live": 1},
                    "slo": slo,
                    "last_check": check,
                },
            ],
        },
        "replicas": {
            "ready": 1,
            "desired": 1,
            "items": [
                {"id": "r-1", "version_id": "v-1", "state": "ready"},
                {
                    "id": "r-2",
                    "version_id": "v-2",
                    "state": "starting",
                    "load_progress": {"phase": "loading", "fraction": 0.4},
                },
            ],
        },
        "something_new": {"x": 1},
    }
    assert traffic_summary(view) == "demo:1 90% · demo:2 10%"
    assert version_rows(view) == [
        ["v-1", "demo:1", "stable", "90%", "1/1", "serving"],
        ["v-2", "demo:2", "canary", "10%", "0/1", "serving"],
    ]
    assert canary_summary(view) == "demo:2 10% starting → 25%"
    assert slo_line(slo) == (
        "error rate ≤ stable + 5% · p95 ≤ 1.5× stable · ≥ 50 requests in 60 s · steps 5→25→100"
    )
    assert check_line(check) == (
        "canary 0.0% errors, p95 12 ms (3 req) · stable 2.5% errors, p95 10 ms (40 req) · "
        "too few requests to judge"
    )
    line = progress_line(view, 12.0)
    assert "replicas 1/1 (ready, starting: loading 40%)" in line, line
    assert "traffic demo:1 90% · demo:2 10%" in line, line

    # After an automatic rollback: no canary, the reason in the list's CANARY column.
    rolled = {
        **view,
        "traffic": {},
        "versions": {"weights": {}, "canary": None, "items": []},
        "last_rollback": {"reason": "SLO breached: error rate 40.0%", "by": "system"},
    }
    assert traffic_summary(rolled) == "demo:1 100%"
    assert canary_summary(rolled) == "rolled back (system): SLO breached: error rate 40.0%"
    # An older platform: one version, no versions block, no load progress.
    old = {"model_name": "demo", "status": "ready", "version_id": "v-1", "model_artifact": "demo:1"}
    assert traffic_summary(old) == "demo:1 100%" and canary_summary(old) == "-"
