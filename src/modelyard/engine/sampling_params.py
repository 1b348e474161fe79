"""`SamplingParams`: how one request wants its tokens chosen and when it wants them to stop."""

from __future__ import annotations

from dataclasses import dataclass, field


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; `param` names it for the API error."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k filter
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token and top k
    skip_special_tokens: bool = True
    extra_eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (1 <= self.n <= 128, "n must be between 1 and 128", "n"),
            (self.max_tokens >= 1, "max_tokens must be at least 1", "max_tokens"),
            (0.0 <= self.temperature <= 2.0, "temperature must be between 0 and 2", "temperature"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p"),
            (self.top_k >= 0 or self.top_k == -1, "top_k must be >= 0 (or -1 for off)", "top_k"),
            (0.0 <= self.min_p <= 1.0, "min_p must be between 0 and 1", "min_p"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                "presence_penalty must be between -2 and 2",
                "presence_penalty",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty must be between -2 and 2",
                "frequency_penalty",
            ),
            (self.repetition_penalty > 0.0, "repetition_penalty must be > 0", "repetition_penalty"),
            (len(self.stop) <= 16, "at most 16 stop sequences are allowed", "stop"),
            (all(self.stop), "stop sequences must not be empty", "stop"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}",
                "top_logprobs",
            ),
        ]
        for ok, message, param in checks:
            if not ok:
                raise InvalidSamplingParams(message, param)
        if self.top_k == -1:
            self.top_k = 0
