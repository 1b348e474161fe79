"""The audit log: who changed what (endpoints, keys, tenants, users, teams, registry versions)
and when.

Routes and the controller call `AuditLog.record` after a change took effect, with the public
views before and after (the same dicts the API answers with). Rows are scoped to the tenant whose
resource changed: a tenant reads its own, the platform admin reads all. Secrets never reach a
row: the views carry none, and `scrub` drops secret-named fields and secret-shaped strings again
on the way in, so a view that grows a secret later cannot leak it into the log.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import select

from modelyard.control.endpoint_view import endpoint_view
from modelyard.core.csv_cells import csv_cell
from modelyard.core.errors import Invalid
from modelyard.core.identity import Principal
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.tables import AuditEvent

log = logging.getLogger(__name__)


class AuditAction(StrEnum):
    """The changes the platform records (an action is `<target_type>.<verb>`)."""

    ENDPOINT_DEPLOY = "endpoint.deploy"
    ENDPOINT_UPDATE = "endpoint.update"
    ENDPOINT_DELETE = "endpoint.delete"
    ENDPOINT_SCALE = "endpoint.scale"
    ENDPOINT_ROLLOUT = "endpoint.rollout"
    ENDPOINT_VERSION_ADD = "endpoint.version_add"
    ENDPOINT_TRAFFIC = "endpoint.traffic"
    ENDPOINT_PROMOTE = "endpoint.promote"
    ENDPOINT_ROLLBACK = "endpoint.rollback"
    ENDPOINT_AUTO_ROLLBACK = "endpoint.auto_rollback"
    ENDPOINT_AUTO_PROMOTE = "endpoint.auto_promote"
    ENDPOINT_ROLLOUT_FALLBACK = "endpoint.rollout_fallback"  # a failing rollout's way back
    KEY_CREATE = "api_key.create"
    KEY_UPDATE = "api_key.update"
    KEY_REVOKE = "api_key.revoke"
    KEY_ROTATE = "api_key.rotate"
    KEY_EXPIRY_CHANGE = "api_key.expiry_change"
    KEY_MODELS_CHANGE = "api_key.allowed_models_change"
    TENANT_CREATE = "tenant.create"
    TENANT_UPDATE = "tenant.update"
    TENANT_WEBHOOK_SECRET_ROTATE = "tenant.webhook_secret_rotate"
    MODEL_VERSION_PUSH = "model_version.push"
    MODEL_DELETE = "model.delete"
    USER_CREATE = "user.create"
    USER_UPDATE = "user.update"
    USER_DELETE = "user.delete"
    USER_SIGN_IN = "user.sign_in"  # a console session begun with single sign-on
    TEAM_CREATE = "team.create"
    TEAM_DELETE = "team.delete"
    TEAM_MEMBER_ADD = "team.member_add"
    TEAM_MEMBER_REMOVE = "team.member_remove"


class AuditTarget(StrEnum):
    ENDPOINT = "endpoint"
    API_KEY = "api_key"
    TENANT = "tenant"
    MODEL_VERSION = "model_version"
    MODEL = "model"
    USER = "user"
    TEAM = "team"


SYSTEM_ACTOR = "system"
MAX_LIMIT = 1000
CSV_COLUMNS = (
    "id", "at", "tenant_id", "actor_key_id", "actor_tenant_id", "action", "target_type",
    "target_id", "before", "after",
)  # fmt: skip

# Field names whose values are secrets (an API key as created, its hash, a webhook secret).
_SECRET_FIELDS = frozenset(
    {"key", "key_hash", "secret", "webhook_secret", "api_key", "password", "token"}
)
# Strings shaped like a secret the platform makes: API keys and webhook signing secrets.
# (A key's public prefix, `sk-my-` and 4 characters, stays readable.)
_SECRET_VALUE = re.compile(r"sk-my-[A-Za-z0-9_\-]{16,}|whsec_[A-Za-z0-9+/=_\-]{16,}")
REDACTED = "[redacted]"


def scrub(value: Any) -> Any:
    """`value` with secret-named fields dropped and secret-shaped strings redacted."""
    if isinstance(value, dict):
        return {str(k): scrub(v) for k, v in value.items() if str(k).lower() not in _SECRET_FIELDS}
    if isinstance(value, list | tuple):
        return [scrub(v) for v in value]
    if isinstance(value, str):  # a StrEnum too: it leaves as its plain value
        return _SECRET_VALUE.sub(REDACTED, str(value))
    return value


# What an endpoint's audit view leaves out of its API view: what moves on its own (replicas,
# autoscaling) rather than what a person changed.
_ENDPOINT_VOLATILE = frozenset(
    {"autoscaling", "replicas", "endpoint_url", "model_files_from", "status_message", "object"}
)


def endpoint_snapshot(manager: Any, endpoint_id: str) -> dict[str, Any] | None:
    """An endpoint's configuration as the audit log keeps it (its API view without replicas
    and autoscaling, plus its tenant); None when `manager` (an `EndpointManager`) no longer
    holds it. Typed loosely: the manager imports this module's callers."""
    state = manager.endpoints.get(endpoint_id)
    if state is None:
        return None
    view = endpoint_view(state, "")
    snap = {k: v for k, v in view.items() if k not in _ENDPOINT_VOLATILE}
    snap["tenant_id"] = state.row.tenant_id
    return snap


@dataclass(frozen=True)
class AuditQuery:
    """What a reader asks for: newest first, `after` an event id from the previous page."""

    tenant_id: str | None  # None: every tenant (the platform admin only)
    since: datetime | None = None
    until: datetime | None = None
    action: str | None = None
    target_type: str | None = None
    target_id: str | None = None
    limit: int = 100
    after: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.limit <= MAX_LIMIT:
            raise Invalid(f"limit must be between 1 and {MAX_LIMIT}", param="limit")
        if self.since is not None and self.until is not None and self.since >= self.until:
            raise Invalid("since must be before until", param="since")


@dataclass(frozen=True)
class AuditPage:
    events: list[dict[str, Any]]
    has_more: bool


def event_view(e: AuditEvent) -> dict[str, Any]:
    """The public view of one row (the JSON API's and the CSV's)."""
    return {
        "id": e.id,
        "object": "audit_event",
        "at": int(repo.as_utc(e.at).timestamp()),
        "tenant_id": e.tenant_id,
        "actor_key_id": e.actor_key_id or SYSTEM_ACTOR,
        "actor_tenant_id": e.actor_tenant_id,
        "action": e.action,
        "target_type": e.target_type,
        "target_id": e.target_id,
        "before": e.before,
        "after": e.after,
    }


def _select(q: AuditQuery, limit: int) -> Any:
    stmt = select(AuditEvent)
    if q.tenant_id is not None:
        stmt = stmt.where(AuditEvent.tenant_id == q.tenant_id)
    if q.since is not None:
        stmt = stmt.where(AuditEvent.at >= q.since)
    if q.until is not None:
        stmt = stmt.where(AuditEvent.at < q.until)
    if q.action is not None:
        stmt = stmt.where(AuditEvent.action == q.action)
    if q.target_type is not None:
        stmt = stmt.where(AuditEvent.target_type == q.target_type)
    if q.target_id is not None:
        stmt = stmt.where(AuditEvent.target_id == q.target_id)
    if q.after is not None:
        stmt = stmt.where(AuditEvent.id < q.after)
    return stmt.order_by(AuditEvent.id.desc()).limit(limit)


class AuditLog:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def record(
        self,
        actor: Principal | None,
        action: str,
        target_type: str,
        target_id: str,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        tenant_id: str | None = None,
    ) -> int:
        """Record one change; `actor` None is the platform itself (e.g. an automatic rollback).
        `tenant_id` is the tenant whose resource changed (default: the actor's). Returns the
        event's id."""
        return await asyncio.to_thread(
            self.record_sync, actor, action, target_type, target_id, before, after, tenant_id
        )

    def record_sync(
        self,
        actor: Principal | None,
        action: str,
        target_type: str,
        target_id: str,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
        tenant_id: str | None = None,
    ) -> int:
        """`record` for callers already on a worker thread."""
        if tenant_id is None and actor is not None:
            tenant_id = actor.tenant_id
        row = AuditEvent(
            at=repo.now(),
            tenant_id=tenant_id,
            actor_key_id=actor.key_id if actor is not None else None,
            actor_tenant_id=actor.tenant_id if actor is not None else None,
            action=str(action),
            target_type=str(target_type),
            target_id=str(target_id),
            before=scrub(before) if before is not None else None,
            after=scrub(after) if after is not None else None,
        )
        with self.db.session() as s:
            s.add(row)
            s.flush()
            event_id = row.id
        log.info("audit %s %s %s by %s", action, target_type, target_id, row.actor_key_id)
        return event_id

    async def record_endpoint(
        self,
        actor: Principal | None,
        action: str,
        endpoint_id: str,
        before: dict[str, Any] | None,
        after: dict[str, Any] | None,
    ) -> int:
        """`record` for an endpoint, `before`/`after` from `endpoint_snapshot`: the row goes to
        the endpoint's tenant (also when the platform admin made the change)."""
        owner = (after or before or {}).get("tenant_id")
        return await self.record(
            actor, action, AuditTarget.ENDPOINT, endpoint_id, before, after, tenant_id=owner
        )

    async def query(self, q: AuditQuery) -> AuditPage:
        return await asyncio.to_thread(self.query_sync, q)

    def query_sync(self, q: AuditQuery) -> AuditPage:
        with self.db.session() as s:
            rows: Sequence[AuditEvent] = s.scalars(_select(q, q.limit + 1)).all()
            events = [event_view(r) for r in rows[: q.limit]]
        return AuditPage(events, has_more=len(rows) > q.limit)

    def iter_csv(self, q: AuditQuery, max_rows: int = 1_000_000, page: int = 500) -> Iterator[str]:
        """The matching events as CSV text chunks (header first), newest first, read page by
        page so a long export never sits in memory whole; `q.limit` is ignored, `max_rows`
        caps the export. Blocking: a StreamingResponse iterates it in a thread pool."""
        yield _csv_line(CSV_COLUMNS)
        cursor = q.after
        left = max_rows
        while left > 0:
            step = AuditQuery(
                tenant_id=q.tenant_id,
                since=q.since,
                until=q.until,
                action=q.action,
                target_type=q.target_type,
                target_id=q.target_id,
                limit=min(page, left, MAX_LIMIT),
                after=cursor,
            )
            result = self.query_sync(step)
            if not result.events:
                return
            yield "".join(_csv_line(_csv_row(e)) for e in result.events)
            left -= len(result.events)
            cursor = result.events[-1]["id"]
            if not result.has_more:
                return


def _csv_row(e: dict[str, Any]) -> list[Any]:
    row: list[Any] = []
    for col in CSV_COLUMNS:
        value = e[col]
        if col in ("before", "after"):
            value = "" if value is None else json.dumps(value, sort_keys=True)
        elif value is None:
            value = ""
        row.append(csv_cell(value))
    return row


def _csv_line(values: Sequence[Any]) -> str:
    out = io.StringIO()
    csv.writer(out).writerow(values)
    return out.getvalue()
