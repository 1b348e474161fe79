"""The Open Inference Protocol v2 through the gateway: `/v2/models/{model}[/ready|/infer]` for
a tenant's classifier and embedding endpoints, with the same keys, limits and routing as the
OpenAI routes. An inference is admitted like `/v1/embeddings` (its texts' tokens reserved
against TPM and the monthly quota) and settled through the one settlement with the token count
the worker reports (`parameters.usage`). A body in the binary tensor extension's form is read
here (off the loop) and forwarded as plain JSON; outputs asked for as binary data are turned
binary here from the worker's JSON answer. The worker's own model name is swapped for the public
one in its answers.

The model's name goes into the worker's URL quoted as one path segment: whatever an endpoint is
called, the request reaches `/v2/models/<that one segment>/...` and no other route.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any
from urllib.parse import quote

import orjson
from fastapi import Request
from fastapi.responses import Response

from modelyard.core.errors import Invalid
from modelyard.core.logs import current_request_id
from modelyard.gateway.accounting import Accounting
from modelyard.gateway.admission import Admission
from modelyard.gateway.auth import Authenticator
from modelyard.gateway.call import NO_LIMITS, Call, take_usage
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.reservation import reservation_bound
from modelyard.gateway.upstream import Upstream
from modelyard.protocol.embeddings import MAX_INPUTS
from modelyard.protocol.oip import OIPError, infer_usage, read_texts
from modelyard.protocol.oip_binary import (
    HEADER,
    binary_outputs,
    decode_infer,
    encode_answer,
    json_request,
)

# Every output any hosted model has: `binary_data_output` covers those the answer holds.
ALL_OUTPUTS = ("label", "score", "embedding")


def oip_path(upstream: str, action: str) -> str:
    """The worker's OIP path for a model: its name one quoted segment, never more."""
    return f"/v2/models/{quote(upstream, safe='')}" + (f"/{action}" if action else "")


class OipProxy:
    def __init__(
        self,
        auth: Authenticator,
        admission: Admission,
        accounting: Accounting,
        upstream: Upstream,
        metrics: GatewayMetrics,
    ) -> None:
        self.auth = auth
        self.admission = admission
        self.accounting = accounting
        self.upstream = upstream
        self.metrics = metrics

    async def handle(self, request: Request, model: str, action: str) -> Response:
        principal = await self.auth.authenticate(request.headers.get("authorization"))
        principal.require("inference")
        route = self.admission.resolve(principal, model, "oip")
        upstream = route.upstream_model or route.model_name
        path = oip_path(upstream, action)
        if action != "infer":
            call = Call(
                principal, route, "oip", current_request_id() or uuid.uuid4().hex, 0, NO_LIMITS
            )
            status, content = await self.upstream.call_unary(call, None, path)
            return Response(
                _rename(content, upstream, route.model_name)[0],
                status_code=status,
                media_type="application/json",
            )
        raw = await request.body()
        try:  # parsed off the loop: the body may be megabytes of texts
            read = await asyncio.to_thread(_read, raw, request.headers.get(HEADER))
        except OIPError as exc:  # the wire's parse failure (always a 400), answered at the edge
            raise Invalid(exc.message) from None
        texts, forwarded, binary = read
        # The same reservation as /v1/embeddings for the same texts.
        reserved = reservation_bound("embeddings", {"input": texts}, 0)
        call = await self.admission.admit_reserved(principal, route, model, "oip.infer", reserved)
        try:
            headers = {"x-request-id": call.request_id, **call.decision.headers()}
            status, content = await self.upstream.call_unary(call, forwarded or raw, path)
            content, body = await asyncio.to_thread(_rename, content, upstream, route.model_name)
            if status == 200 and binary and isinstance(body, dict):
                content, length = await asyncio.to_thread(encode_answer, body, binary)
                headers[HEADER] = str(length)
            if status == 200:
                take_usage(call, infer_usage(body))
                await self.accounting.close(call, served=True)
            else:
                self.metrics.requests.labels(route.model_name, status).inc()
        finally:
            # Gives back what is held unless metered above (a worker's error is not billed).
            await self.accounting.close(call, served=False)
        media = "application/octet-stream" if HEADER in headers else "application/json"
        return Response(content, status_code=status, media_type=media, headers=headers)


def _read(raw: bytes, header_length: str | None) -> tuple[list[str], bytes | None, list[str]]:
    """The request's texts; the plain JSON body to forward in its place (None: forward it as
    it came); the outputs to answer as binary data."""
    decoded = decode_infer(raw, header_length)
    request = decoded.request
    texts = read_texts(request, MAX_INPUTS)
    names = [o.name for o in request.outputs or []] or list(ALL_OUTPUTS)
    binary = binary_outputs(request, names)
    if decoded.binary or binary:  # the worker is asked for JSON; the edge turns it binary
        return texts, json_request(request), binary
    return texts, None, []


def _rename(content: bytes, upstream: str, public: str) -> tuple[bytes, Any]:
    """The answer with the public model name, and its parsed body (None if not JSON)."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content, None
    if upstream == public:
        return content, body
    for key in ("name", "model_name"):
        if isinstance(body, dict) and body.get(key) == upstream:
            body[key] = public
    return orjson.dumps(body), body
