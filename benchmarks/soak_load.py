"""The chaos soak's clients: steady mixed load through the official `openai` SDK with its default
retries (`max_retries=2`), spread over the gateways, every request's outcome and every HTTP
attempt's request id recorded, so the soak can match answers against usage rows afterwards.

Client-side failover (what a client or its load balancer does, stated in the report): each client
has a home gateway; its HTTP transport sends each attempt there and, only when the connection is
refused (`httpx.ConnectError`: nothing was sent), to the next gateway at once. Every other error
(a connection cut mid-answer, a 5xx, a 429) is left to the SDK's own retries, which go through the
same transport. The SDK's default timeout (600 s) is lowered to `timeout_s` so that a hung request
shows up as lost instead of stalling the soak."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai

RETRYABLE_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})
KINDS = ("chat", "chat_stream", "completion", "embedding")
MESSAGES = [{"role": "user", "content": "Tell me a story about a fox"}]


@dataclass
class Attempt:
    """One HTTP attempt the SDK made (its retries included): what came back, if anything."""

    status: int | None = None
    request_id: str | None = None


@dataclass
class Outcome:
    kind: str
    started: float
    ok: bool = False
    status: int | None = None  # the final HTTP status the SDK saw (None: no response at all)
    error: str | None = None
    request_id: str | None = None  # the answered request's id (x-request-id)
    attempts: list[Attempt] = field(default_factory=list)
    seconds: float = 0.0
    mid_stream: bool = False  # a stream that had sent tokens when it failed

    @property
    def verdict(self) -> str:
        """`ok`, `retryable` (an HTTP status the client may retry later), or `lost`."""
        if self.ok:
            return "ok"
        if self.status in RETRYABLE_STATUSES:
            return "retryable"
        return "lost"


class FailoverTransport(httpx.BaseTransport):
    """Sends each attempt to the client's home gateway; on a refused connection, to the next."""

    def __init__(self, gateways: list[str], home: int) -> None:
        self.gateways = [httpx.URL(g) for g in gateways]
        self.home = home
        self.inner = httpx.HTTPTransport()
        self.failovers = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        n = len(self.gateways)
        for k in range(n):
            target = self.gateways[(self.home + k) % n]
            request.url = request.url.copy_with(host=target.host, port=target.port)
            try:
                return self.inner.handle_request(request)
            except httpx.ConnectError:
                if k + 1 == n:
                    raise
                self.failovers += 1
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.inner.close()


class SoakClient:
    """One SDK client with a home gateway; `call(kind)` runs one request and records it."""

    def __init__(
        self,
        gateways: list[str],
        home: int,
        key: str,
        model: str,
        timeout_s: float,
        embed_model: str = "",
    ) -> None:
        self.transport = FailoverTransport(gateways, home)
        self._current: Outcome | None = None
        http = httpx.Client(
            transport=self.transport,
            timeout=timeout_s,
            event_hooks={"request": [self._on_request], "response": [self._on_response]},
        )
        self.sdk = openai.OpenAI(
            base_url=f"{gateways[home]}/v1", api_key=key, http_client=http, timeout=timeout_s
        )  # max_retries: the SDK's default (2)
        self.model = model
        self.embed_model = embed_model

    def _on_request(self, request: httpx.Request) -> None:
        if self._current is not None:
            self._current.attempts.append(Attempt())

    def _on_response(self, response: httpx.Response) -> None:
        if self._current is not None and self._current.attempts:
            attempt = self._current.attempts[-1]
            attempt.status = response.status_code
            attempt.request_id = response.headers.get("x-request-id")

    def call(self, kind: str) -> Outcome:
        outcome = Outcome(kind, time.monotonic())
        self._current = outcome
        try:
            self._run(kind, outcome)
        except openai.APIStatusError as exc:
            outcome.status, outcome.error = exc.status_code, f"{exc.status_code} {_code(exc)}"
        except openai.APIError as exc:  # connection, timeout, an error event in a stream
            outcome.error = f"{type(exc).__name__}: {str(exc)[:160]}"
        except Exception as exc:
            outcome.error = f"{type(exc).__name__}: {str(exc)[:160]}"
        finally:
            outcome.mid_stream &= not outcome.ok
            self._current = None
            outcome.seconds = time.monotonic() - outcome.started
        return outcome

    def _run(self, kind: str, outcome: Outcome) -> None:
        chat = self.sdk.chat.completions
        if kind == "chat":
            raw = chat.with_raw_response.create(
                model=self.model,
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=8,
            )
            outcome.status, outcome.request_id = raw.status_code, raw.headers.get("x-request-id")
            outcome.ok = bool(raw.parse().choices)
        elif kind == "completion":
            raw = self.sdk.completions.with_raw_response.create(
                model=self.model, prompt="Once upon a time", max_tokens=8
            )
            outcome.status, outcome.request_id = raw.status_code, raw.headers.get("x-request-id")
            outcome.ok = bool(raw.parse().choices)
        elif kind == "chat_stream":
            stream = chat.create(model=self.model, messages=MESSAGES, max_tokens=8, stream=True)  # type: ignore[arg-type]
            outcome.status = stream.response.status_code
            outcome.request_id = stream.response.headers.get("x-request-id")
            finished = False
            for chunk in stream:
                outcome.mid_stream = True
                finished |= any(c.finish_reason for c in chunk.choices)
            outcome.ok = finished
            if not finished:
                outcome.error = "stream ended without a finish_reason"
        elif kind == "embedding":
            raw = self.sdk.embeddings.with_raw_response.create(
                model=self.embed_model, input="The quick brown fox"
            )
            outcome.status, outcome.request_id = raw.status_code, raw.headers.get("x-request-id")
            outcome.ok = bool(raw.parse().data)
        else:
            raise ValueError(kind)

    def close(self) -> None:
        self.sdk.close()


def _code(exc: openai.APIStatusError) -> str:
    body = exc.body if isinstance(exc.body, dict) else {}
    inner = body.get("error", body) if isinstance(body, dict) else {}
    return str(inner.get("code") if isinstance(inner, dict) else "")


class Load:
    """`clients` threads, each with its own SDK client (home gateway: client i % gateways), the
    kinds in turn (embeddings only with an `embed_model`), paced so that all together send about
    `rate` requests a second."""

    def __init__(
        self,
        gateways: list[str],
        key: str,
        model: str,
        clients: int,
        rate: float,
        timeout_s: float = 30.0,
        embed_model: str = "",
    ) -> None:
        self.kinds = KINDS if embed_model else KINDS[:-1]
        self.clients = [
            SoakClient(gateways, i % len(gateways), key, model, timeout_s, embed_model)
            for i in range(clients)
        ]
        self.gap_s = clients / rate
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(c, i), daemon=True, name=f"soak-client-{i}")
            for i, c in enumerate(self.clients)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _run(self, client: SoakClient, index: int) -> None:
        kinds = itertools.islice(itertools.cycle(self.kinds), index % len(self.kinds), None)
        next_at = time.monotonic()
        for kind in kinds:
            if self._stop.is_set():
                return
            outcome = client.call(kind)
            with self._lock:
                self.outcomes.append(outcome)
            next_at += self.gap_s
            # The pace of the load generator, not a synchronisation: a steady offered rate.
            self._stop.wait(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at, time.monotonic() - self.gap_s)

    def count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def stop(self, timeout: float = 120.0) -> list[Outcome]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        for c in self.clients:
            c.close()
        with self._lock:
            return list(self.outcomes)

    @property
    def failovers(self) -> int:
        return sum(c.transport.failovers for c in self.clients)


def tally(outcomes: list[Outcome]) -> dict[str, Any]:
    """Counts for the report: sent, succeeded, failed with a retryable status, lost."""
    verdicts = [o.verdict for o in outcomes]
    attempts = sum(len(o.attempts) for o in outcomes)
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            label = f"{o.kind}: {o.error or o.status}"[:160]
            errors[label] = errors.get(label, 0) + 1
    by_kind = {
        k: {
            v: sum(1 for o in outcomes if o.kind == k and o.verdict == v)
            for v in ("ok", "retryable", "lost")
        }
        for k in KINDS
        if any(o.kind == k for o in outcomes)
    }
    return {
        "sent": len(outcomes),
        "succeeded": verdicts.count("ok"),
        "failed_retryable_status": verdicts.count("retryable"),
        "lost": verdicts.count("lost"),
        # Of those lost: streams cut after their first tokens (never re-sent, by design).
        "lost_mid_stream": sum(1 for o in outcomes if o.verdict == "lost" and o.mid_stream),
        "http_attempts": attempts,
        "sdk_retries": attempts - len(outcomes),
        "by_kind": by_kind,
        "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:20]),
    }
