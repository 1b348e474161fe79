"""Serve the web console: `/` and the static files under `/console/`, with a strict CSP.

The console is plain HTML, CSS and JavaScript modules shipped inside the package
(`modelyard/console/`); it talks to the platform's own HTTP API with the key the user signs in
with, so this module serves bytes and nothing else. Files are read once, at import, into memory:
a request can never name a path outside the folder (only the known names are served), and each
answer carries an ETag so that browsers revalidate cheaply instead of downloading again.
"""

from __future__ import annotations

import hashlib
from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import Response

router = APIRouter(include_in_schema=False)

_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}

# Only the console's own files, and only the API on this origin: no inline script, no inline
# style, no third-party fonts or scripts, no framing (clickjacking), no forms posted elsewhere.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; manifest-src 'self'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
_SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cross-origin-opener-policy": "same-origin",
    # Not fingerprinted names: always revalidate (the ETag makes that a 304 without a body).
    "cache-control": "no-cache",
}


def _load() -> dict[str, tuple[bytes, str, str]]:
    """name -> (body, media type, ETag) for every file of the console package."""
    files: dict[str, tuple[bytes, str, str]] = {}
    root = resources.files("modelyard.console")
    for entry in root.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if not entry.is_file() or suffix not in _TYPES:
            continue
        body = entry.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        files[entry.name] = (body, _TYPES[suffix], etag)
    return files


_FILES = _load()


def _serve(name: str, request: Request) -> Response:
    found = _FILES.get(name)
    if found is None:
        return Response(
            b"not found", status_code=404, media_type="text/plain", headers=_SECURITY_HEADERS
        )
    body, media_type, etag = found
    headers = {**_SECURITY_HEADERS, "etag": etag}
    if etag in (request.headers.get("if-none-match") or "").replace("W/", "").split(", "):
        return Response(status_code=304, headers=headers)
    return Response(body, media_type=media_type, headers=headers)


@router.get("/")
async def console_index(request: Request) -> Response:
    """The console's single page."""
    return _serve("index.html", request)


@router.get("/console/{name}")
async def console_file(name: str, request: Request) -> Response:
    """One of the console's static files (scripts, styles, icon)."""
    return _serve(name, request)
