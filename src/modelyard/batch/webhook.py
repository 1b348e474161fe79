"""Completion webhooks: the batch object POSTed to a URL, HMAC-signed, retried with backoff.

The signature header is `X-Modelyard-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of
"<t>.<body>">`, so a receiver can check both the sender and the freshness.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from typing import Any
from urllib.parse import urlparse

import aiohttp
import orjson

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-Modelyard-Signature"


def sign(secret: str, body: bytes, timestamp: int) -> str:
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def verify(secret: str, body: bytes, header: str, tolerance_s: float = 300.0) -> bool:
    """What a receiver runs: constant-time check of the signature and its age."""
    try:
        parts = dict(p.split("=", 1) for p in header.split(","))
        timestamp = int(parts["t"])
    except (ValueError, KeyError):
        return False
    expected = sign(secret, body, timestamp).split("v1=", 1)[1]
    fresh = abs(time.time() - timestamp) <= tolerance_s
    return fresh and hmac.compare_digest(expected, parts.get("v1", ""))


def allowed(url: str, hosts: list[str]) -> bool:
    parsed = urlparse(url)
    return parsed.scheme in ("http", "https") and (parsed.hostname or "") in hosts


async def deliver(
    url: str, secret: str, payload: dict[str, Any], attempts: int = 8, first_delay_s: float = 1.0
) -> bool:
    """POST until a 2xx answer; 1 s, 2 s, 4 s … between tries. True once delivered."""
    body = orjson.dumps(payload)
    delay = first_delay_s
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for attempt in range(1, attempts + 1):
            headers = {
                "content-type": "application/json",
                SIGNATURE_HEADER: sign(secret, body, int(time.time())),
                "user-agent": "modelyard-webhook",
            }
            try:
                async with session.post(url, data=body, headers=headers) as response:
                    if 200 <= response.status < 300:
                        return True
                    log.warning("webhook %s answered %d (try %d)", url, response.status, attempt)
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.warning("webhook %s failed: %r (try %d)", url, exc, attempt)
            if attempt < attempts:
                await asyncio.sleep(delay)
                delay *= 2
    return False
