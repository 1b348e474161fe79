"""`next_status`: what an endpoint's status should be, read off its replicas alone (the reconcile
loop applies it through the one status writer, naming the trigger)."""

from __future__ import annotations

from modelyard.control.endpoint_status import StatusChange, next_status
from modelyard.control.state import EndpointState, Replica, VersionRef
from modelyard.core.routing import EndpointRoute
from modelyard.core.status import EndpointStatus, ReplicaState, StatusTrigger
from modelyard.store.tables import Endpoint


def endpoint(
    status: EndpointStatus, desired: int, *replicas: ReplicaState, **fields: object
) -> EndpointState:
    row = Endpoint(id="ep-1", tenant_id="t", model_name="m", version_id="v1")
    route = EndpointRoute("ep-1", "t", "m", public=False, version_id="v1", max_tokens_cap=64)
    state = EndpointState(row=row, route=route, desired=desired, status=status)
    state.replicas = [Replica(f"r{i}", state=s, version_id="v1") for i, s in enumerate(replicas)]
    for name, value in fields.items():
        setattr(state, name, value)
    return state


READY, STARTING, FAILED = ReplicaState.READY, ReplicaState.STARTING, ReplicaState.FAILED
CHANGED = StatusTrigger.REPLICAS_CHANGED


def test_every_desired_replica_serving_is_ready() -> None:
    state = endpoint(EndpointStatus.PROVISIONING, 2, READY, READY)
    assert next_status(state) == StatusChange(EndpointStatus.READY, None, CHANGED)


def test_a_lost_replica_degrades_with_the_reason() -> None:
    state = endpoint(EndpointStatus.READY, 2, READY, STARTING, failures=1, last_error="boom")
    assert next_status(state) == StatusChange(
        EndpointStatus.DEGRADED, "1 of 2 replicas ready: boom", CHANGED
    )
    state = endpoint(EndpointStatus.READY, 1, STARTING)
    assert next_status(state) == StatusChange(
        EndpointStatus.DEGRADED, "no replica serving (replicas lost); replacing it", CHANGED
    )


def test_scaling_to_zero_and_back() -> None:
    assert next_status(endpoint(EndpointStatus.READY, 0, FAILED)) == StatusChange(
        EndpointStatus.SCALED_TO_ZERO, None, StatusTrigger.SCALED_TO_ZERO
    )
    assert next_status(endpoint(EndpointStatus.SCALED_TO_ZERO, 1, STARTING)) == StatusChange(
        EndpointStatus.PROVISIONING, "scaling from zero", StatusTrigger.SCALE_FROM_ZERO
    )


def test_failed_rollouts_and_rollbacks_keep_their_status() -> None:
    assert next_status(endpoint(EndpointStatus.FAILED, 1, FAILED)) is None
    rolling = endpoint(EndpointStatus.ROLLING_OUT, 1, READY, rollout_to=VersionRef("v2", "m:2"))
    assert next_status(rolling) is None
    rolled_back = endpoint(EndpointStatus.DEGRADED, 1, READY, trigger=StatusTrigger.ROLLED_BACK)
    assert next_status(rolled_back) is None
