"""The prefix-cache namespace (`cache_salt`) the gateway gives each request to a model.

Replicas of a public model serve many tenants, and a prefix-cache hit shows in the answer
(`cached_tokens`, the time to the first token): with one shared cache a tenant could learn that
someone else recently sent a given prompt. In the default `tenant` scope every request carries
its tenant's salt, which the engine hashes into its prompt blocks, so tenants never share blocks.
The gateway always overrides a client's `cache_salt` there: nobody can pick another's namespace.
"""

from __future__ import annotations

import hashlib
from typing import Any

from modelyard.config import PrefixCacheScope


def _digest(kind: bytes, value: str) -> str:
    return hashlib.blake2b(value.encode("utf-8"), digest_size=16, person=kind).hexdigest()


def tenant_cache_salt(tenant_id: str) -> str:
    """The tenant's namespace: a hash, so that worker logs and dumps hold no tenant ids."""
    return f"tenant-{_digest(b'modelyard-tenant', tenant_id)}"


def scope_prefix_cache(payload: dict[str, Any], scope: PrefixCacheScope, tenant_id: str) -> None:
    """Set the request body's `cache_salt` for `scope`, whatever the client sent.

    In the `shared` scope a client's own salt is kept apart (as vLLM lets clients do), but
    hashed into a domain of its own, so it can never name a tenant's namespace (blocks from
    a time the scope was `tenant`)."""
    if scope is PrefixCacheScope.TENANT:
        payload["cache_salt"] = tenant_cache_salt(tenant_id)
        return
    salt = payload.pop("cache_salt", None)
    if isinstance(salt, str) and salt:
        payload["cache_salt"] = f"client-{_digest(b'modelyard-client', salt)}"
