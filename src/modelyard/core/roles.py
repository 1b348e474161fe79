"""A tenant user's role and what it lets a caller do: the role-based access matrix.

Routes check scopes (`Principal.require_any`); a role is a set of scopes. A plain API key (no
user behind it) has the scopes it was made with, as before roles existed. A user's key has its
own scopes, widened by what they imply (`admin` implies `read`, `deploy`, `own_keys`) and then
cut to the user's role, so a key never does more than its user may. A console session of a user
has the role's scopes.

| scope | what it allows | admin | developer | viewer |
|---|---|---|---|---|
| `read` | read models, endpoints, registry, usage, users and teams | yes | yes | yes |
| `metrics` | `GET /metrics` (the tenant's series) | yes | yes | yes |
| `inference` | the OpenAI / OIP APIs, files, batches | yes | yes | no |
| `deploy` | deploy, change and delete endpoints; push and delete registry models | yes | yes | no |
| `own_keys` | create, read, change and revoke the caller's own API keys | yes | yes | no |
| `admin` | everything in the tenant: every key, users, teams, audit, webhooks | yes | no | no |
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class Role(StrEnum):
    ADMIN = "admin"
    DEVELOPER = "developer"
    VIEWER = "viewer"


READ = "read"
DEPLOY = "deploy"
OWN_KEYS = "own_keys"

# The scopes a route accepts (any one of them): a plain key's `admin` scope stands for all of
# the finer ones, which only users (roles) hold on their own.
TENANT_READERS = ("admin", READ)
DEPLOYERS = ("admin", DEPLOY)
KEY_OWNERS = ("admin", OWN_KEYS)

ROLE_SCOPES: dict[Role, frozenset[str]] = {
    Role.ADMIN: frozenset({"admin", "inference", "metrics", READ, DEPLOY, OWN_KEYS}),
    Role.DEVELOPER: frozenset({"inference", "metrics", READ, DEPLOY, OWN_KEYS}),
    Role.VIEWER: frozenset({"metrics", READ}),
}

# What a key's own scope brings with it when the key belongs to a user.
_IMPLIED: dict[str, frozenset[str]] = {"admin": frozenset({READ, DEPLOY, OWN_KEYS})}


def user_key_scopes(key_scopes: Iterable[str], role: Role) -> frozenset[str]:
    """The scopes of a user's key: its own (and what they imply) within the user's role."""
    widened: set[str] = set()
    for scope in key_scopes:
        widened.add(scope)
        widened |= _IMPLIED.get(scope, frozenset())
    return frozenset(widened) & ROLE_SCOPES[role]
