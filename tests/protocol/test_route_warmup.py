"""Route contexts are built at startup, not by the first request (protocol/route_warmup.py)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
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


def test_no_request_reads_an_endpoint_s_source_after_the_warm_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FastAPI names an endpoint's file and line in its errors, read with
    `inspect.getsourcelines` (a file read and tokenize) on the first request to it: the warm-up
    does that on its thread, so no request's loop turn reads a source file."""
    app = FastAPI()
    router = APIRouter(prefix="/v1")

    def included(x: str) -> str:
        return x

    router.add_api_route("/things/{x}", included, methods=["GET"])
    app.include_router(router)

    @app.get("/direct")
    def direct() -> int:
        return 1

    warm_routes(app)
    read: list[object] = []
    real = inspect.getsourcelines

    def reading(obj: Any) -> Any:
        read.append(obj)
        return real(obj)

    monkeypatch.setattr(inspect, "getsourcelines", reading)
    client = TestClient(app)
    assert client.get("/v1/things/q").json() == "q"
    assert client.get("/direct").json() == 1
    assert read == []


def test_the_openapi_schema_is_made_by_the_warm_up() -> None:
    app = FastAPI()
    app.add_api_route("/thing", lambda: 1, methods=["GET"])
    assert app.openapi_schema is None
    warm_routes(app)
    made = app.openapi_schema
    assert made is not None and "/thing" in made["paths"]
    assert TestClient(app).get("/openapi.json").json() == made  # served as made, not again
