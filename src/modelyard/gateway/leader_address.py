"""The leading controller's address as a gateway (or a standby) reads it from Redis, to forward
control requests there (`api/control_forward.py`): only a URL signed with the cluster secret."""

from __future__ import annotations

import logging
import time
from typing import Any

from modelyard.core.cluster_auth import verified_leader_url
from modelyard.core.cluster_keys import LEADER_KEY

log = logging.getLogger(__name__)


class LeaderAddress:
    """The leading controller's URL from Redis, cached for a second: only a URL signed with
    the cluster secret (`core.cluster_auth`); anything else in the key is no leader at all,
    so control requests, bearer keys and all, never go where a writer of Redis points them."""

    def __init__(self, redis: Any, secret: str) -> None:
        self.redis = redis
        self.secret = secret
        self._url: str | None = None
        self._at = 0.0
        self._refused: bytes | str | None = None  # the last unsigned value (logged once)

    async def get(self) -> str | None:
        if self._url is None or time.monotonic() - self._at > 1.0:
            try:
                value = await self.redis.get(LEADER_KEY)
            except Exception as exc:
                log.warning("reading the leader's address from Redis failed: %s", exc)
                value = None
            self._url = verified_leader_url(self.secret, value)
            if value is not None and self._url is None and value != self._refused:
                log.error(
                    "the leader's address in Redis (%s) is not signed with this cluster's "
                    "secret: ignored (a wrong MODELYARD_CLUSTER_SECRET, or someone wrote it)",
                    LEADER_KEY,
                )
                self._refused = value
            self._at = time.monotonic()
        return self._url

    def forget(self) -> None:
        self._url = None
