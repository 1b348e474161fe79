"""benchmarks/gpu.sh on a machine without a GPU: it says so and exits non-zero before running
anything (no tests, no server, no results folder)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: gpu.sh would run for real")
def test_gpu_script_refuses_without_a_gpu(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    assert "no GPU on this machine" in done.stderr
    assert "==" not in done.stdout  # no part started
    assert not out.exists()
