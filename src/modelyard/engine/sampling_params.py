"""`SamplingParams`: how one request wants its tokens chosen and when it wants them to stop."""

from __future__ import annotations

from dataclasses import dataclass, field

from modelyard.engine.structured import StructuredOutput


class InvalidSamplingParams(ValueError):
    """A sampling parameter is out of range; `param` names it for the API error."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
# The detokenizer holds back and rescans up to the longest stop string on every token.
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_REPETITION_PENALTY = 100.0
SEED_RANGE = (-(2**63), 2**63 - 1)
# Below this a temperature is greedy: dividing logits by it would overflow to inf (and NaN).
GREEDY_TEMPERATURE = 1e-5


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 means no top-k filter
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
    # Constrained decoding: every sampled token must keep the output inside this grammar.
    structured: StructuredOutput | None = None
    lora: str | None = None  # the LoRA adapter this request runs under (None: the base model)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int) -> None:
        """Raise `InvalidSamplingParams` unless every field is one the sampler can run with on a
        model of `vocab_size` tokens. NaN fails every range check, and infinities are out of
        every range, so no non-finite value gets through."""
        top = min(MAX_TOP_LOGPROBS, vocab_size)
        checks: list[tuple[bool, str, str]] = [
            (1 <= self.n <= MAX_N, f"n must be between 1 and {MAX_N}", "n"),
            (self.max_tokens >= 1, "max_tokens must be at least 1", "max_tokens"),
            (0.0 <= self.temperature <= 2.0, "temperature must be between 0 and 2", "temperature"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p"),
            (
                -1 <= self.top_k <= vocab_size,
                f"top_k must be between 1 and the vocabulary size {vocab_size} (0 or -1: off)",
                "top_k",
            ),
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
            (
                0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]",
                "repetition_penalty",
            ),
            (
                self.seed is None or SEED_RANGE[0] <= self.seed <= SEED_RANGE[1],
                "seed must be a signed 64-bit integer",
                "seed",
            ),
            (
                len(self.stop) <= MAX_STOP_SEQUENCES,
                f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed",
                "stop",
            ),
            (all(self.stop), "stop sequences must not be empty", "stop"),
            (
                all(len(s) <= MAX_STOP_CHARS for s in self.stop),
                f"a stop sequence may be at most {MAX_STOP_CHARS} characters long",
                "stop",
            ),
            (all(_encodable(s) for s in self.stop), "stop sequences must be valid Unicode", "stop"),
            (
                len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed",
                "stop_token_ids",
            ),
            (
                all(0 <= t < vocab_size for t in self.stop_token_ids),
                f"stop_token_ids must be in [0, {vocab_size})",
                "stop_token_ids",
            ),
            (
                all(0 <= t < vocab_size for t in self.extra_eos_token_ids),
                f"extra_eos_token_ids must be in [0, {vocab_size})",
                "extra_eos_token_ids",
            ),
            (
                all(0 <= t < vocab_size and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
                f"logit_bias keys must be token ids in [0, {vocab_size}) and its values "
                "between -100 and 100",
                "logit_bias",
            ),
            (
                self.logprobs is None or 0 <= self.logprobs <= top,
                f"top_logprobs must be between 0 and {top}",
                "top_logprobs",
            ),
        ]
        for ok, message, param in checks:
            if not ok:
                raise InvalidSamplingParams(message, param)
