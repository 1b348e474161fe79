"""The statuses of endpoints and replicas (their values are what the database and API show)."""

from __future__ import annotations

from enum import StrEnum


class EndpointStatus(StrEnum):
    """An endpoint's status (stored as its value in `endpoints.status`)."""

    PROVISIONING = "provisioning"  # its first replicas are starting
    READY = "ready"  # every desired replica serves
    DEGRADED = "degraded"  # fewer serve than desired; a replacement will come up
    FAILED = "failed"  # none serves and the last start failed: none can come up as things are
    UNSCHEDULABLE = "unschedulable"  # no device has room for a replica
    SCALED_TO_ZERO = "scaled_to_zero"
    ROLLING_OUT = "rolling_out"
    ROLLING_BACK = "rolling_back"
    DRAINING = "draining"
    DELETED = "deleted"


class ReplicaState(StrEnum):
    STARTING = "starting"
    READY = "ready"  # serving (in routing)
    UNHEALTHY = "unhealthy"  # its last health probe failed: out of routing until one passes
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


LIVE = frozenset({ReplicaState.STARTING, ReplicaState.READY, ReplicaState.UNHEALTHY})
