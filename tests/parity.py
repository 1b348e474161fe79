"""Helpers that compare the engine with transformers on the same weights."""

from __future__ import annotations

import functools
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from modelyard.config import EngineSettings
from modelyard.engine import cpu_kernels
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.sampling_params import SamplingParams

# The device engine tests run on: MODELYARD_TEST_DEVICE (cuda, cuda:1, cpu) when set, as
# benchmarks/gpu.sh sets it; unset, the engine's own default (the `device` setting).
TEST_DEVICE = os.environ.get("MODELYARD_TEST_DEVICE") or None


def make_engine(folder: Path | str, **settings: Any) -> LLMEngine:
    defaults: dict[str, Any] = {"kv_cache_memory": 64 * 2**20, "block_size": 16, "dtype": "float32"}
    if TEST_DEVICE:
        defaults["device"] = TEST_DEVICE
    defaults.update(settings)
    return LLMEngine.from_settings(folder, EngineSettings(**defaults))


def hf_greedy(hf_model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding, EOS disabled so exactly `max_new_tokens` come out."""
    hf_model.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def run_staggered(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, join_every: int = 3
) -> dict[int, list[int]]:
    """Greedy-decode all prompts in one engine; prompt i joins the batch at step i * join_every."""
    results: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished():
        while pending and step >= pending[0][0] * join_every:
            i, prompt = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(str(i), prompt, params)
        for out in engine.step():
            for delta in out.deltas:
                results[int(out.request_id)].extend(delta.token_ids)
        step += 1
        assert step < 10_000, "engine made no progress"
    return results


@contextmanager
def record_logits(engine: LLMEngine) -> Iterator[list[tuple[list[int], torch.Tensor]]]:
    """While active, keep every step's logits with the token ids they followed."""
    records: list[tuple[list[int], torch.Tensor]] = []
    runner = engine.runner
    execute = runner.execute

    def recording(inputs: Any) -> torch.Tensor:
        logits = execute(inputs)
        for seq, row in zip(inputs.sampling_seqs, logits, strict=True):
            records.append((list(seq.token_ids), row.clone()))
        return logits

    runner.execute = recording  # type: ignore[method-assign]
    try:
        yield records
    finally:
        del runner.execute  # back to the class's method


def hf_logits(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0, -1].float()


@functools.cache
def kernel_builds() -> dict[str, cpu_kernels.CpuKernels]:
    """The C kernels as the engine builds them for this CPU, and (x86) built without AVX-512, so
    that their plain-C forms are checked on machines whose own build never takes them. Empty
    where no compiler works."""
    cache_dir = EngineSettings().cache_dir
    native = cpu_kernels.load_kernels(cache_dir)
    if native is None:
        return {}
    builds = {"native": native}
    if platform.machine() in ("x86_64", "AMD64"):
        plain = cpu_kernels.build_kernels(cache_dir, ("-mno-avx512f",))
        assert plain is not None, "the kernels build natively but not without AVX-512"
        builds["plain-c"] = plain
    return builds


PORTABLE_FLAGS = ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c")


@functools.cache
def portable_kernel_builds() -> dict[str, cpu_kernels.CpuKernels]:
    """`kernel_builds`, and (x86) the portable C form, built without AVX2, FMA and F16C too (the
    kernels whose vector forms start at AVX2 take their plain-C forms only there)."""
    builds = dict(kernel_builds())
    if builds and platform.machine() in ("x86_64", "AMD64"):
        portable = cpu_kernels.build_kernels(EngineSettings().cache_dir, PORTABLE_FLAGS)
        assert portable is not None, "the kernels build natively but not in portable C"
        builds["portable-c"] = portable
    return builds
