#!/usr/bin/env bash
# One command for a GPU node (under 8 minutes on one H100-class GPU):
#   1. the engine's correctness tests on CUDA (MODELYARD_TEST_DEVICE=cuda),
#   2. the serving benchmark (benchmarks/serving.py's load) on a `modelyard worker` serving
#      SmolLM2-135M at concurrency 1 / 64 / 256, beside its roofline (benchmarks/gpu_serving.py),
#   3. the `vllm` runtime end to end (the platform's `vllm serve` command, the same load), if
#      `pip install vllm` works in a throwaway venv.
# Results go to $OUT (else benchmarks/gpu-results/<UTC time>). Without a GPU it says so and
# exits 2 at once. Exit status: 0 when every part that ran passed, 1 otherwise.
#
#   benchmarks/gpu.sh                      # everything
#   GPU_SKIP_VLLM=1 benchmarks/gpu.sh      # tests and modelyard's serving only
set -u
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python; else PY=python3; fi
fi

# A GPU first, cheaply: a device node or nvidia-smi, then torch's own answer.
if ! ls /dev/nvidia[0-9]* >/dev/null 2>&1 \
    && ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu.sh: no GPU on this machine (no /dev/nvidia*, no nvidia-smi); nothing run" >&2
    exit 2
fi
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu.sh: no GPU on this machine (torch.cuda.is_available() is false); nothing run" >&2
    exit 2
fi

OUT=${OUT:-$ROOT/benchmarks/gpu-results/$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
status=0
started=$(date +%s)
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1 || true

echo "== 1. engine correctness tests on CUDA (log: $OUT/tests.log)"
# The engine tests that take MODELYARD_TEST_DEVICE (tests/parity.py's make_engine). Left out:
# the C CPU kernels, w8a8 (FBGEMM: x86 only) and tensor parallelism (gloo CPU ranks).
MODELYARD_TEST_DEVICE=cuda timeout 240 "$PY" -m pytest -q -p no:cacheprovider \
    tests/engine/test_test_device.py tests/engine/test_engine.py \
    tests/engine/test_model_parity.py tests/engine/test_spec_decode.py \
    tests/engine/test_draft_model.py tests/engine/test_async_engine.py \
    tests/engine/test_engine_properties.py tests/engine/test_grammar_engine.py \
    tests/engine/test_preemption.py tests/engine/test_moe.py \
    --junitxml "$OUT/tests.xml" >"$OUT/tests.log" 2>&1
rc=$?
tail -n 3 "$OUT/tests.log"
[ $rc -eq 0 ] || { echo "tests failed (exit $rc)"; status=1; }

echo "== 2. modelyard serving at concurrency 1 / 64 / 256 beside the roofline"
timeout 210 "$PY" benchmarks/gpu_serving.py --server modelyard --out "$OUT" || status=1

echo "== 3. the vllm runtime end to end"
if [ -n "${GPU_SKIP_VLLM:-}" ]; then
    echo "skipped (GPU_SKIP_VLLM set)" | tee "$OUT/vllm.txt"
else
    VENV=${VLLM_VENV:-/tmp/modelyard-vllm-venv}
    left=$((470 - ($(date +%s) - started)))  # keep the whole run under 8 minutes
    if [ "$left" -lt 150 ]; then
        echo "skipped: ${left}s left of the 8 minutes" | tee "$OUT/vllm.txt"
    elif { [ -x "$VENV/bin/vllm" ] || { "$PY" -m venv "$VENV" \
        && timeout $((left - 120)) "$VENV/bin/pip" install -q vllm >"$OUT/vllm-install.log" 2>&1; }; }; then
        timeout $(($(date +%s) - started > 470 ? 10 : 470 - ($(date +%s) - started))) \
            "$PY" benchmarks/gpu_serving.py --server vllm --vllm "$VENV/bin/vllm" --out "$OUT" \
            || status=1
    else
        echo "skipped: pip install vllm failed or ran out of time (log: $OUT/vllm-install.log)" \
            | tee "$OUT/vllm.txt"
    fi
fi

echo "== done in $(($(date +%s) - started))s; results in $OUT (exit $status)"
exit $status
