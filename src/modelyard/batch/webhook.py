"""Completion webhooks: an event POSTed to a checked URL, signed the Standard Webhooks way.

Each tenant has its own signing secret (`whsec_<base64 of 32 random bytes>`, made on first use,
readable and rotatable by the tenant), so a tenant can verify its webhooks without being able to
forge another tenant's. The headers are `webhook-id` (the same on every retry of one event),
`webhook-timestamp` (unix seconds) and `webhook-signature: v1,<base64 HMAC-SHA256 of
"<id>.<timestamp>.<body>" keyed by the decoded secret>`: the `standardwebhooks` package and the
openai SDK's `client.webhooks.unwrap` check them as they are. The body is OpenAI's event shape
(`{"object": "event", "type": "batch.completed", "data": {<the batch>}}`).

Delivery re-checks the URL (`WebhookPolicy`) before every try, connects only to the addresses
that check returned, never follows a redirect, and retries with backoff only what may pass later
(a connection failure, 408, 429, 5xx).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import secrets
import socket
import time
from enum import StrEnum
from typing import Any

import aiohttp
import orjson
from aiohttp.abc import AbstractResolver, ResolveResult

from modelyard.batch.webhook_policy import Target, WebhookPolicy, WebhookRefused
from modelyard.store.db import Database
from modelyard.store.tables import Tenant

log = logging.getLogger(__name__)

SECRET_PREFIX = "whsec_"
_RETRY_STATUSES = {408, 429}


class Delivery(StrEnum):
    DELIVERED = "delivered"
    REFUSED = "refused"  # the URL failed the check: nothing was sent
    FAILED = "failed"  # sent, but never a 2xx answer


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def tenant_secret(db: Database, tenant_id: str, rotate: bool = False) -> str:
    """The tenant's signing secret, made (or replaced, with `rotate`) here; blocks on the DB."""
    with db.session() as s:
        tenant = s.get(Tenant, tenant_id, with_for_update=True)
        if tenant is None:
            raise LookupError(tenant_id)
        if rotate or not tenant.webhook_secret:
            tenant.webhook_secret = new_secret()
        return tenant.webhook_secret


def sign(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def event(batch: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's webhook event for a batch that ended (`batch.completed`, `batch.failed`, …)."""
    return {
        "id": "evt_" + str(batch["id"]).removeprefix("batch_"),
        "object": "event",
        "type": f"batch.{batch['status']}",
        "created_at": int(time.time()),
        "data": batch,
    }


class _PinnedResolver(AbstractResolver):
    """Answers the one host of a checked target with the addresses the check saw."""

    def __init__(self, target: Target) -> None:
        self.target = target

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        if host.lower().rstrip(".") != self.target.host:
            raise OSError(f"webhook delivery may only connect to {self.target.host}")
        return [
            ResolveResult(
                hostname=host,
                host=address,
                port=port,
                family=socket.AF_INET6 if ":" in address else socket.AF_INET,
                proto=socket.IPPROTO_TCP,
                flags=socket.AI_NUMERICHOST,
            )
            for address in self.target.addresses
        ]

    async def close(self) -> None:
        pass


async def _post(target: Target, body: bytes, headers: dict[str, str]) -> int:
    connector = aiohttp.TCPConnector(resolver=_PinnedResolver(target), use_dns_cache=False)
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session,
        session.post(target.url, data=body, headers=headers, allow_redirects=False) as response,
    ):
        return response.status


async def deliver(
    url: str,
    policy: WebhookPolicy,
    secret: str,
    payload: dict[str, Any],
    attempts: int = 8,
    first_delay_s: float = 1.0,
    trusted: bool = False,
) -> Delivery:
    """POST until a 2xx answer; 1 s, 2 s, 4 s … between tries. `trusted`: the operator's own
    URL, called without the allowlist (but still pinned and never redirected)."""
    body = orjson.dumps(payload)
    message_id = str(payload["id"])
    delay = first_delay_s
    for attempt in range(1, attempts + 1):
        try:
            target = await asyncio.to_thread(policy.check, url, trusted)
        except WebhookRefused as exc:
            log.warning("webhook %s refused: %s", url, exc)
            return Delivery.REFUSED
        now = int(time.time())
        headers = {
            "content-type": "application/json",
            "user-agent": "modelyard-webhook",
            "webhook-id": message_id,
            "webhook-timestamp": str(now),
            "webhook-signature": sign(secret, message_id, now, body),
        }
        retry = True
        try:
            status = await _post(target, body, headers)
            if 200 <= status < 300:
                return Delivery.DELIVERED
            # A redirect is never followed (it could point anywhere); like a 4xx it is final.
            retry = status >= 500 or status in _RETRY_STATUSES
            log.warning("webhook %s answered %d (try %d)", url, status, attempt)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("webhook %s failed: %r (try %d)", url, exc, attempt)
        if not retry:
            return Delivery.FAILED
        if attempt < attempts:
            await asyncio.sleep(delay)
            delay *= 2
    return Delivery.FAILED
