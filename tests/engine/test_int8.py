"""Int8 quantization (`quantization: "int8"` weight-only, `"w8a8"` int8 activations too):
weight memory, logit error and greedy agreement against the float32 model on a fixed prompt
set, on a tiny random Llama and on SmolLM2."""

from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch

from modelyard.config import EngineSettings
from modelyard.engine.models.loader import load_model
from modelyard.engine.quantization import (
    Int8Linear,
    fbgemm_available,
    int8_kernel,
    int8_kernel_available,
    quantize_rows,
    weight_bytes,
)
from tests.parity import make_engine, record_logits, run_staggered
from tests.tiny_models import build_model

CPU = torch.device("cpu")


def fixed_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 17, 30, 12)]


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("int8") / "m", "llama", tie_word_embeddings=True)


@functools.cache
def float32_run(folder: Path, prompts: tuple[tuple[int, ...], ...], max_tokens: int) -> tuple:
    """The float32 reference, run once per module for the int8 and w8a8 comparisons."""
    engine = make_engine(folder, block_size=4)
    with record_logits(engine) as records:
        tokens = run_staggered(engine, [list(p) for p in prompts], max_tokens)
    return tokens, records


def compare(
    folder: Path, prompts: list[list[int]], max_tokens: int, mode: str = "int8"
) -> dict[str, float]:
    """`mode` (int8 or w8a8) vs float32 engines on the same prompts: max |logit error|
    (`err`), the largest |logit| (`scale`), top-1 agreement at the positions both runs reached
    with the same context (`top1`), and the share of greedy tokens equal up to each sequence's
    first divergence."""
    runs = {None: float32_run(folder, tuple(map(tuple, prompts)), max_tokens)}
    engine = make_engine(folder, quantization=mode, block_size=4)
    with record_logits(engine) as records:
        runs[mode] = (run_staggered(engine, prompts, max_tokens), records)
    int8_bytes = weight_bytes(engine.runner.model)
    ref = {tuple(t): logits for t, logits in runs[None][1]}
    pairs = [(lg, ref[tuple(t)]) for t, lg in runs[mode][1] if tuple(t) in ref]
    same = total = 0
    for i, toks in runs[None][0].items():
        for a, b in zip(toks, runs[mode][0][i], strict=True):
            if a != b:
                break  # after a divergence the contexts differ: count no further
            same += 1
        total += len(toks)
    return {
        "err": max((q - f).abs().max().item() for q, f in pairs),
        "scale": max(lg.abs().max().item() for _, lg in runs[None][1]),
        "top1": sum(int(q.argmax() == f.argmax()) for q, f in pairs) / len(pairs),
        "greedy": same / total,
        "int8_bytes": int8_bytes,
    }


def teacher_forced_top1(
    folder: Path, prompts: list[list[int]], max_tokens: int, mode: str
) -> float:
    """Top-1 agreement of `mode` with float32 at every position of float32's greedy paths:
    `mode` reads each prefix of float32's own continuation, so one early divergence does not
    leave the rest of the sequence uncompared. (w8a8 is chaotic on SmolLM2: a 1e-6 relative
    change in one attention output moves its free-running greedy agreement by 2x, so a
    free-running comparison measures luck as much as accuracy.)"""
    tokens, records = float32_run(folder, tuple(map(tuple, prompts)), max_tokens)
    ref = {tuple(t): logits for t, logits in records}
    contexts = [p + tokens[i][:k] for i, p in enumerate(prompts) for k in range(max_tokens)]
    engine = make_engine(folder, quantization=mode, block_size=4)
    with record_logits(engine) as got:
        run_staggered(engine, contexts, max_tokens=1)
    pairs = [(lg, ref[tuple(t)]) for t, lg in got if tuple(t) in ref]
    assert len(pairs) == len(contexts)
    return sum(int(q.argmax() == f.argmax()) for q, f in pairs) / len(pairs)


def fp32_bytes(folder: Path) -> int:
    """What the checkpoint's tensors take in float32 (4 bytes per element)."""
    from safetensors import safe_open

    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                if name != "lm_head.weight":  # tied to the embedding where present
                    total += 4 * math.prod(st.get_slice(name).get_shape())
    return total


def available_kernels() -> list[str]:
    kernels = ["dequant"]
    if int8_kernel_available("cpu"):
        kernels.append("int8pack")
    if fbgemm_available():
        kernels.append("fbgemm")
    return kernels


needs_fbgemm = pytest.mark.skipif(
    not fbgemm_available(), reason="FBGEMM's int8 linear is not in this torch build (not x86)"
)


@pytest.mark.parametrize("kernel", ["dequant", "int8pack", "fbgemm"])
def test_int8_linear_matches_dequantized_matmul(kernel: str) -> None:
    if kernel not in available_kernels():
        pytest.skip(f"the {kernel} int8 kernel is not available on this CPU")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 64, generator=g), torch.randn(5, 64, generator=g)
    x[2] *= 100  # one row's outliers must not coarsen the others' activations
    bias = torch.randn(48, generator=g)
    q, scale = quantize_rows(w)
    deq = q.float() * scale[:, None]
    assert (deq - w).abs().max() <= w.abs().amax(1).max() / 127 / 2 + 1e-6  # rounding only
    layer = Int8Linear(q, scale, bias, torch.float32, kernel)
    assert layer.kernel == kernel
    got, want = layer(x), x @ deq.T + bias
    for row in range(5):
        # Weight-only kernels are exact up to float rounding; fbgemm also rounds each token's
        # activations to 7 bits (half a step of its own absmax / 127 per element).
        bound = 1e-3 if kernel != "fbgemm" else 64 * x[row].abs().max() / 127 * deq.abs().max()
        assert (got[row] - want[row]).abs().max() <= bound, (kernel, row)
        # A lone token (fbgemm skips the per-row rescaling there) within the same bound.
        alone = layer(x[row : row + 1])[0]
        assert (alone - want[row]).abs().max() <= bound, (kernel, row, "alone")


def test_each_mode_names_its_kernel_or_what_it_needs() -> None:
    assert int8_kernel("int8", "cpu", torch.float32) in ("int8pack", "dequant")
    assert int8_kernel("int8", "cuda", torch.bfloat16) == "dequant"
    for device, dtype in (("cuda", torch.float32), ("cpu", torch.bfloat16)):
        with pytest.raises(ValueError, match="x86 CPUs with float32"):
            int8_kernel("w8a8", device, dtype)
    if fbgemm_available():
        assert int8_kernel("w8a8", "cpu", torch.float32) == "fbgemm"


def test_auto_dtype_serves_w8a8_in_float32() -> None:
    # An AVX512-BF16 CPU would pick bfloat16, which FBGEMM's int8 matmuls do not take.
    from modelyard.engine.loading import resolve_dtype

    assert resolve_dtype("auto", torch.device("cpu"), "w8a8") == torch.float32
    assert resolve_dtype("auto", torch.device("cuda"), "int8") == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu"), "none") == torch.bfloat16


@pytest.mark.skipif(not fbgemm_available(), reason="w8a8 needs FBGEMM (x86)")
def test_w8a8_calibrates_within_a_short_max_model_len(tiny_tied: Path) -> None:
    """The calibration prefill stays within the positions the load holds: `max_model_len: 64`
    under w8a8 failed to load (its 256-token prefill ran past the RoPE table)."""
    from modelyard.engine.quantization import Int8Linear

    model = load_model(tiny_tied, torch.float32, CPU, 64, quantization="w8a8").model
    assert isinstance(model.lm_head, Int8Linear)


def test_weight_memory_at_most_30_percent_of_fp32(tiny_tied: Path) -> None:
    fp32 = load_model(tiny_tied, torch.float32, CPU, 512, pack_cpu_linears=False).model
    int8 = load_model(tiny_tied, torch.float32, CPU, 512, quantization="int8").model
    assert weight_bytes(int8) <= 0.30 * weight_bytes(fp32)


def test_tiny_int8_close_to_fp32(tiny_tied: Path) -> None:
    got = compare(tiny_tied, fixed_prompts(380), max_tokens=8)
    assert got["err"] <= 0.05 * got["scale"], got
    assert got["top1"] >= 0.9 and got["greedy"] >= 0.9, got


SMOL_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
]


@pytest.mark.timeout(480)  # SmolLM2 quantized and compared: 220 s on a busy 2 vCPU
def test_smollm2_int8_close_to_fp32(smollm2_folder: Path) -> None:
    from modelyard.engine.models.loader import read_model_config
    from modelyard.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(smollm2_folder, read_model_config(smollm2_folder))
    prompts = [tok.encode(p) for p in SMOL_PROMPTS]
    got = compare(smollm2_folder, prompts, max_tokens=4)
    assert got["int8_bytes"] <= 0.30 * fp32_bytes(smollm2_folder)
    assert got["err"] <= 0.08 * got["scale"], got
    assert got["top1"] >= 0.8, got


@needs_fbgemm
@pytest.mark.timeout(900)  # SmolLM2 under w8a8 and fp32: 460 s on a busy 2 vCPU
def test_smollm2_w8a8_close_to_fp32(smollm2_folder: Path) -> None:
    """Int8 activations cost accuracy: bounds from BENCHMARKS.md's measurement, with margin;
    FBGEMM's packed weights take ~1.8 bytes each (counted as 2), the tied head its own copy."""
    from modelyard.engine.models.loader import read_model_config
    from modelyard.engine.tokenizer import Tokenizer

    tok = Tokenizer.load(smollm2_folder, read_model_config(smollm2_folder))
    prompts = [tok.encode(p) for p in SMOL_PROMPTS]
    got = compare(smollm2_folder, prompts, max_tokens=4, mode="w8a8")
    assert got["int8_bytes"] <= 0.60 * fp32_bytes(smollm2_folder)
    assert got["err"] <= 0.15 * got["scale"], got
    top1 = teacher_forced_top1(smollm2_folder, prompts, max_tokens=16, mode="w8a8")
    print(f"w8a8 teacher-forced top-1 agreement with float32: {top1:.3f}")
    assert top1 >= 0.75, top1  # measured 0.83-0.85 (48 positions), with or without C kernels


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineSettings(quantization="int4")  # type: ignore[arg-type]


@pytest.mark.skipif(not fbgemm_available(), reason="w8a8 needs FBGEMM (x86)")
def test_w8a8_steps_of_prompt_chunks_alone_sample_nothing_and_survive(tiny_tied: Path) -> None:
    """A step whose sequences are all mid-prompt (chunked prefill) has no row to sample. The C
    int8 matmul once divided by the row count there, and a worker died of SIGFPE on any prompt
    longer than the step's budget; now such a step computes no logits, and the chunked run's
    tokens equal the one-chunk run's."""
    prompts = [list(range(3, 43)), list(range(50, 77))]
    runs = []
    for budget in (16, 512):
        engine = make_engine(tiny_tied, quantization="w8a8", max_num_batched_tokens=budget)
        runs.append(run_staggered(engine, prompts, max_tokens=6, join_every=0))
    assert runs[0] == runs[1]
    assert all(len(tokens) == 6 for tokens in runs[0].values())
