"""Schemathesis over the whole API of a real `modelyard serve`, from its served `/openapi.json`.

Every operation gets a bounded number of generated requests, valid and invalid (derandomized,
so a run is repeatable), with three keys: the platform admin's, a tenant admin's and a tenant's
inference key, in both platform modes (SQLite with in-memory limits, PostgreSQL with Redis).
Each response must not be a 5xx, must match the schema the operation declares (OpenAI's error
shape under /v1, the protocol's under /v2), and must come back within the per-request timeout
(no hang); afterwards the platform still answers a plain request. A tiny random model is
deployed and most generated inference requests name it, so generated sampling fields reach a
real engine.

Then hypothesis over the management schemas themselves (`tests/management_bodies.py`): valid
and hostile bodies for deploy, endpoint PATCH, canary versions, tenants, keys, batches and
registry manifests, as the role each route is for and as an inference key, again with no 5xx;
valid deploys name a real model, so some are stored. Then schemathesis' state machine follows
the document's OpenAPI links (create a tenant, key, endpoint, file or batch, then get, patch,
delete it) as a tenant admin and as an inference key, again with no 5xx. Last, `modelyard serve`
is restarted on the database the run left behind, and must start and serve.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from modelyard.api.routes_batch import BatchCreate
from modelyard.api.routes_endpoints import EndpointUpdate
from modelyard.api.routes_versions import VersionAdd
from modelyard.protocol.management import (
    DeployRequest,
    KeyCreate,
    KeyUpdate,
    TenantCreate,
    TenantUpdate,
    VersionCreate,
)
from tests.management_bodies import body
from tests.platform_harness import PlatformProcess, create_key, create_tenant, deploy
from tests.tiny_models import build_model

MODEL = "tiny"
statuses: Counter[str] = Counter()  # what the run got back, printed with -s
# Examples per operation and identity (twice as many for the inference routes), on top of the
# explicit `@example`s: with ~90 operations the file takes about 4 minutes on 2 busy cores,
# both platform modes included (it took 7 at twice these counts).
EXAMPLES = {"platform-admin": 7, "tenant-admin": 5, "tenant": 4}
REQUEST_TIMEOUT_S = 30.0
CHECKS = [
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
    content_type_conformance,
]
# Operations that name a model in the body or the path: half their cases name the real one.
MODEL_IN_BODY = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    models = tmp_path_factory.mktemp("fuzz-models")
    build_model(models / MODEL, "llama")
    return models


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory,
    cache_dir: Path,
    platform_env: dict[str, str],
    models: Path,
) -> Iterator[PlatformProcess]:
    env = {
        **platform_env,
        "MODELYARD_LOCAL_ARTIFACT_ROOTS": json.dumps([str(models)]),
        "MODELYARD_WORKER_ENGINE": json.dumps(
            # Short generations: a fuzzer asks for every max_tokens and n the schema allows.
            {"kv_cache_memory": "64MiB", "dtype": "float32", "max_tokens_cap": 16}
        ),
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5",
    }
    p = PlatformProcess(tmp_path_factory.mktemp("fuzz-data"), env).start()
    try:
        deploy(p.api(), MODEL, str(models / MODEL), public=True)
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def keys(platform: PlatformProcess) -> dict[str, str]:
    admin = platform.api()
    tenant_id = create_tenant(admin, f"fuzz-{time.time_ns()}")
    return {
        "platform-admin": platform.admin_key,
        "tenant-admin": create_key(admin, tenant_id, scopes=["admin", "inference"])["key"],
        "tenant": create_key(admin, tenant_id, scopes=["inference"])["key"],
    }


def _with_model(operation: Any, strategy: st.SearchStrategy) -> st.SearchStrategy:
    path = operation.path

    def name_it(args: tuple[Any, bool]) -> Any:
        case, use_model = args
        if use_model and path in MODEL_IN_BODY and isinstance(case.body, dict):
            case.body["model"] = MODEL
        if use_model and case.path_parameters and "model" in case.path_parameters:
            case.path_parameters["model"] = MODEL
        return case

    # Three cases in four name the deployed model, so most reach the engine.
    return st.tuples(strategy, st.integers(0, 3).map(bool)).map(name_it)


def _why(response: Any) -> str:
    """An error's param or code, to see which checks the generated requests ran into."""
    if response.status_code < 400:
        return ""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return ""
    return f" {error.get('param') or error.get('code')}" if isinstance(error, dict) else ""


def _fuzz(operation: Any, base_url: str, key: str, examples: int, counter: list[int]) -> None:
    # Valid requests and invalid ones (wrong types, out of range, missing fields) alike.
    strategies = [operation.as_strategy(GenerationMode.POSITIVE)]
    with contextlib.suppress(Exception):  # an operation with nothing to get wrong has none
        strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))
    strategy = _with_model(operation, st.one_of(strategies))
    if operation.path in MODEL_IN_BODY or operation.path.endswith("/infer"):
        examples *= 2

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: report the first failure
        suppress_health_check=list(HealthCheck),
    )
    @given(case=strategy)
    def run(case: Any) -> None:
        headers = {"authorization": f"Bearer {key}"}
        try:
            response = case.call(base_url=base_url, headers=headers, timeout=REQUEST_TIMEOUT_S)
        except Exception as exc:  # a timeout or a dropped connection: the server hung or died
            raise AssertionError(f"no answer: {exc!r}\n{case.as_curl_command(headers)}") from exc
        counter[0] += 1
        statuses[f"{operation.method.upper()} {operation.path} {response.status_code}"
                 f"{_why(response)}"] += 1  # fmt: skip
        case.validate_response(response, checks=CHECKS, headers=headers)

    run()


@pytest.mark.timeout(360)  # hundreds of generated requests: 140 s on a busy 2 vCPU
@pytest.mark.parametrize("who", list(EXAMPLES))
def test_every_operation_survives_generated_requests(
    platform: PlatformProcess, keys: dict[str, str], who: str
) -> None:
    schema = schemathesis.openapi.from_url(f"{platform.url}/openapi.json")
    counter = [0]
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        operations += 1
        try:
            _fuzz(operation, platform.url, keys[who], EXAMPLES[who], counter)
        except (Exception, BaseExceptionGroup) as exc:  # every operation's failure, not the first
            failures.append(f"{operation.method.upper()} {operation.path}: {exc}")
    # The platform still answers a plain request after the whole run.
    r = httpx.post(
        f"{platform.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {keys[who]}"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        timeout=REQUEST_TIMEOUT_S,
    )
    print(f"\nfuzzed {counter[0]} requests over {operations} operations as {who}")
    print("\n".join(f"{n:4} {what}" for what, n in sorted(statuses.items())))
    assert not failures, "\n\n".join(failures)
    assert r.status_code == 200, r.text


# ----- hypothesis over the management schemas --------------------------------------------------

MANAGEMENT_EXAMPLES = 30  # per route and role: about 20 s per platform mode on 2 busy cores


@pytest.fixture(scope="module")
def mgmt(platform: PlatformProcess, models: Path) -> dict[str, Any]:
    """A tenant whose ceilings keep what valid deploys start small (2 endpoints, 2 replicas), a
    deployed endpoint of it to PATCH, and a tenant and a key to update."""
    admin = platform.api()
    r = admin.post("/v1/tenants", json={"name": "mgmt-fuzz", "max_endpoints": 2, "max_replicas": 2})
    assert r.status_code == 201, r.text
    tenant_id = r.json()["id"]
    tenant_admin = create_key(admin, tenant_id, scopes=["admin", "inference"])["key"]
    endpoint_id = deploy(platform.api(tenant_admin), "mgmt-target", str(models / MODEL), wait=False)
    return {
        "tenant-admin": tenant_admin,
        "tenant": create_key(admin, tenant_id, scopes=["inference"])["key"],
        "endpoint_id": endpoint_id,
        "other_tenant": create_tenant(admin, "mgmt-fuzz-other"),
        "key_id": create_key(admin, tenant_id, scopes=["inference"])["id"],
        "artifact": str(models / MODEL),
    }


def _deploy_body(artifact: str) -> st.SearchStrategy[dict[str, Any]]:
    """Valid deploy bodies naming the real model (stored, and started within the ceilings)."""

    def real(b: dict[str, Any]) -> dict[str, Any]:
        return {**b, "model_artifact": artifact, "framework": "native", "engine": {},
                "public": False}  # fmt: skip

    return body(DeployRequest, hostile=False).map(real)


def _known_crashers(path: str, artifact: str) -> list[dict[str, Any]]:
    """Bodies that broke the platform before (issue 27), tried first on every run: a scaling
    key the schema let through and the autoscaler could not read (a 500, and a stored row that
    stopped every later start)."""
    boom = {"panic_threshold": "boom"}
    if path == "/v1/models/deploy":
        return [{"model_name": "boom", "model_artifact": artifact, "scaling": boom}]
    if path == "/v1/endpoints/{endpoint_id}":
        return [{"scaling": boom}, {"sampling_defaults": {"temperature": 0.5}}]
    return []


# (method, path, body strategy, role); {endpoint_id}, {tenant_id}, {key_id} filled in.
def _management_cases(m: dict[str, Any]) -> list[tuple[str, str, Any, str]]:
    cases: list[tuple[str, str, Any, str]] = []
    for path, method, model, role in (
        ("/v1/models/deploy", "POST", DeployRequest, "tenant-admin"),
        ("/v1/endpoints/{endpoint_id}", "PATCH", EndpointUpdate, "tenant-admin"),
        ("/v1/endpoints/{endpoint_id}/versions", "POST", VersionAdd, "tenant-admin"),
        ("/v1/tenants", "POST", TenantCreate, "platform-admin"),
        ("/v1/tenants/{tenant_id}", "PATCH", TenantUpdate, "platform-admin"),
        ("/v1/keys", "POST", KeyCreate, "tenant-admin"),
        ("/v1/keys/{key_id}", "PATCH", KeyUpdate, "tenant-admin"),
        ("/v1/batches", "POST", BatchCreate, "tenant"),
        ("/v1/registry/models/fuzzed/versions", "POST", VersionCreate, "tenant-admin"),
    ):
        strategy = st.one_of(body(model, hostile=True), body(model, hostile=False))
        if model is DeployRequest:
            strategy = st.one_of(strategy, _deploy_body(m["artifact"]))
        cases.append((method, path, strategy, role))
        if role != "tenant":  # and as a key without the scope: refused, never a 5xx
            cases.append((method, path, strategy, "tenant"))
    return cases


def _fuzz_route(
    http: httpx.Client, method: str, url: str, strategy: Any, key: str, label: str,
    seen: Counter[str], explicit: list[dict[str, Any]],
) -> None:  # fmt: skip
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}

    @settings(
        max_examples=MANAGEMENT_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(payload=strategy)
    def run(payload: Any) -> None:
        content = json.dumps(payload)
        r = http.request(method, url, content=content, headers=headers)
        seen[f"{label}: {r.status_code}"] += 1
        assert r.status_code < 500, f"{method} {url} {content[:2000]}\n{r.text}"

    for payload in explicit:
        run = example(payload=payload)(run)
    run()


def test_management_schemas_survive_hypothesis(
    platform: PlatformProcess, mgmt: dict[str, Any]
) -> None:
    keys = {**mgmt, "platform-admin": platform.admin_key}
    ids = {"endpoint_id": mgmt["endpoint_id"], "tenant_id": mgmt["other_tenant"],
           "key_id": mgmt["key_id"]}  # fmt: skip
    seen: Counter[str] = Counter()
    failures: list[str] = []
    with httpx.Client(base_url=platform.url, timeout=REQUEST_TIMEOUT_S) as http:
        for method, path, strategy, role in _management_cases(mgmt):
            label = f"{method} {path} as {role}"
            try:
                explicit = _known_crashers(path, mgmt["artifact"])
                url = path.format(**ids)
                _fuzz_route(http, method, url, strategy, keys[role], label, seen, explicit)
            except (Exception, BaseExceptionGroup) as exc:
                failures.append(f"{label}: {exc}")
    print("\n".join(f"{n:4} {what}" for what, n in sorted(seen.items())))
    assert not failures, "\n\n".join(failures)
    # Some generated deploys were valid, and stored.
    assert seen["POST /v1/models/deploy as tenant-admin: 202"], seen


# ----- schemathesis' state machine over the OpenAPI links ---------------------------------------

STATEFUL_PATHS = r"^/v1/(tenants|keys|models/deploy|endpoints|files|batches)"
STATEFUL = {"max_examples": 15, "stateful_step_count": 10}  # per role: under a minute


@pytest.mark.parametrize("who", ["tenant-admin", "tenant"])
def test_linked_operations_survive_the_state_machine(
    platform: PlatformProcess, keys: dict[str, str], who: str
) -> None:
    """Sequences of calls chained by the document's links (a created id fed to the operations
    on it), generated by schemathesis: no 5xx, no hang."""
    schema = schemathesis.openapi.from_url(f"{platform.url}/openapi.json")
    schema = schema.include(path_regex=STATEFUL_PATHS)
    links = sum(
        len(response.get("links", {}))
        for item in schema.raw_schema["paths"].values()
        for operation in item.values()
        for response in operation.get("responses", {}).values()
    )
    assert links >= 10, links  # create -> get/patch/delete of tenants, keys, endpoints…
    headers = {"authorization": f"Bearer {keys[who]}"}
    calls: Counter[str] = Counter()

    class Machine(schema.as_state_machine()):  # type: ignore[misc]
        def get_call_kwargs(self, case: Any) -> dict[str, Any]:
            return {"base_url": platform.url, "headers": headers, "timeout": REQUEST_TIMEOUT_S}

        def validate_response(self, response: Any, case: Any, **kwargs: Any) -> None:
            calls[f"{case.method.upper()} {case.path} {response.status_code}"] += 1
            case.validate_response(response, checks=[not_a_server_error], headers=headers)

    Machine.run(
        settings=settings(
            **STATEFUL,
            deadline=None,
            derandomize=True,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
    )
    print("\n".join(f"{n:4} {what}" for what, n in sorted(calls.items())))
    assert sum(calls.values()) > 0


def test_serve_restarts_on_what_the_fuzzing_left(platform: PlatformProcess) -> None:
    """Runs after the fuzzing above: whatever it stored, the platform starts again and serves.
    The request goes with a key of a tenant made here: the tenant admin's fuzzing may revoke its
    own tenant's keys, as it is allowed to (a run here revoked the tenant key of `keys`)."""
    admin = platform.api()
    key = create_key(admin, create_tenant(admin, f"restart-{time.time_ns()}"))["key"]
    platform.stop()
    platform.start(timeout=120)
    listed = platform.api().get("/v1/endpoints")
    assert listed.status_code == 200, listed.text
    deadline = time.monotonic() + 120
    while True:
        r = httpx.post(
            f"{platform.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {key}"},
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            timeout=REQUEST_TIMEOUT_S,
        )
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        assert r.status_code == 503, r.text  # its replica is starting again
    assert r.status_code == 200, r.text
