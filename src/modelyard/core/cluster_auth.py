"""The cluster's own channels, authenticated with the cluster secret (`cluster_secret`): the
leading controller's advertised URL is signed, and worker replicas answer only the platform.

- The leader writes `<signature> <url>` to Redis (`cluster_keys.LEADER_KEY`); the signature is
  HMAC-SHA256 of the URL under a key derived from the secret. A gateway forwards a control
  request (with the caller's bearer key) only to a URL whose signature verifies: whoever can
  write Redis but does not hold the secret cannot redirect control requests to a host of its
  own. (A replayed old value names an earlier leader, which no longer leads and refuses.)
- A worker started by the platform gets a token (`MODELYARD_WORKER_TOKEN`) derived from the
  secret, so every gateway and controller of the cluster derives the same one, and a standby
  that adopts running replicas still reaches them. The worker refuses any request without
  `Authorization: Bearer <token>` (401), except `/health`, which tells nothing of a tenant.

Each use has its own key (HMAC of the secret with a label), so a worker token reveals nothing
that signs a leader URL.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from modelyard.config import PlatformSettings

MIN_SECRET_CHARS = 32
_LEADER_LABEL = b"modelyard leader url v1"
_WORKER_LABEL = b"modelyard worker token v1"


def _derive(secret: str, label: bytes) -> bytes:
    return hmac.new(secret.encode(), label, hashlib.sha256).digest()


def sign_leader_url(secret: str, url: str) -> str:
    """The value the leader advertises in Redis: its URL with its signature in front."""
    mac = hmac.new(_derive(secret, _LEADER_LABEL), url.encode(), hashlib.sha256).hexdigest()
    return f"{mac} {url}"


def verified_leader_url(secret: str, value: str | bytes | None) -> str | None:
    """The URL in an advertised value if its signature verifies under `secret`, else None."""
    if value is None:
        return None
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    mac, _, url = text.partition(" ")
    if not url:
        return None
    expected = sign_leader_url(secret, url).partition(" ")[0]
    return url if hmac.compare_digest(mac.encode(), expected.encode()) else None


def worker_token(secret: str) -> str:
    """The bearer token the cluster's workers demand, derived from the cluster secret."""
    return _derive(secret, _WORKER_LABEL).hex()


def bearer_matches(authorization: str | None, token: str) -> bool:
    """Whether an `Authorization` header carries `token` (compared in constant time)."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token.encode())


# Spelled out for the processes the platform starts (importing the worker would load torch).
WORKER_TOKEN_ENV = "MODELYARD_WORKER_TOKEN"
CLUSTER_SECRET_ENV = "MODELYARD_CLUSTER_SECRET"


def ensure_replica_secret(settings: PlatformSettings) -> None:
    """`serve` with no cluster secret: a random one for this process, so that its replicas
    (on loopback, or on the nodes' addresses with the ray backend) answer it alone; they die
    with it, so nothing else ever needs the token. The cluster roles require a set secret."""
    if not settings.cluster_secret:
        settings.cluster_secret = secrets.token_hex(32)


def replica_token(settings: PlatformSettings) -> str | None:
    """The token the platform's replicas demand (None: they demand none)."""
    return worker_token(settings.cluster_secret) if settings.cluster_secret else None


def replica_headers(settings: PlatformSettings) -> dict[str, str]:
    """The headers every request of the platform to a replica carries."""
    token = replica_token(settings)
    return {"authorization": f"Bearer {token}"} if token else {}


def replica_env(env: dict[str, str], token: str | None) -> dict[str, str]:
    """A replica's environment: the token it demands, never the cluster secret itself."""
    env = {k: v for k, v in env.items() if k not in (CLUSTER_SECRET_ENV, WORKER_TOKEN_ENV)}
    if token:
        env[WORKER_TOKEN_ENV] = token
    return env
