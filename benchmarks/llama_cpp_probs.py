"""llama.cpp's own next-token distribution at teacher-forced positions, from `llama-server`.

Used by `benchmarks/default_accuracy.py --llama-cpp`. llama-server (built once by
`benchmarks/llama_cpp_build.py`) runs on the same GGUF with its own defaults (f16 KV cache,
flash attention `auto`), one slot, one thread, under `nice`. Each position's prompt is the text's
token ids up to it (`/completion` takes a list of ids and adds no BOS to it), `n_predict: 1`,
`n_probs: K`: without `post_sampling_probs` the server reports the top K of a plain softmax over
the model's logits, before any sampler. `cache_prompt` lets each request evaluate only its new
token(s) over the previous one's KV cache, as a decode step would.

The tokenizers must agree for the ids to mean the same text: `check_tokenizer` compares
llama.cpp's `/tokenize` with ours and raises if they differ anywhere.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from llama_cpp_build import build
from serving import _stop  # terminate, then kill after 20 s: one way for both benchmarks


def _post(base: str, path: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        base + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


@contextmanager
def llama_server(gguf: Path, n_ctx: int, port: int, log: Path) -> Iterator[str]:
    """Start llama-server on `gguf` (one slot, one thread, niced); yields its base URL."""
    cmd = [str(build()), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", "1", "-c", str(n_ctx), "-t", "1", "-tb", "1"]  # fmt: skip
    if shutil.which("nice"):
        cmd = ["nice", "-n", "15", *cmd]
    print(f"starting llama.cpp: {' '.join(cmd)} (log {log})", flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {proc.returncode}, see {log}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not healthy after 120 s, see {log}")
            time.sleep(0.5)
        yield base
    finally:
        _stop(proc)


def check_tokenizer(base: str, text: str, ours: list[int], used: int) -> None:
    """Raise unless llama.cpp tokenizes `text` (no BOS added) into our ids over the first `used`
    tokens (the ids the comparison feeds both); a difference past them is only printed."""
    theirs = _post(base, "/tokenize", {"content": text, "add_special": False})["tokens"]
    if theirs == ours:
        return
    at = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
        min(len(ours), len(theirs)),
    )
    where = (
        f"tokenizers differ on {text[:30]!r}... at token {at}: ours {ours[at : at + 5]} "
        f"({len(ours)} tokens), llama.cpp {theirs[at : at + 5]} ({len(theirs)} tokens)"
    )
    if at < used:
        raise SystemExit(where + "; the token ids compared would not mean the same text")
    print(f"WARNING: {where} (past the {used} tokens that must match)", flush=True)


def top_probs(base: str, text: list[int], start: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row j: llama.cpp's top-k token ids and log-probabilities after `text[: start + j]`."""
    ids, logprobs = [], []
    for n in range(start, len(text)):
        body = {"prompt": text[:n], "n_predict": 1, "n_probs": k, "temperature": 0.0,
                "cache_prompt": True, "post_sampling_probs": False,
                "response_fields": ["completion_probabilities", "tokens_evaluated"]}  # fmt: skip
        got = _post(base, "/completion", body)
        if got.get("tokens_evaluated") != n:
            raise SystemExit(f"llama.cpp evaluated {got.get('tokens_evaluated')} tokens, not {n}")
        top = got["completion_probabilities"][0]["top_logprobs"]
        if len(top) != k:
            raise SystemExit(f"llama.cpp returned {len(top)} of the top {k} probabilities")
        ids.append([t["id"] for t in top])
        logprobs.append([t["logprob"] for t in top])
    return torch.tensor(ids), torch.tensor(logprobs, dtype=torch.float64)


def against_llama(
    logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor
) -> dict[str, float]:
    """Our distribution (softmax of `logits`) on llama.cpp's top-k tokens against llama.cpp's."""
    ours = torch.log_softmax(logits.double(), dim=1).gather(1, ids)
    dp = (ours.exp() - logprobs.exp()).abs()
    top1 = (logits.argmax(1) == ids[:, 0]).double().mean()
    return {
        "top1_agreement_llama_cpp": round(float(top1), 4),
        "max_abs_prob_diff_llama_cpp": round(float(dp.max()), 4),
        "mean_abs_prob_diff_llama_cpp": round(float(dp.mean()), 5),
        "max_abs_logprob_diff_llama_cpp": round(float((ours - logprobs).abs().max()), 3),
    }


def llama_row(
    ref: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, targets: torch.Tensor
) -> dict[str, Any]:
    """llama.cpp's own line: its top-1 against float32's and against the text's next token."""
    top = ids[:, 0]
    return {
        "variant": "llama.cpp",
        "positions": int(ids.shape[0]),
        "top1_agreement": round(float((ref.argmax(1) == top).double().mean()), 4),
        "next_token_hits": round(float((top == targets).double().mean()), 4),
        "top_k": int(ids.shape[1]),
        "min_top_k_mass": round(float(logprobs.exp().sum(1).min()), 4),
        "mean_top_k_mass": round(math.fsum(logprobs.exp().sum(1).tolist()) / len(ids), 4),
    }
