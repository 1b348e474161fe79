"""An endpoint's status: each transition names its `StatusTrigger`, is written to the database,
and tells the gateway whether waiting can bring a replica; `next_status` reads the replicas to
say what the status should be now.

`EndpointStatuses` is the only code that writes an endpoint's status, trigger or status message
(in memory or in the database); `tests/control/test_status_writer.py` fails on a write anywhere
else."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from modelyard.control.state import EndpointState
from modelyard.core.routing import RoutingTable
from modelyard.core.status import EndpointStatus, ReplicaState, StatusTrigger
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import Endpoint

_CLOSED = (EndpointStatus.DRAINING, EndpointStatus.DELETED)


@dataclass(frozen=True)
class StatusChange:
    """A status an endpoint should take, and why."""

    status: EndpointStatus
    message: str | None
    trigger: StatusTrigger


class EndpointStatuses:
    """The one writer of endpoints' statuses."""

    def __init__(self, db: Database, routing: RoutingTable) -> None:
        self.db = db
        self.routing = routing

    async def apply(self, state: EndpointState, change: StatusChange) -> None:
        await self.set(state, change.status, change.message, change.trigger)

    async def set(
        self,
        state: EndpointState,
        status: EndpointStatus,
        message: str | None,
        trigger: StatusTrigger,
    ) -> None:
        """One transition of the endpoint's status, naming what caused it."""
        if state.status is status and state.message == message:
            self.publish_availability(state)
            return
        if state.status in _CLOSED:
            return
        state.status, state.trigger, state.message = status, trigger, message
        self.publish_availability(state)

        def write() -> None:
            with self.db.session() as s:
                row = s.get(Endpoint, state.row.id)
                if row is not None and row.deleted_at is None:
                    row.status, row.status_message = status.value, message

        await asyncio.to_thread(write)

    def set_in_memory(self, state: EndpointState, change: StatusChange) -> None:
        """A transition the database need not see now (the next `set` writes it), from code
        that cannot wait for a write: the gateway's scale-from-zero verb."""
        state.status, state.trigger, state.message = change.status, change.trigger, change.message
        self.publish_availability(state)

    async def deleted(self, endpoint_id: str, state: EndpointState | None = None) -> None:
        """The endpoint is gone (its replicas stopped, or an interrupted delete finished at a
        start): its row is marked deleted, and so is `state` when one runs."""
        if state is not None:
            state.status, state.trigger = EndpointStatus.DELETED, StatusTrigger.DELETING

        def write() -> None:
            with self.db.session() as s:
                row = s.get(Endpoint, endpoint_id)
                if row is not None:
                    row.deleted_at = repo.now()
                    row.status = EndpointStatus.DELETED.value

        await asyncio.to_thread(write)

    def publish_availability(self, state: EndpointState) -> None:
        """Tell the gateway whether waiting can bring a replica: while none serves and the
        endpoint failed, has no room, or lost its replicas (a replacement is starting), requests
        get a 503 at once. The reason is for tenants: the details (errors, addresses) stay in
        the endpoint's status, which only its owner reads."""
        reason: str | None = None
        retry_after = 10
        if not state.serving:
            if state.status is EndpointStatus.FAILED:
                reason, retry_after = "its model failed to start", 30
            elif state.status is EndpointStatus.UNSCHEDULABLE:
                reason, retry_after = "no device has room for it", 30
            elif state.status is EndpointStatus.DEGRADED:
                reason = "no replica is serving it right now; it is being replaced"
        # Wakes requests waiting for a replica when it changes.
        self.routing.set_unavailable(state.route, reason, retry_after)

    async def refresh(self, state: EndpointState) -> None:
        """Bring the status in line with the replicas (`next_status`)."""
        change = next_status(state)
        if change is None:
            self.publish_availability(state)
        else:
            await self.apply(state, change)


def next_status(state: EndpointState) -> StatusChange | None:
    """ready = every desired replica serves; before that provisioning; after it degraded, with
    why (fewer serve than desired, or none while a replacement starts); failed and unschedulable
    stay until a replica serves; scaled_to_zero when the autoscaler wants none and none runs.
    None: the status stays (a rollback is reported until the next rollout; a rollout stays
    rolling_out until the new version serves or falls back)."""
    if state.trigger is StatusTrigger.ROLLED_BACK and state.status is EndpointStatus.DEGRADED:
        return None
    if state.rollout_to is not None:
        return None
    ready = sum(r.state is ReplicaState.READY for r in state.current)
    gone = (ReplicaState.FAILED, ReplicaState.STOPPED)
    running = [r for r in state.replicas if r.state not in gone]
    served = state.status in (EndpointStatus.READY, EndpointStatus.DEGRADED)
    why = why_degraded(state)
    changed = StatusTrigger.REPLICAS_CHANGED
    if ready < state.desired and any(
        r.preempted and r.state is ReplicaState.DRAINING for r in state.replicas
    ):
        changed = StatusTrigger.NODE_PREEMPTED  # what is missing is leaving a preempted node
    if state.desired == 0 and not running:  # draining ones too must be gone
        return StatusChange(EndpointStatus.SCALED_TO_ZERO, None, StatusTrigger.SCALED_TO_ZERO)
    if ready >= state.desired:
        return StatusChange(EndpointStatus.READY, None, changed)
    if served and ready:
        message = f"{ready} of {state.desired} replicas ready" + (f": {why}" if why else "")
        return StatusChange(EndpointStatus.DEGRADED, message, changed)
    if served:  # it served, and now no replica does
        message = f"no replica serving ({why or 'replicas lost'}); replacing it"
        return StatusChange(EndpointStatus.DEGRADED, message, changed)
    if state.status is EndpointStatus.SCALED_TO_ZERO:  # the autoscaler woke it
        return StatusChange(
            EndpointStatus.PROVISIONING, "scaling from zero", StatusTrigger.SCALE_FROM_ZERO
        )
    if state.status is EndpointStatus.PROVISIONING:
        message = f"{ready} of {state.desired} replicas ready"
        return StatusChange(EndpointStatus.PROVISIONING, message, changed)
    return None  # failed or unschedulable: kept, with their reason, until a replica serves


def why_degraded(state: EndpointState) -> str | None:
    """The failure behind missing replicas: a benched replica's, or what a starting one waits
    for (room), else the last one since a replica last came up (older ones are history, not
    the reason)."""
    for replica in state.replicas:
        waits = replica.state is ReplicaState.STARTING
        if (replica.state is ReplicaState.UNHEALTHY or waits) and replica.error:
            return replica.error
    for replica in state.replicas:
        if replica.preempted and replica.state is ReplicaState.DRAINING and replica.error:
            return replica.error
    return state.last_error if state.failures else None
