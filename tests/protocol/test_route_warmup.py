"""Route contexts are built at startup, not by the first request (protocol/route_warmup.py)."""

from __future__ import annotations

from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from modelyard.protocol.route_warmup import warm_routes


def test_every_included_route_is_built_before_the_first_request() -> None:
    app = FastAPI()
    outer, inner = APIRouter(prefix="/v1"), APIRouter(prefix="/things")
    for i in range(5):
        inner.add_api_route(f"/t{i}/{{x}}", lambda x: x, methods=["GET"])
    outer.include_router(inner)
    app.include_router(outer)
    built = warm_routes(app)
    if not hasattr(app.router.routes[-1], "effective_candidates"):
        assert built == 0  # a FastAPI that builds its routes eagerly: nothing to do
        return
    # The five routes and the router that holds them, under the outer router.
    assert built == 6
    included = app.router.routes[-1]
    cached = included.effective_candidates()
    assert TestClient(app).get("/v1/things/t4/q").json() == "q"
    assert included.effective_candidates() is cached  # the request used what was built
