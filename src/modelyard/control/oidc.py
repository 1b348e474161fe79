"""An OpenID Connect relying party: the authorization-code flow with PKCE against one issuer.

`OidcClient` reads the provider's discovery document (its `issuer` must be the configured one),
builds the authorization URL (`state`, `nonce`, an S256 code challenge), trades the code for
tokens at the token endpoint (client_secret_basic, or none for a public client, with the code
verifier), and accepts the ID token only when its signature verifies against the provider's
published keys (JWKS, an asymmetric algorithm the provider announces; never `none` or an HMAC)
and its claims hold: `iss`, `aud` (and `azp` with several audiences), `exp`, `iat`, `nonce`,
`sub`. Every answer from the provider is bounded (size, time) before it is parsed. Discovery
and keys are cached; an unknown key id refetches the keys, at most once per `_KEYS_REFETCH_S`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import httpx
from joserfc import jwt
from joserfc.errors import JoseError
from joserfc.jwk import KeySet

from modelyard.core.errors import Forbidden, Unavailable

_MAX_ANSWER = 1 << 20  # a discovery document, a key set or a token answer
_DISCOVERY_TTL_S = 3600.0
_KEYS_REFETCH_S = 30.0
_LEEWAY_S = 60
# Asymmetric algorithms only: an HMAC would be keyed with the client secret, `none` is no check.
_ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def pkce_pair() -> tuple[str, str]:
    """(code verifier, its S256 challenge), RFC 7636."""
    verifier = _b64(secrets.token_bytes(32))
    return verifier, _b64(hashlib.sha256(verifier.encode()).digest())


def _refused(message: str) -> Forbidden:
    return Forbidden(f"single sign-on refused: {message}", code="sso_refused")


def _unavailable(message: str) -> Unavailable:
    return Unavailable(
        f"the identity provider cannot be used: {message}", code="sso_unavailable",
        retry_after_s=5,
    )  # fmt: skip


def _kid_of(id_token: str) -> str | None:
    """The key id in a compact JWS's header (None: none, or no readable header)."""
    try:
        header = json.loads(base64.urlsafe_b64decode(id_token.split(".", 1)[0] + "=="))
    except ValueError:
        return None
    kid = header.get("kid") if isinstance(header, dict) else None
    return kid if isinstance(kid, str) else None


@dataclass(frozen=True)
class Pending:
    """What the browser carries between the redirect and the callback (in a signed cookie)."""

    state: str
    nonce: str
    verifier: str
    expires: int


class OidcClient:
    def __init__(
        self,
        issuer: str,
        client_id: str,
        client_secret: str | None,
        scopes: str,
        timeout_s: float,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.issuer = issuer.rstrip("/")
        self.client_id = client_id
        self.client_secret = client_secret
        self.scopes = scopes
        self.http = http or httpx.AsyncClient(timeout=timeout_s, follow_redirects=False)
        self._discovery: tuple[dict[str, Any], float] | None = None
        self._keys: KeySet | None = None
        self._keys_at = 0.0
        # Signs the pending login's cookie: from the client secret (every gateway shares it),
        # else this process's own (a public client signs in on the process it started at).
        seed = client_secret.encode() if client_secret else secrets.token_bytes(32)
        self._cookie_key = hashlib.sha256(b"modelyard-oidc-pending\0" + seed).digest()

    async def aclose(self) -> None:
        await self.http.aclose()

    # ----- the provider's documents -----------------------------------------------------------

    async def _get_json(self, url: str, what: str) -> dict[str, Any]:
        try:
            async with self.http.stream("GET", url, headers={"accept": "application/json"}) as r:
                body = await self._bounded(r, what)
        except httpx.HTTPError as exc:
            raise _unavailable(f"{what}: {type(exc).__name__}") from None
        return body

    @staticmethod
    async def _bounded(r: httpx.Response, what: str) -> dict[str, Any]:
        data = b""
        async for chunk in r.aiter_bytes():
            data += chunk
            if len(data) > _MAX_ANSWER:
                raise _unavailable(f"{what} is over {_MAX_ANSWER} bytes")
        if r.status_code != 200:
            raise _unavailable(f"{what} answered {r.status_code}")
        try:
            body = json.loads(data)
        except ValueError:
            raise _unavailable(f"{what} is not JSON") from None
        if not isinstance(body, dict):
            raise _unavailable(f"{what} is not a JSON object")
        return body

    async def discovery(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._discovery is not None and self._discovery[1] > now:
            return self._discovery[0]
        doc = await self._get_json(
            f"{self.issuer}/.well-known/openid-configuration", "the discovery document"
        )
        if str(doc.get("issuer", "")).rstrip("/") != self.issuer:
            raise _unavailable("the discovery document names another issuer")
        for field in ("authorization_endpoint", "token_endpoint", "jwks_uri"):
            if not isinstance(doc.get(field), str) or not doc[field].startswith(
                ("https://", "http://")
            ):
                raise _unavailable(f"the discovery document has no {field}")
        self._discovery = (doc, now + _DISCOVERY_TTL_S)
        return doc

    async def _key_set(self, refresh: bool) -> KeySet:
        now = time.monotonic()
        if self._keys is not None and not (refresh and now - self._keys_at > _KEYS_REFETCH_S):
            return self._keys
        doc = await self.discovery()
        jwks = await self._get_json(doc["jwks_uri"], "the key set")
        try:
            self._keys = KeySet.import_key_set(jwks)  # type: ignore[arg-type]
        except (JoseError, ValueError, TypeError, KeyError):
            raise _unavailable("the key set cannot be read") from None
        self._keys_at = now
        return self._keys

    # ----- the flow ---------------------------------------------------------------------------

    def start(self, ttl_s: int = 600) -> Pending:
        verifier, _ = pkce_pair()
        return Pending(
            state=secrets.token_urlsafe(24),
            nonce=secrets.token_urlsafe(24),
            verifier=verifier,
            expires=int(time.time()) + ttl_s,
        )

    async def authorization_url(self, pending: Pending, redirect_uri: str) -> str:
        doc = await self.discovery()
        challenge = _b64(hashlib.sha256(pending.verifier.encode()).digest())
        query = {
            "response_type": "code",
            "client_id": self.client_id,
            "redirect_uri": redirect_uri,
            "scope": self.scopes,
            "state": pending.state,
            "nonce": pending.nonce,
            "code_challenge": challenge,
            "code_challenge_method": "S256",
        }
        endpoint: str = doc["authorization_endpoint"]
        return endpoint + ("&" if "?" in endpoint else "?") + urlencode(query)

    def seal(self, pending: Pending) -> str:
        """The pending login as a cookie value: JSON, then its HMAC."""
        body = _b64(json.dumps(pending.__dict__, separators=(",", ":")).encode())
        mac = _b64(hmac.new(self._cookie_key, body.encode(), hashlib.sha256).digest())
        return f"{body}.{mac}"

    def unseal(self, cookie: str | None, state: str) -> Pending:
        """The pending login the cookie carries, if it is ours, unexpired, and for `state`."""
        if not cookie or len(cookie) > 2000 or "." not in cookie:
            raise _refused("no sign-in was started in this browser (or it took too long)")
        body, _, mac = cookie.partition(".")
        good = _b64(hmac.new(self._cookie_key, body.encode(), hashlib.sha256).digest())
        if not hmac.compare_digest(mac, good):
            raise _refused("the sign-in cookie is not this platform's")
        try:
            pending = Pending(**json.loads(base64.urlsafe_b64decode(body + "==")))
        except (ValueError, TypeError):
            raise _refused("the sign-in cookie cannot be read") from None
        if pending.expires < time.time():
            raise _refused("the sign-in took too long; start again")
        if not hmac.compare_digest(pending.state.encode(), state.encode()):
            raise _refused("the state does not match this browser's sign-in")
        return pending

    async def finish(self, pending: Pending, code: str, redirect_uri: str) -> dict[str, Any]:
        """Trade the code for tokens and return the ID token's verified claims."""
        doc = await self.discovery()
        form = {
            "grant_type": "authorization_code",
            "code": code,
            "redirect_uri": redirect_uri,
            "code_verifier": pending.verifier,
            "client_id": self.client_id,
        }
        auth = (self.client_id, self.client_secret) if self.client_secret else None
        try:
            async with self.http.stream(
                "POST", doc["token_endpoint"], data=form, auth=auth,
                headers={"accept": "application/json"},
            ) as r:  # fmt: skip
                if r.status_code in (400, 401):
                    raise _refused(f"the provider refused the code ({r.status_code})")
                answer = await self._bounded(r, "the token answer")
        except httpx.HTTPError as exc:
            raise _unavailable(f"the token endpoint: {type(exc).__name__}") from None
        id_token = answer.get("id_token")
        if not isinstance(id_token, str) or len(id_token) > 16_384:
            raise _refused("the provider sent no ID token")
        return await self.verify(id_token, pending.nonce, doc)

    async def verify(self, id_token: str, nonce: str, doc: dict[str, Any]) -> dict[str, Any]:
        announced = doc.get("id_token_signing_alg_values_supported")
        if not isinstance(announced, list) or not announced:
            announced = ["RS256"]  # the default OpenID Connect Discovery names
        algorithms = [a for a in _ALGORITHMS if a in announced]
        if not algorithms:
            raise _unavailable("the provider signs ID tokens with no algorithm accepted here")
        keys = await self._key_set(refresh=False)
        kid = _kid_of(id_token)
        if not any(k.kid == kid for k in keys.keys):
            keys = await self._key_set(refresh=True)  # rotated keys: read them once more
        try:
            token = jwt.decode(id_token, keys, algorithms=algorithms)
        except (JoseError, ValueError, TypeError):
            raise _refused("the ID token's signature does not verify") from None
        self._check_claims(token.claims, nonce)
        return dict(token.claims)

    def _check_claims(self, claims: dict[str, Any], nonce: str) -> None:
        now = time.time()
        if str(claims.get("iss", "")).rstrip("/") != self.issuer:
            raise _refused("the ID token is from another issuer")
        aud = claims.get("aud")
        audiences = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
        if self.client_id not in audiences:
            raise _refused("the ID token is for another client")
        if len(audiences) > 1 and claims.get("azp") != self.client_id:
            raise _refused("the ID token's authorized party is another client")
        exp, iat = claims.get("exp"), claims.get("iat")
        if not isinstance(exp, int | float) or exp + _LEEWAY_S < now:
            raise _refused("the ID token has expired")
        if not isinstance(iat, int | float) or iat - _LEEWAY_S > now:
            raise _refused("the ID token was issued in the future")
        given = claims.get("nonce")
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), nonce.encode()):
            raise _refused("the ID token's nonce is not this sign-in's")
        sub = claims.get("sub")
        if not isinstance(sub, str) or not 0 < len(sub) <= 255:
            raise _refused("the ID token has no subject")
