"""Domain errors: what went wrong, in the platform's words, with no HTTP in them.

Control, batch, store and gateway raise these. Each class names its `kind` (a domain word, not a
status); the HTTP edges turn a kind into a status through one table,
`modelyard.protocol.errors.STATUS_BY_KIND` (the platform's app does it in one exception handler,
`modelyard.api.errors`). `code`, `param`, `retry_after_s` and `headers` travel with the error so
the edge writes the same OpenAI-shaped body the callers expect.
"""

from __future__ import annotations


class DomainError(Exception):
    kind = "internal"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})
        if retry_after_s is not None:
            self.headers.setdefault("retry-after", str(retry_after_s))


class Invalid(DomainError):
    """The request is malformed or asks for something impossible."""

    kind = "invalid"


class Unauthorized(DomainError):
    """No or unknown credentials."""

    kind = "unauthorized"


class Forbidden(DomainError):
    """The caller is known but may not do this."""

    kind = "forbidden"


class NotFound(DomainError):
    """The named thing does not exist (or the caller may not see it)."""

    kind = "not_found"


class Conflict(DomainError):
    """The thing exists in a state that forbids this (already there, busy, finished)."""

    kind = "conflict"


class TooLarge(DomainError):
    """The request or its payload is over a size limit."""

    kind = "too_large"


class RateLimited(DomainError):
    """Too many requests or tokens for the caller's limits right now."""

    kind = "rate_limited"


class QuotaExceeded(DomainError):
    """The caller's quota (monthly tokens, batch budget) is spent."""

    kind = "quota_exceeded"


class Overloaded(DomainError):
    """The platform has no room for the request right now; retrying later may succeed."""

    kind = "overloaded"


class Unavailable(DomainError):
    """A part the request needs is not available (not ready, failed, being replaced)."""

    kind = "unavailable"


class UpstreamFailed(DomainError):
    """A replica or other upstream answered with a failure or could not be reached."""

    kind = "upstream_failed"


class TimedOut(DomainError):
    """The request did not finish in its time limit."""

    kind = "timed_out"


def model_not_found(model: str) -> NotFound:
    """The one answer for a model name the caller cannot use, whether it does not exist or
    belongs to another tenant: the same words either way, so the answer leaks no names."""
    return NotFound(
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )
