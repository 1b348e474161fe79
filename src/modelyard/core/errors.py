"""Domain errors: what went wrong, in the platform's words, with no HTTP in them.

Control, batch, store and gateway raise these and nothing else (`tests/test_layers.py` keeps
`APIError` out of them). Each class names its `kind` (a domain word, not a status) and its
OpenAI error `type` (what the body's `error.type` says: `insufficient_quota` for a spent quota,
`invalid_request_error` for a bad key, as OpenAI answers). The HTTP edges turn a kind into a
status through one table, `modelyard.protocol.errors.STATUS_BY_KIND` (the platform's app does it
in one exception handler, `modelyard.api.errors`). `code`, `param`, `retry_after_s` and
`headers` travel with the error so the edge writes the same OpenAI-shaped body the callers
expect.
"""

from __future__ import annotations


class DomainError(Exception):
    kind = "internal"
    type = "server_error"  # the OpenAI error type of the body's `error.type`

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
    type = "invalid_request_error"


class Unauthorized(DomainError):
    """No or unknown credentials."""

    kind = "unauthorized"
    type = "invalid_request_error"


class Forbidden(DomainError):
    """The caller is known but may not do this."""

    kind = "forbidden"
    type = "permission_error"


class NotFound(DomainError):
    """The named thing does not exist (or the caller may not see it)."""

    kind = "not_found"
    type = "not_found_error"


class Conflict(DomainError):
    """The thing exists in a state that forbids this (already there, busy, finished)."""

    kind = "conflict"
    type = "conflict_error"


class TooLarge(DomainError):
    """The request or its payload is over a size limit."""

    kind = "too_large"
    type = "invalid_request_error"


class RateLimited(DomainError):
    """Too many requests or tokens for the caller's limits right now."""

    kind = "rate_limited"
    type = "rate_limit_error"


class QuotaExceeded(DomainError):
    """The caller's quota (monthly tokens, batch budget) is spent."""

    kind = "quota_exceeded"
    type = "insufficient_quota"


class Unavailable(DomainError):
    """A part the request needs is not available (not ready, failed, being replaced)."""

    kind = "unavailable"
    type = "service_unavailable"


class UpstreamFailed(DomainError):
    """A replica or other upstream answered with a failure or could not be reached."""

    kind = "upstream_failed"
    type = "server_error"


def model_not_found(model: str) -> NotFound:
    """The one answer for a model name the caller cannot use, whether it does not exist or
    belongs to another tenant: the same words either way, so the answer leaks no names."""
    return NotFound(
        f"The model `{model}` does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )
