"""A small OpenID Connect provider for the tests: discovery, a JWKS, an authorization endpoint
that consents at once for the user the test set, and a token endpoint (client_secret_basic,
PKCE S256 checked with authlib's implementation, single-use codes bound to their client and
redirect URI). ID tokens are RS256 JWTs signed with joserfc. `tamper` makes the next ID token
wrong in one way, for the relying party's refusals."""

from __future__ import annotations

import base64
import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlparse

from authlib.oauth2.rfc7636 import create_s256_code_challenge
from joserfc import jwt
from joserfc.jwk import KeySet, RSAKey


class Provider:
    def __init__(self, client_id: str, client_secret: str, redirect_uri: str) -> None:
        self.client_id = client_id
        self.client_secret = client_secret
        self.redirect_uri = redirect_uri
        self.key = RSAKey.generate_key(2048, parameters={"kid": "k1", "use": "sig"})
        self.stranger = RSAKey.generate_key(2048, parameters={"kid": "k1", "use": "sig"})
        self.user: dict[str, Any] = {}
        self.tamper: str | None = None  # "signature" | "nonce" | "audience" | "expired"
        self.codes: dict[str, dict[str, Any]] = {}
        self.requests: list[str] = []
        self.lock = threading.Lock()
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                provider.handle(self, "GET")

            def do_POST(self) -> None:
                provider.handle(self, "POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.issuer = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Provider:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ----- endpoints ----------------------------------------------------------------------------

    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        url = urlparse(h.path)
        self.requests.append(f"{method} {url.path}")
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if method == "GET" and url.path == "/.well-known/openid-configuration":
            return self._json(h, 200, self.discovery())
        if method == "GET" and url.path == "/jwks":
            return self._json(h, 200, KeySet([self.key]).as_dict(private=False))
        if method == "GET" and url.path == "/authorize":
            return self.authorize(h, query)
        if method == "POST" and url.path == "/token":
            length = int(h.headers.get("content-length") or 0)
            form = {k: v[0] for k, v in parse_qs(h.rfile.read(length).decode()).items()}
            return self.token(h, form)
        return self._json(h, 404, {"error": "not_found"})

    def discovery(self) -> dict[str, Any]:
        return {
            "issuer": self.issuer,
            "authorization_endpoint": f"{self.issuer}/authorize",
            "token_endpoint": f"{self.issuer}/token",
            "jwks_uri": f"{self.issuer}/jwks",
            "response_types_supported": ["code"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": ["RS256"],
            "code_challenge_methods_supported": ["S256"],
            "token_endpoint_auth_methods_supported": ["client_secret_basic"],
            "scopes_supported": ["openid", "email", "profile"],
        }

    def authorize(self, h: BaseHTTPRequestHandler, q: dict[str, str]) -> None:
        if q.get("client_id") != self.client_id or q.get("redirect_uri") != self.redirect_uri:
            return self._json(h, 400, {"error": "invalid_request", "error_description": "client"})
        if q.get("response_type") != "code" or "openid" not in q.get("scope", "").split():
            return self._json(h, 400, {"error": "invalid_request"})
        if q.get("code_challenge_method") != "S256" or not q.get("code_challenge"):
            return self._json(h, 400, {"error": "invalid_request", "error_description": "pkce"})
        code = secrets.token_urlsafe(16)
        with self.lock:
            self.codes[code] = {"challenge": q["code_challenge"], "nonce": q.get("nonce"),
                                "user": dict(self.user), "exp": time.time() + 60}  # fmt: skip
        back = {"code": code, "state": q.get("state", "")}
        h.send_response(302)
        h.send_header("location", f"{self.redirect_uri}?{urlencode(back)}")
        h.end_headers()

    def token(self, h: BaseHTTPRequestHandler, form: dict[str, str]) -> None:
        scheme, _, value = (h.headers.get("authorization") or "").partition(" ")
        expected = f"{self.client_id}:{self.client_secret}".encode()
        if scheme.lower() != "basic" or base64.b64decode(value) != expected:
            return self._json(h, 401, {"error": "invalid_client"})
        with self.lock:
            grant = self.codes.pop(form.get("code", ""), None)  # single use
        if (
            grant is None
            or grant["exp"] < time.time()
            or form.get("grant_type") != "authorization_code"
            or form.get("redirect_uri") != self.redirect_uri
        ):
            return self._json(h, 400, {"error": "invalid_grant"})
        if create_s256_code_challenge(form.get("code_verifier", "")) != grant["challenge"]:
            return self._json(h, 400, {"error": "invalid_grant", "error_description": "pkce"})
        return self._json(h, 200, {"access_token": secrets.token_urlsafe(16),
                                   "token_type": "Bearer", "expires_in": 300,
                                   "id_token": self.id_token(grant)})  # fmt: skip

    def id_token(self, grant: dict[str, Any]) -> str:
        now = int(time.time())
        user = grant["user"]
        claims = {
            "iss": self.issuer, "sub": user["sub"], "aud": self.client_id, "iat": now,
            "exp": now + 300, "nonce": grant["nonce"], "email": user["email"],
            "email_verified": user.get("email_verified", True), "name": user.get("name"),
        }  # fmt: skip
        key = self.key
        tamper, self.tamper = self.tamper, None
        if tamper == "signature":
            key = self.stranger  # same kid, another key: the signature cannot verify
        elif tamper == "nonce":
            claims["nonce"] = "not-the-nonce"
        elif tamper == "audience":
            claims["aud"] = "another-client"
        elif tamper == "expired":
            claims["exp"] = now - 3600
        return jwt.encode({"alg": "RS256", "kid": "k1"}, claims, key)

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(data)))
        h.send_header("cache-control", "no-store")
        h.end_headers()
        h.wfile.write(data)
