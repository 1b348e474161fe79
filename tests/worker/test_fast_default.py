"""A worker started on a quantized GGUF with no setting serves it quantized (`engine/defaults.py`),
says so in one log line and in /health, and answers; `MODELYARD_QUANTIZATION=none` wins."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from modelyard.config import EngineSettings
from modelyard.engine.defaults import choose_defaults, cpu_features, describe_model_file
from modelyard.engine.models.loader import to_hf_folder
from tests import process_logs
from tests.conftest import WorkerProcess
from tests.tiny_gguf import build_gguf

# Builds a GGUF and starts two workers: minutes on a busy 2 vCPU machine.
pytestmark = pytest.mark.timeout(900)

NAME = ("--served-model-name", "tiny")
# Steps of at most 16 tokens: a longer prompt is computed in chunks, each a step that samples
# nothing (the LM head once ran on zero rows there and the worker died of SIGFPE).
ENV = {
    "MODELYARD_KV_CACHE_MEMORY": "16MiB",
    "MODELYARD_MAX_TOKENS_CAP": "64",
    "MODELYARD_MAX_NUM_BATCHED_TOKENS": "16",
}


@pytest.fixture(scope="module")
def tiny_q8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gguf(tmp_path_factory.mktemp("gguf") / "tiny.Q8_0.gguf", "Q8_0")


@pytest.fixture(scope="module")
def workers(tiny_q8: Path, cache_dir: Path) -> Iterator[dict[str, WorkerProcess]]:
    to_hf_folder(tiny_q8, cache_dir)  # converted once, before two workers read it
    started = {
        "default": WorkerProcess(str(tiny_q8), ENV, *NAME, "--log-level", "info"),
        "none": WorkerProcess(str(tiny_q8), {**ENV, "MODELYARD_QUANTIZATION": "none"}, *NAME),
    }
    try:
        for worker in started.values():
            worker.wait_ready(timeout=600)
        yield started
    finally:
        for worker in started.values():
            worker.stop()


def numerics(worker: WorkerProcess) -> dict[str, str]:
    body = httpx.get(f"{worker.url}/health", timeout=10).json()
    return dict(body["numerics"])


def complete(worker: WorkerProcess, prompt: str = "Hello world") -> str:
    r = httpx.post(
        f"{worker.url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
              "ignore_eos": True},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8
    return str(r.json()["choices"][0]["text"])


def test_no_setting_serves_a_quantized_gguf_quantized(
    workers: dict[str, WorkerProcess], tiny_q8: Path, cache_dir: Path
) -> None:
    worker = workers["default"]
    expected = choose_defaults(
        describe_model_file(tiny_q8, to_hf_folder(tiny_q8, cache_dir)),
        cpu_features(),
        EngineSettings(),
    )
    got = numerics(worker)
    assert got["quantization"] == expected.quantization
    if cpu_features().fbgemm:  # any x86 CPU: never the dequantized float32 of before
        assert got["quantization"] in ("w8a8", "gguf+w8a8")
        assert "file is Q8_0 GGUF" in got["reason"]
        assert any(why in got["reason"] for why in ("VNNI", "FBGEMM", "GGUF blocks"))
    assert got["dtype"] == "float32" or got["quantization"] == "int8"
    complete(worker)
    # The one line at load, as the worker logged it.
    lines = [
        line for line in process_logs.read_log(worker.log).splitlines() if got["reason"] in line
    ]
    assert len(lines) == 1, process_logs.read_log(worker.log)


def test_quantization_none_wins(workers: dict[str, WorkerProcess]) -> None:
    got = numerics(workers["none"])
    assert got["quantization"] == "none"
    assert got["reason"].startswith("quantization none (set)")
    complete(workers["none"])


def test_the_default_numerics_take_a_prompt_longer_than_a_step(
    workers: dict[str, WorkerProcess],
) -> None:
    """A prompt of several steps' tokens (chunks that sample nothing, then the last one that
    does) is answered, and the worker lives on."""
    worker = workers["default"]
    complete(worker, "Hello world " * 20)  # more than 16 tokens in any tokenizer
    complete(worker)
    assert worker.proc.poll() is None
