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


class StatusTrigger(StrEnum):
    """Why an endpoint's status last changed (as Ray Serve's `DeploymentStatusTrigger`): code
    that must know what happened reads this, never the status message."""

    DEPLOYED = "deployed"  # created, or adopted again at a restart: its replicas are starting
    PREPARE_FAILED = "prepare_failed"  # its model files could not be fetched or recognised
    CONFIG_INVALID = "config_invalid"  # its stored configuration no longer parses: not started
    REPLICA_START_FAILED = "replica_start_failed"
    NO_ROOM = "no_room"  # placement found no device with room for a replica
    REPLICAS_CHANGED = "replicas_changed"  # replicas came up, were lost or replaced
    # A replica's node is being taken away (a spot interruption notice): the replica left
    # routing and drains until the node's deadline while its replacement starts.
    NODE_PREEMPTED = "node_preempted"
    SCALE_FROM_ZERO = "scale_from_zero"  # a request or the autoscaler wants a replica again
    SCALED_TO_ZERO = "scaled_to_zero"  # the autoscaler wants none and none runs
    ENCODER_HOST_READY = "encoder_host_ready"  # the shared encoder host serves its model
    ENCODER_HOST_FAILED = "encoder_host_failed"  # it refused the model, or is down
    ROLLOUT_STARTED = "rollout_started"
    ROLLED_BACK = "rolled_back"  # a rollout failed; the last good version serves again
    DELETING = "deleting"
