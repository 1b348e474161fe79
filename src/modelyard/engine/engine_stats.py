"""`EngineStats`: the engine's counters since it started (gauges are read from the scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Counters since start; gauges are read from the scheduler when asked."""

    prompt_tokens: int = 0  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int = 0
    steps: int = 0
    failed_steps: int = 0  # steps that raised (their requests were retried one by one)
    busy_seconds: float = 0.0
    requests_finished: dict[str, int] = field(default_factory=dict)
