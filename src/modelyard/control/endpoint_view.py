"""The endpoint's JSON view, as the API shows it (`GET /v1/endpoints/{id}`)."""

from __future__ import annotations

from typing import Any

from modelyard.control.load_progress import replica_load_progress
from modelyard.control.state import EndpointState
from modelyard.core.status import ReplicaState
from modelyard.store import repository as repo


def endpoint_view(state: EndpointState, base_url: str) -> dict[str, Any]:
    row = state.row
    autoscaler = state.autoscaler
    return {
        "endpoint_id": row.id,
        "object": "endpoint",
        "model_name": row.model_name,
        "status": state.status,
        "status_message": state.message,
        "public": row.public,
        "kind": state.kind,
        "model_kind": state.route.model_kind,  # chat, completion, embedding, classifier
        # The version it was asked to run (a rollout's while one runs: the row's serves until
        # it is promoted, and shows as `rollout_from`).
        "model_artifact": state.target.artifact,
        "version_id": state.target.version_id,
        "good_version_id": row.good_version_id,
        "rollout_from": row.version_id if state.rollout_to else None,
        # Percent of requests per version while a canary runs (`versions` has the details).
        "traffic": dict(state.route.weights),
        "last_rollback": row.last_rollback,
        "model_files_from": state.last_fetch,
        "framework": row.framework,
        "hardware": row.hardware,
        "scaling": row.scaling,
        "engine": row.engine_options,
        "sampling_defaults": row.sampling_defaults or {},
        "created_at": int(repo.as_utc(row.created_at).timestamp()),
        "endpoint_url": f"{base_url}/v1/models/{row.id}",
        "autoscaling": {
            "desired": state.desired,
            "current": len(state.live),
            "last_decision": autoscaler.last.view() if autoscaler and autoscaler.last else None,
            "recent_changes": [d.view() for d in state.decisions],
        },
        "replicas": {
            "desired": state.desired,
            "ready": state.serving,
            "restarts": state.restarts,
            "last_error": state.last_error,
            "items": [
                {**r.view(), "load_progress": replica_load_progress(state, r)}
                for r in state.replicas
                if r.state is not ReplicaState.STOPPED
            ],
        },
    }
