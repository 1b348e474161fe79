"""Refuse typed JSON bodies whose text cannot be stored (NUL characters and lone surrogates)
or that nest deeper than `MAX_JSON_DEPTH` (`protocol/json_depth.py`).

Valid JSON may carry `"\\u0000"` and unpaired surrogates (`"\\udcff"`); Python keeps them, but
PostgreSQL refuses NUL in text and no database can encode a lone surrogate as UTF-8, so a
tenant name or batch metadata holding one was a 500 from deep in the store. This ASGI
middleware checks the bodies of the routes FastAPI parses itself (the control plane's typed
JSON routes: tenants, keys, deploys, batches…) as they are read, and answers a 400 naming the
field instead. A body nested deeper than the bound is a 400 too (it broke the writers of the
audit log and the JSON responses that echo it). The gateway's inference routes parse their raw
bodies themselves and are not touched, so the hot path pays nothing here (the gateway bounds
their depth itself). A URL whose path or query decodes to a NUL is refused on every route (a
query holding no `%00` costs one byte search).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import parse_qsl

import orjson
from fastapi.routing import APIRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from modelyard.protocol.errors import APIError, bad_request
from modelyard.protocol.json_depth import SLOW_BYTES, too_deep
from modelyard.protocol.oip import OIPError, is_oip_path


def find_bad_text(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or key) holding NUL or a lone surrogate, or None."""
    if isinstance(value, str):
        return None if storable(value) else (path or "body")
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if not storable(key):
                return path or "body"
            found = find_bad_text(item, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = find_bad_text(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def storable(text: str) -> bool:
    """Whether every database can keep `text`: no NUL, no lone surrogate."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _decode(body: bytes) -> Any:
    """The JSON value, surrogates kept; None when it is not JSON (FastAPI says why)."""
    try:
        return json.loads(body)
    except ValueError:
        return None


class _Refused(Exception):
    pass


def nul_in_url(scope: Scope) -> str | None:
    """The query parameter (or `path`) whose decoded text holds a NUL, or None. (Starlette
    decodes a URL's bytes with replacement, so a NUL is the one unstorable character a URL can
    carry: PostgreSQL refuses it even in a comparison.)"""
    if "\x00" in scope.get("path", ""):
        return "path"
    query: bytes = scope.get("query_string", b"")
    if b"%00" not in query:
        return None
    for name, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
        if "\x00" in name or "\x00" in value:
            return name if storable(name) else "query"
    return None


def _invalid_text(where: str) -> APIError:
    return bad_request(
        f"Invalid value for '{where}': text must be valid Unicode without NUL characters or "
        "unpaired surrogates.",
        where,
        "invalid_text",
    )


class StorableText:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (where := nul_in_url(scope)) is not None:
            error = _invalid_text(where)
            if is_oip_path(scope.get("path", "")):  # the Open Inference Protocol's own shape
                await OIPError(error.status, error.message).response()(scope, receive, send)
            else:
                await error.response()(scope, receive, send)
            return
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        refusal: APIError | None = None
        answered = False

        def typed_json() -> bool:
            route = scope.get("route")
            if not isinstance(route, APIRoute) or route.body_field is None:
                return False
            for name, value in scope.get("headers", ()):
                if name == b"content-type":
                    return bool(value.split(b";")[0].strip().lower() == b"application/json")
            return False

        async def checked_receive() -> Message:
            nonlocal refusal
            message = await receive()
            if message["type"] != "http.request" or not typed_json():
                return message
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return message
            body = b"".join(chunks)
            large = len(body) >= SLOW_BYTES
            deep = await asyncio.to_thread(too_deep, body) if large else too_deep(body)
            if deep is not None:
                refusal = bad_request(deep, None, "json_too_deep")
                raise _Refused
            # orjson refuses lone surrogates, so a clean body costs one fast parse.
            try:
                orjson.loads(body)
                if b"\\u0000" not in body:
                    return message
            except orjson.JSONDecodeError:
                pass
            where = find_bad_text(_decode(body))
            if where is None:
                return message
            refusal = _invalid_text(where)
            raise _Refused

        async def answer() -> None:
            nonlocal answered
            if not answered and refusal is not None:
                answered = True
                await refusal.response()(scope, receive, send)

        async def guarded_send(message: Message) -> None:
            if refusal is not None:
                await answer()  # the app saw a failed body read; the refusal says why
                return
            await send(message)

        try:
            await self.app(scope, checked_receive, guarded_send)
        except _Refused:
            await answer()
