"""The Open Inference Protocol v2 through the gateway: `/v2/models/{model}[/ready|/infer]` for
a tenant's classifier and embedding endpoints, with the same keys, limits and routing as the
OpenAI routes; an inference counts one request (and no tokens) against the key and in
metering. The worker's own model name is swapped for the public one in its answers."""

from __future__ import annotations

import uuid

import orjson
from fastapi import Request
from fastapi.responses import Response

from modelyard.core.logs import current_request_id
from modelyard.gateway.accounting import NO_LIMITS, Accounting, Call
from modelyard.gateway.admission import Admission
from modelyard.gateway.auth import Authenticator
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.upstream import Upstream


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
        route = self.admission.resolve(principal, model)
        upstream = route.upstream_model or route.model_name
        path = f"/v2/models/{upstream}" + (f"/{action}" if action else "")
        if action != "infer":
            call = Call(
                principal, route, "oip", current_request_id() or uuid.uuid4().hex, 0, NO_LIMITS
            )
            status, content = await self.upstream.call_unary(call, None, path)
            return Response(
                _rename(content, upstream, route.model_name),
                status_code=status,
                media_type="application/json",
            )
        decision = await self.accounting.acquire(principal, model, 0)
        call = Call(
            principal, route, "oip.infer", current_request_id() or uuid.uuid4().hex, 0, decision
        )
        try:
            await self.accounting.hold(call)
            headers = {"x-request-id": call.request_id, **decision.headers()}
            status, content = await self.upstream.call_unary(call, await request.body(), path)
            if status == 200:
                await self.accounting.close(call, served=True)
            else:
                self.metrics.requests.labels(route.model_name, status).inc()
        finally:
            # Gives back what is held unless metered above.
            await self.accounting.close(call, served=False)
        return Response(
            _rename(content, upstream, route.model_name),
            status_code=status,
            media_type="application/json",
            headers=headers,
        )


def _rename(content: bytes, upstream: str, public: str) -> bytes:
    if upstream == public:
        return content
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content
    for key in ("name", "model_name"):
        if isinstance(body, dict) and body.get(key) == upstream:
            body[key] = public
    return orjson.dumps(body)
