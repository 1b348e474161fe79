"""Who is calling: a `Principal` (key, tenant, scopes, limits, tier), built one way per kind.

`Principal.for_key` is an API key of a tenant (what authentication yields), `Principal.system`
the platform acting for itself (bootstrap deploys), `Principal.for_batch` the owner of a batch
whose items the runner sends. Rows are read through small protocols so this module needs no
database code.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from modelyard.core.errors import Forbidden, NotFound


class Tier(StrEnum):
    """A tenant's service tier, set by the platform admin: under overload the lower tier waits
    (or is refused) first, in the admission queue and in the engine."""

    FREE = "free"
    STANDARD = "standard"
    PRIORITY = "priority"

    @property
    def rank(self) -> int:
        """0 is served first: the engine priority of the tier's interactive requests."""
        return _TIER_RANK[self]


_TIER_RANK = {Tier.PRIORITY: 0, Tier.STANDARD: 1, Tier.FREE: 2}


@dataclass(frozen=True)
class TenantLimits:
    """A tenant's ceilings per minute, one pair of buckets shared by all its keys (so minting
    keys does not multiply them); None means no ceiling."""

    tenant_id: str
    rpm: int | None
    tpm: int | None


@dataclass(frozen=True)
class Limits:
    """A key's limits per minute; None means unlimited. `tenant`: its tenant's shared ceilings,
    checked and taken with the key's own buckets (None: none)."""

    rpm: int | None
    tpm: int | None
    tenant: TenantLimits | None = None

    def __post_init__(self) -> None:
        pairs = [("rpm", self.rpm), ("tpm", self.tpm)]
        if self.tenant is not None:
            pairs += [("tenant rpm", self.tenant.rpm), ("tenant tpm", self.tenant.tpm)]
        for name, value in pairs:
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")

    def buckets(self, key_id: str) -> list[tuple[str, str, int | None]]:
        """(owner, kind, capacity) of the four buckets a request takes from: the key's requests
        and tokens, then its tenant's (capacity None: that bucket is not limited)."""
        t = self.tenant
        return [
            (key_id, "requests", self.rpm),
            (key_id, "tokens", self.tpm),
            (f"tenant:{t.tenant_id}" if t else key_id, "requests", t.rpm if t else None),
            (f"tenant:{t.tenant_id}" if t else key_id, "tokens", t.tpm if t else None),
        ]


class TenantRow(Protocol):
    id: str
    name: str
    tier: str | None
    max_rpm: int | None
    max_tpm: int | None
    monthly_token_quota: int | None
    max_concurrent_requests: int | None
    max_concurrent_batch_items: int | None
    is_system: bool


class KeyRow(Protocol):
    id: str
    name: str
    scopes: str
    rpm_limit: int | None
    tpm_limit: int | None


def _capped(key_limit: int | None, ceiling: int | None) -> int | None:
    """A key's limit within its tenant's ceiling: a key may be tighter, never looser."""
    if ceiling is None:
        return key_limit
    return ceiling if key_limit is None else min(key_limit, ceiling)


def _shared(tenant: TenantRow) -> TenantLimits | None:
    """The tenant's ceilings as buckets all its keys share (None: it has neither)."""
    if tenant.max_rpm is None and tenant.max_tpm is None:
        return None
    return TenantLimits(tenant.id, tenant.max_rpm, tenant.max_tpm)


@dataclass(frozen=True)
class Principal:
    key_id: str
    key_name: str
    tenant_id: str
    tenant_name: str
    scopes: frozenset[str]
    limits: Limits
    monthly_token_quota: int | None
    platform_admin: bool  # an admin key of the system tenant: operates the whole platform
    tier: Tier = Tier.STANDARD
    # The tenant's ceilings on work in flight (None: no ceiling), set by the platform admin.
    max_concurrent_requests: int | None = None
    max_concurrent_batch_items: int | None = None
    # The team the key belongs to (None: none); its team's budgets apply to its requests.
    team_id: str | None = None

    @classmethod
    def for_key(cls, key: KeyRow, tenant: TenantRow) -> Principal:
        """An API key of `tenant`: its scopes, and its limits within the tenant's ceilings."""
        scopes = frozenset(filter(None, key.scopes.split(",")))
        return cls(
            key_id=key.id,
            key_name=key.name,
            tenant_id=tenant.id,
            tenant_name=tenant.name,
            scopes=scopes,
            limits=Limits(
                rpm=_capped(key.rpm_limit, tenant.max_rpm),
                tpm=_capped(key.tpm_limit, tenant.max_tpm),
                tenant=_shared(tenant),
            ),
            monthly_token_quota=tenant.monthly_token_quota,
            platform_admin=tenant.is_system and "admin" in scopes,
            tier=Tier(tenant.tier or Tier.STANDARD),
            max_concurrent_requests=tenant.max_concurrent_requests,
            max_concurrent_batch_items=tenant.max_concurrent_batch_items,
        )

    @classmethod
    def system(cls, tenant: TenantRow) -> Principal:
        """The platform acting for itself (bootstrap deploys): the system tenant's admin,
        unlimited."""
        return cls(
            key_id="bootstrap",
            key_name="bootstrap",
            tenant_id=tenant.id,
            tenant_name=tenant.name,
            scopes=frozenset({"admin", "inference"}),
            limits=Limits(None, None),
            monthly_token_quota=None,
            platform_admin=True,
        )

    @classmethod
    def for_batch(cls, key_id: str, key: KeyRow | None, tenant: TenantRow) -> Principal:
        """The owner of a batch, as its items run: inference only, no per-minute limits (the
        batch budget paces it), the tenant's quota, tier and ceilings. `key` is None once the
        batch's key is deleted."""
        return cls(
            key_id=key_id,
            key_name=key.name if key else "",
            tenant_id=tenant.id,
            tenant_name=tenant.name,
            scopes=frozenset({"inference"}),
            limits=Limits(None, None),
            monthly_token_quota=tenant.monthly_token_quota,
            platform_admin=False,
            tier=Tier(tenant.tier or Tier.STANDARD),
            max_concurrent_requests=tenant.max_concurrent_requests,
            max_concurrent_batch_items=tenant.max_concurrent_batch_items,
        )

    def require(self, scope: str) -> None:
        if scope not in self.scopes:
            raise Forbidden(
                f"This API key lacks the '{scope}' scope required for this operation.",
                code="insufficient_scope",
            )

    def require_any(self, scopes: tuple[str, ...]) -> None:
        """One of `scopes` (a metrics-only key is no reader of configuration)."""
        if not self.scopes.intersection(scopes):
            self.require(scopes[0])

    def require_platform_admin(self) -> None:
        if not self.platform_admin:
            raise Forbidden(
                "Only the platform administrator can do this.", code="insufficient_scope"
            )

    def tenant_filter(self, requested: str | None = None) -> str | None:
        """The tenant whose data a call may see: its own, or any one the platform admin names."""
        if self.platform_admin:
            return requested
        if requested is not None and requested != self.tenant_id:
            raise NotFound("No such tenant.", code="not_found")
        return self.tenant_id
