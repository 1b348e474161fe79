"""The admin CLI against a real `modelyard serve`: run as a subprocess (`python -m modelyard.cli`)
where the process boundary matters (exit codes, stderr, no traceback, the deploy's progress
lines), and through typer's `CliRunner` elsewhere (faster: no interpreter start)."""

from __future__ import annotations

import csv
import io
import json
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from modelyard.cli import app
from tests.platform_harness import PlatformProcess, batch_line, jsonl
from tests.tiny_models import build_model

runner = CliRunner()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli-models")
    build_model(root / "tiny", "llama")
    return root


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory, models: Path) -> Iterator[PlatformProcess]:
    env = {
        "MODELYARD_BATCH_POLL_INTERVAL_S": "0.2",
        "MODELYARD_LOCAL_ARTIFACT_ROOTS": json.dumps([str(models)]),
        "MODELYARD_WORKER_ENGINE": json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"}),
    }
    p = PlatformProcess(tmp_path_factory.mktemp("cli-data"), env).start()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture()
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty config dir and no MODELYARD_* variables, so nothing of the host leaks in."""
    for name in ("MODELYARD_URL", "MODELYARD_API_KEY", "MODELYARD_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(tmp_path)  # no .modelyard/admin_key here
    return tmp_path / "xdg"


def cli(platform: PlatformProcess, *args: str, key: str | None = None) -> Any:
    """Run through CliRunner with the platform's URL and a key from the environment."""
    env = {"MODELYARD_URL": platform.url, "MODELYARD_API_KEY": key or platform.admin_key}
    result = runner.invoke(app, list(args), env=env)
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def cli_json(platform: PlatformProcess, *args: str, key: str | None = None) -> Any:
    return json.loads(cli(platform, *args, "--json", key=key).stdout)


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modelyard.cli", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def deployed(platform: PlatformProcess, models: Path) -> subprocess.CompletedProcess[str]:
    """`modelyard deploy` as a user runs it (a subprocess, so its progress goes to a pipe)."""
    env = {"MODELYARD_URL": platform.url, "MODELYARD_API_KEY": platform.admin_key}
    return run_cli("deploy", "tiny", str(models / "tiny"), "--public", env=env)


def test_deploy_reports_progress_until_ready(
    platform: PlatformProcess, deployed: subprocess.CompletedProcess[str]
) -> None:
    assert deployed.returncode == 0, deployed.stderr + deployed.stdout
    lines = deployed.stdout.splitlines()
    # Not a terminal: a line per change, the load (a starting replica) before the final ready.
    assert any("tiny: provisioning" in ln and "starting" in ln for ln in lines), lines
    assert "tiny: ready · replicas 1/1" in lines[-1], lines
    listed = cli_json(platform, "endpoints", "list")
    assert [e["model_name"] for e in listed] == ["tiny"]
    shown = cli_json(platform, "endpoints", "show", listed[0]["endpoint_id"])
    assert shown["status"] == "ready" and shown["replicas"]["ready"] == 1


def test_deploy_that_fails_exits_non_zero(platform: PlatformProcess, models: Path) -> None:
    """A model whose weights are no safetensors file: the endpoint fails, and so does deploy."""
    broken = build_model(models / "broken", "llama")
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    env = {"MODELYARD_URL": platform.url, "MODELYARD_API_KEY": platform.admin_key}
    done = run_cli("deploy", "broken", str(broken), "--timeout", "120", "--json", env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert json.loads(done.stdout)["status"] == "failed"  # with --json, stdout is the JSON alone
    assert done.stderr.startswith("error: broken is failed: "), done.stderr
    assert "Traceback" not in done.stderr
    for endpoint in cli_json(platform, "endpoints", "list"):
        if endpoint["model_name"] == "broken":
            cli(platform, "endpoints", "delete", endpoint["endpoint_id"])


def test_tenants_and_keys(platform: PlatformProcess) -> None:
    tenant = cli_json(platform, "tenants", "create", "acme", "--quota", "1000000")
    assert tenant["name"] == "acme" and tenant["monthly_token_quota"] == 1_000_000
    assert "acme" in [t["name"] for t in cli_json(platform, "tenants", "list")]
    updated = cli_json(platform, "tenants", "update", tenant["id"], "--max-rpm", "500")
    assert updated["max_rpm"] == 500
    assert cli_json(platform, "tenants", "show", tenant["id"])["max_rpm"] == 500

    key = cli_json(
        platform, "keys", "create", "--name", "ci", "--tenant", tenant["id"],
        "--scope", "inference", "--scope", "admin", "--rpm", "60",
    )  # fmt: skip
    assert key["key"].startswith("sk-") and key["rpm_limit"] == 60
    # The tenant's own admin key sees its keys, and only them.
    own = cli_json(platform, "keys", "list", key=key["key"])
    assert [k["id"] for k in own] == [key["id"]]
    assert cli_json(platform, "keys", "update", key["id"], "--tpm", "9000")["tpm_limit"] == 9000
    table = cli(platform, "keys", "list").stdout
    assert "API keys" in table and "ID" in table
    # Expiry, allowed models and rotation.
    scoped = cli_json(
        platform, "keys", "create", "--name", "scoped", "--tenant", tenant["id"],
        "--model", "tiny", "--model", "support-*", "--expires", "2099-01-01T00:00:00",
    )  # fmt: skip
    assert scoped["allowed_models"] == ["tiny", "support-*"]
    assert scoped["expires_at"] == 4_070_908_800 and scoped["last_used_at"] is None
    rotated = cli_json(platform, "keys", "rotate", scoped["id"], "--grace", "1h")
    assert rotated["key"].startswith("sk-") and rotated["key"] != scoped["key"]
    assert rotated["previous_key_expires_at"] - rotated["created_at"] >= 3600
    cleared = cli_json(platform, "keys", "update", scoped["id"], "--all-models", "--never-expires")
    assert cleared["allowed_models"] is None and cleared["expires_at"] is None
    for grace in ("soon", "\u00b2h"):  # "²" is a digit to str.isdigit, not to int()
        bad = run_cli("keys", "rotate", scoped["id"], "--grace", grace, env={
            "MODELYARD_URL": platform.url, "MODELYARD_API_KEY": platform.admin_key})  # fmt: skip
        assert bad.returncode == 2 and "duration" in bad.stderr + bad.stdout, bad
    cli(platform, "keys", "revoke", key["id"])
    revoked = {k["id"]: k for k in cli_json(platform, "keys", "list")}[key["id"]]
    assert revoked["revoked_at"] is not None


def test_chat_streams_an_answer(
    platform: PlatformProcess, deployed: subprocess.CompletedProcess[str]
) -> None:
    one_shot = cli(platform, "chat", "tiny", "Hello there", "--max-tokens", "8", "-t", "0")
    # The streamed pieces put together are the answer the API gives unstreamed (greedy).
    whole = platform.openai().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there"}], max_tokens=8,
        temperature=0,
    )  # fmt: skip
    assert one_shot.stdout == f"{whole.choices[0].message.content}\n"
    # The REPL: two turns, the second sent with the first answer as history, then an empty line.
    env = {"MODELYARD_URL": platform.url, "MODELYARD_API_KEY": platform.admin_key}
    repl = runner.invoke(
        app, ["chat", "tiny", "--system", "Be brief.", "--max-tokens", "4"],
        input="Hi\nAgain\n\n", env=env,
    )  # fmt: skip
    assert repl.exit_code == 0, repl.output
    assert repl.stdout.count("> ") >= 3  # three prompts: two turns and the empty line


def test_files_and_batches(
    platform: PlatformProcess, deployed: subprocess.CompletedProcess[str], tmp_path: Path
) -> None:
    requests = tmp_path / "requests.jsonl"
    requests.write_bytes(jsonl([batch_line("a"), batch_line("b", content="Bye")]))
    uploaded = cli(platform, "files", "upload", str(requests))
    assert "uploading requests.jsonl" in uploaded.stdout and "uploaded file-" in uploaded.stdout
    files = cli_json(platform, "files", "list")
    file_id = next(f["id"] for f in files if f["filename"] == "requests.jsonl")
    copy = tmp_path / "copy.jsonl"
    cli(platform, "files", "download", file_id, "-o", str(copy))
    assert copy.read_bytes() == requests.read_bytes()

    batch = cli_json(platform, "batches", "create", file_id, "--wait", "--timeout", "120")
    assert batch["status"] == "completed", batch
    assert batch["request_counts"]["completed"] == 2
    assert batch["id"] in [b["id"] for b in cli_json(platform, "batches", "list")]
    assert cli_json(platform, "batches", "show", batch["id"])["status"] == "completed"
    results = cli(platform, "batches", "results", batch["id"]).stdout
    lines = [json.loads(x) for x in results.splitlines() if x.strip()]
    assert sorted(x["custom_id"] for x in lines) == ["a", "b"]
    assert all(x["response"]["status_code"] == 200 for x in lines)

    cli(platform, "files", "delete", file_id)
    assert file_id not in [f["id"] for f in cli_json(platform, "files", "list")]


def test_usage_shows_the_requests(
    platform: PlatformProcess, deployed: subprocess.CompletedProcess[str]
) -> None:
    cli(platform, "chat", "tiny", "Count me", "--max-tokens", "3")
    usage = cli_json(platform, "usage", "--group-by", "model")
    by_model = {g["model"]: g for g in usage["data"]}
    assert by_model["tiny"]["requests"] >= 1 and by_model["tiny"]["completion_tokens"] >= 1
    days = cli_json(platform, "usage", "--group-by", "day")["data"]
    table = cli(platform, "usage", "--group-by", "day").stdout
    assert days and all(d["day"] in table for d in days) and "total" in table, table
    rows = list(csv.DictReader(io.StringIO(cli(platform, "usage", "export").stdout)))
    assert any(r["model"] == "tiny" for r in rows), rows


def test_registry_devices_and_webhook_secret(
    platform: PlatformProcess, deployed: subprocess.CompletedProcess[str], models: Path
) -> None:
    """`models push|list|show|delete`, `devices` (the fleet) and `webhooks secret [--rotate]`."""
    env = {"MODELYARD_URL": platform.url, "MODELYARD_API_KEY": platform.admin_key}
    pushed = run_cli("models", "push", str(models / "tiny"), "--name", "reg-tiny", env=env)
    assert pushed.returncode == 0 and "pushed reg-tiny:1" in pushed.stdout, pushed.stderr
    listed = cli_json(platform, "models", "list")
    [model] = [m for m in listed if m["name"] == "reg-tiny"]
    assert [v["ref"] for v in model["versions"]] == ["reg-tiny:1"]
    assert "reg-tiny:1" in cli(platform, "models", "list").stdout
    shown = cli_json(platform, "models", "show", "reg-tiny")
    assert shown["id"] == model["id"] and shown["versions"][0]["total_size"] > 0
    assert "reg-tiny:1" in cli(platform, "models", "show", "reg-tiny").stdout
    cli(platform, "models", "delete", "reg-tiny")
    assert "reg-tiny" not in [m["name"] for m in cli_json(platform, "models", "list")]
    gone = runner.invoke(app, ["models", "delete", "reg-tiny"], env=env)
    assert gone.exit_code == 1 and "not in the registry" in gone.stderr

    # The fleet: the deployed replica is on a device whose memory it uses.
    [endpoint] = [e for e in cli_json(platform, "endpoints", "list") if e["model_name"] == "tiny"]
    replica = endpoint["replicas"]["items"][0]["id"]
    [device] = [d for d in cli_json(platform, "devices") if replica in d["replicas"]]
    assert 0 < device["used_bytes"] <= device["memory_bytes"]
    assert replica in cli(platform, "devices").stdout

    first = cli_json(platform, "webhooks", "secret")
    assert first["secret"].startswith("whsec_")
    rotated = cli_json(platform, "webhooks", "secret", "--rotate")
    assert rotated["secret"] != first["secret"]
    assert cli_json(platform, "webhooks", "secret")["secret"] == rotated["secret"]


def test_bad_key_prints_the_api_message(platform: PlatformProcess) -> None:
    expected = httpx.get(
        f"{platform.url}/v1/keys", headers={"authorization": "Bearer sk-not-a-key"}
    ).json()["error"]["message"]
    env = {"MODELYARD_URL": platform.url, "MODELYARD_API_KEY": "sk-not-a-key"}
    done = run_cli("keys", "list", "--json", env=env)
    assert done.returncode == 1
    assert done.stderr.strip() == f"error: {expected}"
    assert "Traceback" not in done.stderr and done.stdout == ""
    # A refused create (unknown tenant) is the API's own message too.
    refused = runner.invoke(app, ["keys", "create", "--tenant", "nope"],
                            env={**env, "MODELYARD_API_KEY": platform.admin_key})  # fmt: skip
    assert refused.exit_code == 1 and "error:" in refused.stderr
    assert refused.exception is None or isinstance(refused.exception, SystemExit)


def test_profiles_and_env_overrides(config_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def whoami(*args: str) -> dict[str, Any]:
        result = runner.invoke(app, [*args, "whoami", "--json"])
        assert result.exit_code == 0, result.output
        return dict(json.loads(result.stdout))

    assert whoami()["url"] == "http://127.0.0.1:8000" and whoami()["api_key"] is None
    for name, url, key in (("prod", "http://prod:1", "sk-prod-123456"),
                           ("dev", "http://dev:2", "sk-dev-1234567")):  # fmt: skip
        done = runner.invoke(app, ["login", "--url", url, "--api-key", key, "--profile", name,
                                   "--no-verify"])  # fmt: skip
        assert done.exit_code == 0, done.output
    path = config_home / "modelyard" / "config.toml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert 'default_profile = "dev"' in path.read_text()  # the last login is the default

    assert whoami()["url"] == "http://dev:2"
    assert whoami("--profile", "prod")["url"] == "http://prod:1"
    monkeypatch.setenv("MODELYARD_PROFILE", "prod")
    assert whoami()["url_from"] == "profile prod"
    # The environment overrides the profile; a flag overrides the environment.
    monkeypatch.setenv("MODELYARD_URL", "http://env:3")
    monkeypatch.setenv("MODELYARD_API_KEY", "sk-env-12345")
    me = whoami("--profile", "dev")
    assert (me["url"], me["api_key_from"]) == ("http://env:3", "MODELYARD_API_KEY")
    me = whoami("--url", "http://flag:4", "--api-key", "sk-flag-1234")
    assert (me["url"], me["url_from"], me["api_key_from"]) == (
        "http://flag:4",
        "--url",
        "--api-key",
    )
    # An unknown profile asked for by name is an error, not a silent fallback.
    missing = runner.invoke(app, ["--profile", "nope", "whoami"])
    assert missing.exit_code == 1 and "no profile 'nope'" in missing.stderr


def test_login_checks_the_key(platform: PlatformProcess, config_home: Path) -> None:
    bad = runner.invoke(app, ["login", "--url", platform.url, "--api-key", "sk-wrong"])
    assert bad.exit_code == 1 and "error:" in bad.stderr
    assert not (config_home / "modelyard" / "config.toml").exists()
    good = runner.invoke(app, ["login", "--url", platform.url, "--api-key", platform.admin_key])
    assert good.exit_code == 0, good.output
    # From here the profile alone is enough.
    listed = runner.invoke(app, ["keys", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    assert isinstance(json.loads(listed.stdout), list)


def test_a_url_with_or_without_v1_and_the_models_served_with_their_kind(
    platform: PlatformProcess, deployed: subprocess.CompletedProcess[str], config_home: Path
) -> None:
    """The serve banner prints the OpenAI base URL (`…/v1`); login takes it as well."""
    for url in (platform.url + "/v1", platform.url + "/v1/", platform.url):
        done = runner.invoke(app, ["login", "--url", url, "--api-key", platform.admin_key])
        assert done.exit_code == 0, done.output
        me = runner.invoke(app, ["whoami", "--json"])
        assert json.loads(me.stdout)["url"] == platform.url
    env = {"MODELYARD_URL": platform.url + "/v1", "MODELYARD_API_KEY": platform.admin_key}
    chat = runner.invoke(app, ["models", "served", "--kind", "chat", "--json"], env=env)
    assert chat.exit_code == 0, chat.output
    models = json.loads(chat.stdout)
    assert "tiny" in [m["id"] for m in models] and {m["kind"] for m in models} == {"chat"}
    embedding = runner.invoke(app, ["models", "served", "--kind", "embedding", "--json"], env=env)
    assert json.loads(embedding.stdout) == []
    table = runner.invoke(app, ["models", "served"], env=env)
    assert table.exit_code == 0 and "tiny" in table.stdout and "chat" in table.stdout
    bad = runner.invoke(app, ["models", "served", "--kind", "chatty"], env=env)
    assert bad.exit_code != 0
