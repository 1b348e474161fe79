"""The Azure LLM inference traces (2023): arrival burstiness and token sizes, read once.

Data: Azure Public Dataset, `AzureLLMInferenceTrace_{conv,code}.csv` (CC-BY 4.0), one hour each
of a conversation and a code service. Attribution: Patel et al., "Splitwise: Efficient
generative LLM inference using phase splitting", ISCA 2024. The files are not in this repository:
they are found at `../shared/data/azure-llm-inference-2023/` beside the checkout, or `--trace-dir`.

What the simulator takes from each trace:
- `pairs`: every request's (context tokens, generated tokens), drawn whole so the two stay
  correlated;
- `multiplier`: the trace's arrival rate per 2 s bin, smoothed over 30 s and divided by its
  mean (mean 1.0): the minute-scale burstiness of a real service, replayed (from a random
  offset, cyclically) on top of each endpoint's mean rate and daily envelope.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

ATTRIBUTION = (
    "Azure LLM inference traces 2023 (Azure Public Dataset, CC-BY 4.0): Patel et al., "
    '"Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024'
)
KINDS = ("conv", "code")
DATA_NAME = "azure-llm-inference-2023"
BIN_S = 2.0
SMOOTH_BINS = 15


@dataclass(frozen=True)
class Trace:
    kind: str
    prompt: np.ndarray  # context tokens per request
    generated: np.ndarray
    multiplier: np.ndarray  # arrival rate per BIN_S bin / mean rate
    requests_per_s: float

    @property
    def mean_prompt(self) -> float:
        return float(self.prompt.mean())

    @property
    def mean_generated(self) -> float:
        return float(self.generated.mean())


def default_dir() -> Path:
    """`../shared/data/azure-llm-inference-2023` relative to the repository root."""
    root = Path(__file__).resolve().parents[2]
    return root.parent / "shared" / "data" / DATA_NAME


def _stamp(text: str) -> float:
    return datetime.fromisoformat(text.strip()[:26]).timestamp()


def from_rows(kind: str, stamps: np.ndarray, prompt: np.ndarray, generated: np.ndarray) -> Trace:
    stamps = np.sort(stamps - stamps.min())
    counts = np.bincount((stamps // BIN_S).astype(np.int64)).astype(float)
    kernel = np.ones(SMOOTH_BINS) / SMOOTH_BINS
    padded = np.concatenate([counts[-SMOOTH_BINS:], counts, counts[:SMOOTH_BINS]])
    smooth = np.convolve(padded, kernel, mode="same")[SMOOTH_BINS:-SMOOTH_BINS]
    span = max(stamps[-1], BIN_S)
    return Trace(
        kind=kind,
        prompt=prompt.astype(np.int64),
        generated=np.maximum(generated.astype(np.int64), 1),
        multiplier=smooth / smooth.mean(),
        requests_per_s=len(stamps) / span,
    )


def requests(kind: str, directory: Path | None = None) -> tuple[np.ndarray, ...]:
    """Every request of one trace in arrival order: (seconds since the trace's first request,
    context tokens, generated tokens)."""
    path = (directory or default_dir()) / f"AzureLLMInferenceTrace_{kind}.csv"
    if not path.exists():
        raise FileNotFoundError(
            f"{path} not found: put the {DATA_NAME} traces beside the checkout "
            f"(../shared/data/{DATA_NAME}) or pass --trace-dir"
        )
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    stamps = np.array([_stamp(r["TIMESTAMP"]) for r in rows])
    order = np.argsort(stamps, kind="stable")
    prompt = np.array([int(r["ContextTokens"]) for r in rows])
    generated = np.array([int(r["GeneratedTokens"]) for r in rows])
    return (stamps - stamps.min())[order], prompt[order], generated[order]


def load(kind: str, directory: Path | None = None) -> Trace:
    return from_rows(kind, *requests(kind, directory))


def load_all(directory: Path | None = None) -> dict[str, Trace]:
    return {kind: load(kind, directory) for kind in KINDS}
