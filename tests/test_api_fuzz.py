"""Schemathesis over the whole API of a real `modelyard serve`, from its served `/openapi.json`.

Every operation gets a bounded number of generated requests, valid and invalid (derandomized,
so a run is repeatable), with three keys: the platform admin's, a tenant admin's and a tenant's
inference key, in both platform modes (SQLite with in-memory limits, PostgreSQL with Redis).
Each response must not be a 5xx, must match the schema the operation declares (OpenAI's error
shape under /v1, the protocol's under /v2), and must come back within the per-request timeout
(no hang); afterwards the platform still answers a plain request. A tiny random model is
deployed and most generated inference requests name it, so generated sampling fields reach a
real engine.
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
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.platform_harness import PlatformProcess, create_key, create_tenant, deploy
from tests.tiny_models import build_model

MODEL = "tiny"
statuses: Counter[str] = Counter()  # what the run got back, printed with -s
# Examples per operation and identity (twice as many for the inference routes): the file takes
# about a minute and a half on 2 busy cores, both platform modes included.
EXAMPLES = {"platform-admin": 14, "tenant-admin": 9, "tenant": 7}
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
def platform(
    tmp_path_factory: pytest.TempPathFactory, cache_dir: Path, platform_env: dict[str, str]
) -> Iterator[PlatformProcess]:
    models = tmp_path_factory.mktemp("fuzz-models")
    build_model(models / MODEL, "llama")
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
