"""Whether the limits store (Redis) answers, and what the gateway does while it does not.

A breaker with its trial in the background, never on a request's path: the first Redis call
that fails (an admission, a settlement, the heartbeat) opens it (`trip`), and from then on no
request waits on Redis: each is admitted on this gateway's own shares of its limits
(`local_limits.py`, `redis_outage = fail_open`) or refused at once with a 503
(`fail_closed`), and each settlement goes to the journal (`settlement_journal.py`). A
heartbeat task calls Redis every `probe_every_s` (one Lua script, bounded by the client's
`redis_timeout_s`): while healthy it counts the live gateways (a sorted set of heartbeats, the
N the shares divide by) and reads the Redis data set's epoch; the first heartbeat that succeeds
after an outage applies the journal, then closes the breaker, and admission goes through Redis
again. Entries still pending (settlements of requests admitted during the outage, another
gateway's) are applied on later ticks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterator

from modelyard.config import RedisOutage
from modelyard.core.errors import Unavailable
from modelyard.core.identity import Principal
from modelyard.gateway.local_limits import LocalLimits
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.quota import LimitsUnavailable, RedisQuotaCounter, shared_store
from modelyard.gateway.settlement import Settlement
from modelyard.gateway.settlement_journal import EPOCH_KEY, SettlementJournal

log = logging.getLogger(__name__)

# A sorted set: gateway id -> its last heartbeat (Redis server time).
GATEWAYS_KEY = "modelyard:limits:gateways"
# Entries other gateways left in the database are looked for this often, even with none here.
SWEEP_EVERY_S = 30.0

# KEYS: the gateways' heartbeats, the epoch. ARGV: this gateway's id, how long a heartbeat
# counts (s), an epoch to write if the data set has none. Returns {live gateways, the epoch}.
_HEARTBEAT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local alive = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], string.format('%.6f', now), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.6f', now - alive))
redis.call('EXPIRE', KEYS[1], math.ceil(alive * 2))
redis.call('SET', KEYS[2], ARGV[3], 'NX')
return {redis.call('ZCARD', KEYS[1]), redis.call('GET', KEYS[2])}
"""


def unsent(exc: LimitsUnavailable) -> bool:
    """Whether the failed call certainly never reached Redis (its connection was refused or
    never made). A timeout, or a connection cut while waiting for the answer, is ambiguous:
    the script may have run."""
    cause: BaseException | None = exc.__cause__
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError) or "connecting to" in str(cause):
            return True
        cause = cause.__cause__
    return False


class LimitsOutage:
    """The breaker over the limits store, its heartbeat, the local shares and the journal."""

    def __init__(
        self,
        quota: RedisQuotaCounter,
        journal: SettlementJournal,
        local: LocalLimits,
        metrics: GatewayMetrics,
        mode: RedisOutage,
        probe_every_s: float = 0.5,
        alive_s: float = 5.0,
    ) -> None:
        self.journal = journal
        self.local = local
        self.metrics = metrics
        self.mode = mode
        self.probe_every_s = probe_every_s
        self.alive_s = alive_s
        self.id = uuid.uuid4().hex
        self.degraded = False
        self.since = 0.0  # when the current outage began (monotonic)
        self.gateways = 1  # live gateways at the last heartbeat (this one included)
        self.epoch = ""  # the Redis data set's epoch at the last heartbeat
        self._redis = quota.redis
        self._beat = quota.redis.register_script(_HEARTBEAT_LUA)
        self._swept = 0.0
        self._task: asyncio.Task[None] | None = None

    @property
    def fail_open(self) -> bool:
        return self.mode == RedisOutage.FAIL_OPEN

    def trip(self, exc: LimitsUnavailable) -> None:
        """A Redis call failed: requests stop waiting on Redis until a heartbeat succeeds."""
        if self.degraded:
            return
        self.degraded = True
        self.since = time.monotonic()
        self.metrics.limits_degraded.set(1)
        how = (
            f"on this gateway's shares of each limit (1/{self.gateways})"
            if self.fail_open
            else "nothing (fail_closed: 503)"
        )
        log.warning("the limits store does not answer (%s): admitting %s until it does", exc, how)

    async def start(self) -> None:
        await self.probe()
        self._task = asyncio.create_task(self._run(), name="limits-heartbeat")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.journal.save()  # what Redis has not taken yet waits in the database
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._redis.zrem(GATEWAYS_KEY, self.id), 1.0)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.probe_every_s)
            try:
                await self.probe()
            except Exception:  # the heartbeat must outlive any one failure
                log.exception("the limits heartbeat failed")

    async def probe(self) -> None:
        """One heartbeat; after an outage (or with entries pending), the journal applied."""
        try:
            live, epoch = await self._heartbeat()
        except LimitsUnavailable as exc:
            self.trip(exc)
            await self.journal.save()
            return
        self.gateways = max(1, int(live))
        self.metrics.limits_gateways.set(self.gateways)
        self.epoch = epoch.decode() if isinstance(epoch, bytes) else str(epoch)
        now = time.monotonic()
        sweep = now - self._swept >= SWEEP_EVERY_S
        if self.degraded or self.journal.pending or sweep:
            try:
                applied = await self.journal.reconcile()
            except LimitsUnavailable as exc:
                self.trip(exc)
                return
            self._swept = now
            if applied:
                log.info("applied %d settlements journaled while Redis was away", applied)
        if self.degraded:
            self.degraded = False
            self.local.reset()
            self.metrics.limits_degraded.set(0)
            log.warning(
                "the limits store answers again after %.1f s: admission goes through it",
                now - self.since,
            )

    @shared_store
    async def _heartbeat(self) -> tuple[int, bytes | str]:
        live, epoch = await self._beat(
            keys=[GATEWAYS_KEY, EPOCH_KEY], args=[self.id, self.alive_s, uuid.uuid4().hex]
        )
        return int(live), epoch

    def journal_settlement(self, s: Settlement, exc: LimitsUnavailable | None) -> None:
        """A settlement Redis did not take (`exc`; None: not sent, Redis being away):
        journaled. Only its slot release when the script may have run (releasing twice is
        harmless, moving the quota twice is not): the counter then keeps the request's
        reservation, never below its real count."""
        if exc is not None:
            self.trip(exc)
        if exc is None or unsent(exc):
            self.journal.add(s.tenant_id, self.epoch, s.quota_moves, s.slot)
        else:
            log.warning("a settlement may or may not have reached Redis: its quota stays held")
            self.journal.add(s.tenant_id, self.epoch, [], s.slot)

    def journal_admission(
        self, p: Principal, slot: tuple[str, str] | None, exc: LimitsUnavailable
    ) -> None:
        """An admission script that failed after it was sent may have taken a slot in Redis:
        released later (the request goes on locally, or is refused)."""
        if slot is not None and not unsent(exc):
            self.journal.add(p.tenant_id, self.epoch, [], slot)

    async def settle_locally(
        self, generation: int, s: Settlement, held: tuple[str, int], principal: Principal
    ) -> None:
        """A locally admitted request's settlement: on its shares here, and into the journal
        for Redis, which never saw its reservation (`held`: month, tokens)."""
        await self.local.settle(
            generation, principal, self.gateways, s.tokens_back, s.quota_moves, s.slot
        )
        month, reserved = held
        moves = [*s.quota_moves, (month, reserved)] if reserved else list(s.quota_moves)
        self.journal.add(s.tenant_id, self.epoch, moves, None)


def limits_unavailable() -> Unavailable:
    """The 503 a request gets while its limits cannot be checked (`fail_closed`)."""
    return Unavailable(
        "Rate limits and quotas cannot be checked right now; please retry shortly.",
        code="limits_unavailable",
        retry_after_s=5,
    )


@contextlib.contextmanager
def fail_closed() -> Iterator[None]:
    """Admission while the limits store (Redis) is unreachable: refused with a 503, never let
    through unlimited and unmetered."""
    try:
        yield
    except LimitsUnavailable as exc:
        log.warning("refusing a request: %s", exc)
        raise limits_unavailable() from exc
