"""Shared fixtures: tiny random models, the bundled SmolLM2 converted once per run, a real
worker process serving it, and `platform_env`, the platform modes users run (see
`tests/databases.py`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Generator, Iterator
from pathlib import Path

# Two xdist processes share CI's 2 cores. PyTorch takes one OpenMP thread per core in each, and
# the two processes' spinning threads then halved each other's speed: two concurrent runs of
# tests/engine/test_smollm2.py took 139 s against 66 s with one thread each (AMD EPYC, 2 vCPU).
# The worker processes a test starts inherit the variable; settings that name threads still win.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:  # a plugin imported it first: its pool is already sized
        sys.modules["torch"].set_num_threads(1)

import httpx
import pytest

from tests import process_logs
from tests.databases import (
    PLATFORM_MODES,
    platform_mode_env,
    postgres_unreachable,
    redis_unreachable,
    services_required,
)
from tests.loop_stalls import assert_no_loop_stalls, stall_counts, stall_log_env
from tests.tiny_models import build_model


def pytest_sessionstart(session: pytest.Session) -> None:
    """With `CI` set, a missing PostgreSQL or Redis stops the run before any test is skipped."""
    if not services_required():
        return
    reasons = [r for r in (postgres_unreachable(), redis_unreachable()) if r]
    if reasons:
        pytest.exit("CI is set and a required service is down: " + "; ".join(reasons), 3)


# The test files that take 80 s or more (measured on 2 vCPU), longest first. `make test`
# runs two xdist processes that take whole files (`--dist loadfile`) in collection order, which
# this hook sets: `--no-loadscope-reorder` stops xdist from re-sorting the files by how many
# tests each has. So these start first and the processes finish together instead of one
# waiting out the other's last long file.
_LONGEST_FILES = [  # seconds under coverage, AMD EPYC 2 vCPU (AVX2), 2026-12-05
    "test_langchain_standard.py",  # ~300 est.: 165 before its tool/JSON tests ran (~1.8x)
    "test_ray_backend.py",  # 264
    "test_api_fuzz.py",  # ~260 (418 before its examples were halved)
    "test_platform_lifecycle.py",  # 226
    "test_platform_scaling.py",  # 193
    "test_batch.py",  # 178
    "test_chaos_soak.py",  # 174
    "test_smollm2.py",  # 174
    "test_cluster_leader.py",  # 174
    "test_shared_base_adapters.py",  # ~170: both modes, bundled models
    "test_chaos.py",  # 162
    "test_versions.py",  # 147
    "test_settlement.py",  # 134
    "test_stored_config.py",  # 131
    "test_structured_output.py",  # 122
    "test_tensor_parallel.py",  # 121
    "test_cluster.py",  # 116
    "test_platform_encoders.py",  # 112
    "test_platform_failfast.py",  # 102
    "test_platform.py",  # 96
    "test_cluster_owner.py",  # 85
    "test_console.py",  # 81
]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failing test's report carries the logs of the processes the tests started and still
    hold (`serve`, workers, cluster roles): `tests/process_logs.py`."""
    report = yield
    if report.failed:
        for title, text in process_logs.sections():
            report.sections.append((title, text))
    return report


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest files first (a stable sort: each file's tests stay together and in order)."""
    rank = {name: i for i, name in enumerate(_LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module", params=PLATFORM_MODES)
def platform_env(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """Environment for `PlatformProcess`, once per mode users run: `sqlite-memory` (the default
    `modelyard serve`) and `postgres-redis` (a fresh PostgreSQL database and a private Redis
    database number). Module-scoped, so a module's platform starts once per mode."""
    with platform_mode_env(request.param) as env:
        yield env


@pytest.fixture()
def platform_mode(request: pytest.FixtureRequest, platform_env: dict[str, str]) -> str:
    """The id of the mode `platform_env` is in for this test (for mode-specific xfails)."""
    return str(request.node.callspec.params["platform_env"])


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One conversion cache for the whole run, shared with worker subprocesses."""
    path = tmp_path_factory.mktemp("modelyard-cache")
    os.environ["MODELYARD_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding one tiny random Llama, `tiny`, for a module's platform to deploy by path."""
    root = tmp_path_factory.mktemp("models")
    build_model(root / "tiny", "llama")
    return root


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="session")
def smollm2_folder(cache_dir: Path) -> Path:
    from modelyard.engine.models.loader import to_hf_folder

    return to_hf_folder("smollm2", cache_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class WorkerProcess:
    def __init__(self, model: str, env: dict[str, str] | None = None, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "modelyard.cli", "worker", "--model", model]
        cmd += ["--port", str(self.port), "--log-level", "warning", *extra]
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the worker
        # The loop-stall guard on (`tests/loop_stalls.py`).
        self.stall_log, env = stall_log_env(env)
        self.proc = subprocess.Popen(
            cmd, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT
        )
        process_logs.register(self)  # a failing test's report shows this log

    def label(self) -> str:
        return f"modelyard worker on port {self.port}"

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = process_logs.read_log(self.log)
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("worker did not become healthy")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture(scope="session")
def smollm2_worker(smollm2_folder: Path) -> Iterator[WorkerProcess]:
    """A real worker process serving SmolLM2 (converted weights come from the shared cache),
    dequantized: the tests on it check answers float32 gives (e.g. "Paris" for France's capital,
    a 0.08 logit margin that int8 activations flip); the default numerics (`quantization:
    auto`, w8a8 on this file) are tested in `tests/worker/test_fast_default.py`."""
    env = {"MODELYARD_MAX_TOKENS_CAP": "512", "MODELYARD_KV_CACHE_MEMORY": "512MiB"}
    worker = WorkerProcess("smollm2", {**env, "MODELYARD_QUANTIZATION": "none"})
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


@pytest.fixture()
def no_loop_stalls(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test if any process it talks to (the module's `platform`, `chaos` or worker
    fixtures, with their replicas) had its event loop held past the guard's threshold while the
    test ran. Hostile-input modules use it: `pytestmark = pytest.mark.usefixtures(...)`."""
    names = [n for n in request.fixturenames if n in _STALL_SOURCES]
    sources = [request.getfixturevalue(n) for n in names]
    sources = [s for s in sources if hasattr(s, "stall_log")]
    before = stall_counts(*sources)
    yield
    assert_no_loop_stalls(*sources, since=before)


# The fixtures whose processes run with a stall log (`tests/loop_stalls.py`).
_STALL_SOURCES = ("platform", "chaos", "smollm2_worker", "tiny_worker", "worker")
