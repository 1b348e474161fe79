"""`/docs` works on a host without internet: the page references only this server's own
assets (Swagger UI's script, stylesheet and icon), and the server answers each of them; and the
schema it shows declares every route's request and response schemas and the bearer auth."""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import pytest

from tests.platform_harness import PlatformProcess


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PlatformProcess]:
    p = PlatformProcess(tmp_path_factory.mktemp("docs")).start()
    try:
        yield p
    finally:
        p.stop()


def test_docs_references_only_same_origin_assets_and_serves_them(
    platform: PlatformProcess,
) -> None:
    page = httpx.get(f"{platform.url}/docs")
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    # Everything the page loads: <script src>, <link href>, and the schema it fetches.
    references = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    references += re.findall(r"url: '([^']+)'", page.text)
    assert references, page.text
    for ref in references:
        # Before: https://cdn.jsdelivr.net/… and https://fastapi.tiangolo.com/img/favicon.png.
        assert ref.startswith("/") and not ref.startswith("//"), ref
    kinds = {"javascript": 0, "css": 0, "image": 0, "json": 0}
    for ref in references:
        answer = httpx.get(f"{platform.url}{ref}")
        assert answer.status_code == 200 and answer.content, ref
        for kind in kinds:
            kinds[kind] += kind in answer.headers["content-type"]
    assert all(kinds.values()), kinds  # the script, the stylesheet, the icon and the schema


def test_only_the_pages_own_assets_are_served(platform: PlatformProcess) -> None:
    for name in ("redoc.standalone.js", "..%2Fcore.py", "missing.js"):
        answer = httpx.get(f"{platform.url}/docs/assets/{name}")
        assert answer.status_code == 404, name


# Answer anyone (a load balancer's probes): no key required.
PUBLIC = {"/health", "/v2", "/v2/health/live", "/v2/health/ready", "/v1/auth/config",
          "/v1/auth/oidc/login", "/v1/auth/oidc/callback"}  # fmt: skip
# POSTs that act on the resource their path names and take no body.
NO_BODY = {"/v1/endpoints/{endpoint_id}/promote", "/v1/batches/{batch_id}/cancel",
           "/v1/webhooks/secret/rotate", "/v1/auth/logout"}  # fmt: skip
# JSON answers under /v1 that are no one shape: the stored answer of whichever route was asked.
ANY_JSON = {"/v1/async/{request_id}"}


def test_every_route_declares_its_schemas_and_bearer_auth(platform: PlatformProcess) -> None:
    """What /docs shows, walked route by route: every operation that needs a key declares the
    bearer scheme ("Try it out" sends the key); every body it takes and every success it answers
    has a schema, never FastAPI's empty `{}`; the inference routes' bodies are the real models."""
    spec = httpx.get(f"{platform.url}/openapi.json").json()
    bearer = spec["components"]["securitySchemes"]["HTTPBearer"]
    assert (bearer["type"], bearer["scheme"]) == ("http", "bearer")
    schemas = spec["components"]["schemas"]
    operations = [(p, m, op) for p, item in spec["paths"].items() for m, op in item.items()]
    assert len(operations) > 50
    for path, method, op in operations:
        where = f"{method.upper()} {path}"
        if path in PUBLIC:  # no key needed (`{}`: a key is optional, e.g. /health's details)
            assert not op.get("security") or {} in op["security"], where
        else:
            assert {"HTTPBearer": []} in op.get("security", []), where
        if method in ("post", "put", "patch") and path not in NO_BODY:
            body = op.get("requestBody", {}).get("content", {})
            assert body and all(c.get("schema") for c in body.values()), where
        # A success, or for the sign-in's start the redirect to the provider.
        successes = {c: r for c, r in op["responses"].items() if c[0] in "23"}
        assert successes, where
        for code, response in successes.items():
            for media, content in (response.get("content") or {}).items():
                assert content.get("schema"), f"{where} {code} {media}"
                if path.startswith("/v1/") and media == "application/json" and path not in ANY_JSON:
                    # A named model (tenants, keys, usage, endpoints …), not "some object".
                    ref = content["schema"].get("$ref", "")
                    assert ref.split("/")[-1] in schemas, f"{where} {code}: {content['schema']}"
        assert op["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"]
    for route, model in (("/v1/chat/completions", "ChatCompletionRequest"),
                         ("/v1/completions", "CompletionRequest"),
                         ("/v1/embeddings", "EmbeddingRequest"),
                         ("/v1/responses", "ResponsesRequest")):  # fmt: skip
        body = spec["paths"][route]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"].endswith("/" + model) and model in schemas
        assert "logit_bias" in schemas[model]["properties"] or model != "ChatCompletionRequest"
    # The management answers name their fields (the schemathesis suite checks real answers).
    tenants = spec["paths"]["/v1/tenants"]["get"]["responses"]["200"]["content"]
    assert tenants["application/json"]["schema"]["$ref"].endswith("/TenantList")
    assert {"id", "tier", "monthly_token_quota"} <= set(schemas["Tenant"]["required"])
    assert "key" in schemas["ApiKeyCreated"]["required"]
    assert "load_progress" in schemas["Replica"]["properties"]
