"""The gateway's /metrics as Prometheus and Grafana read it, on a real `modelyard serve`.

One platform with two tiny LLM endpoints (a public one of the platform admin's, one of tenant
A's) and a tiny embedding model in the shared encoder host: the replicas' engine series come
back through the gateway under vLLM's names with endpoint, replica, version, tenant and
model_name labels; a tenant's `metrics` key sees only its own series; every query of the Grafana
dashboard in `deploy/grafana/` names a series the platform exports; a replica that does not
answer is skipped and counted.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from modelyard.api.errors import install_error_handlers
from modelyard.api.routes_metrics import install_metrics
from modelyard.config import PlatformSettings
from modelyard.control.autoscaler import Decision
from modelyard.control.endpoint_scaler import Scaler
from modelyard.control.prewarm import TrafficHistory
from modelyard.core.cluster_auth import worker_token
from modelyard.core.errors import NotFound, Unavailable
from modelyard.gateway.federation import Federation, ScrapeTarget, SeriesOwner
from modelyard.gateway.metrics import (
    REQUEST_TENANT,
    Audience,
    EndpointSnapshot,
    GatewayMetrics,
    PlatformState,
    view,
)
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
    platform_running,
    tiny_models_env,
    wait_status,
)
from tests.tiny_encoders import build_embedding_model

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "modelyard.json"
METRICS_TOKEN = "prom-scrape-token"
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset", "le", "inf", "nan",
}  # fmt: skip


CLUSTER_SECRET = "metrics-test-cluster-secret-" + "0123456789abcdef" * 2


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path, cache_dir: Path
) -> Iterator[PlatformProcess]:
    build_embedding_model(models_dir / "tiny-embed")
    # A cluster secret of the test's own, so its in-process federation can scrape the replicas
    # (they demand the token derived from it; serve would otherwise make a random one).
    env = {
        **tiny_models_env(models_dir),
        "MODELYARD_METRICS_TOKEN": METRICS_TOKEN,
        "MODELYARD_CLUSTER_SECRET": CLUSTER_SECRET,
    }
    with platform_running(tmp_path_factory.mktemp("data"), env) as p:
        yield p


@pytest.fixture(scope="module")
def world(platform: PlatformProcess, models_dir: Path) -> dict[str, str]:
    """The endpoints and keys the tests share, and some traffic on them (streamed and not,
    embeddings, one request refused by a rate limit)."""
    admin = platform.api()
    a, b = create_tenant(admin, "metrics-a"), create_tenant(admin, "metrics-b")
    a_admin = create_key(admin, a, scopes=["admin", "inference"])["key"]
    # The three load side by side.
    public = deploy(admin, "tiny", str(models_dir / "tiny"), wait=False, public=True)
    embed = deploy(admin, "tiny-embed", str(models_dir / "tiny-embed"), wait=False, public=True)
    own = deploy(platform.api(a_admin), "a-tiny", str(models_dir / "tiny"), wait=False)
    for endpoint in (public, embed, own):
        wait_status(admin, endpoint, "ready")
    world = {
        "public": public,
        "embed": embed,
        "own": own,
        "a": a,
        "b": b,
        "a_inference": create_key(admin, a, scopes=["inference"])["key"],
        "a_metrics": create_key(admin, a, scopes=["metrics"])["key"],
        "b_inference": create_key(admin, b, scopes=["inference"], rpm_limit=2)["key"],
    }
    messages = [{"role": "user", "content": "Hello world"}]
    a_client = platform.openai(world["a_inference"])
    for model in ("tiny", "a-tiny"):
        a_client.chat.completions.create(model=model, messages=messages, max_tokens=6)
        for _ in a_client.chat.completions.create(
            model=model, messages=messages, max_tokens=6, stream=True
        ):
            pass
    a_client.embeddings.create(model="tiny-embed", input=["hello", "world"])
    # past the model's context: the replica answers 400 itself
    too_long = [{"role": "user", "content": "Hello world " * 600}]
    with pytest.raises(openai.BadRequestError):
        a_client.chat.completions.create(model="a-tiny", messages=too_long, max_tokens=4)
    b_client = platform.openai(world["b_inference"])
    b_client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    b_client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    refused = httpx.post(
        f"{platform.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {world['b_inference']}"},
        json={"model": "tiny", "messages": messages, "max_tokens": 4},
    )
    assert refused.status_code == 429
    return world


def scrape(platform: PlatformProcess, key: str) -> str:
    r = httpx.get(f"{platform.url}/metrics", headers={"authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return r.text


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def find(text: str, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    return [
        (lbl, v)
        for n, lbl, v in samples(text)
        if n == name and all(lbl.get(k) == want for k, want in labels.items())
    ]


def test_replicas_engine_series_come_back_with_vllm_names_and_endpoint_labels(
    platform: PlatformProcess, world: dict[str, str]
) -> None:
    text = scrape(platform, METRICS_TOKEN)
    endpoint = wait_status(platform.api(), world["public"], "ready")
    replica = endpoint["replicas"]["items"][0]
    tenants = platform.api().get("/v1/tenants").json()
    system = next(t["id"] for t in tenants["data"] if t["name"] == "system")
    running = find(text, "vllm:num_requests_running", endpoint=world["public"])
    assert len(running) == 1
    labels, _ = running[0]
    assert labels["model_name"] == "tiny"
    assert labels["replica"] == replica["id"]
    assert labels["version"] == (replica["version_id"] or "")
    assert labels["tenant"] == system  # the endpoint's owner
    assert "model" not in labels  # the worker's own label gives way to model_name
    for name in (
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:prefix_cache_queries_total",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_sum",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
    ):
        values = [v for _, v in find(text, name, endpoint=world["public"])]
        assert values and values[0] > 0, name
    assert find(text, "vllm:kv_cache_usage_perc", endpoint=world["own"], tenant=world["a"])
    assert find(text, "vllm:request_success_total", endpoint=world["own"], finished_reason="length")
    # modelyard's own names beside them (metrics_names=both, the default)
    assert find(text, "modelyard_kv_cache_usage_ratio", endpoint=world["own"])
    # the encoder host: each hosted model's series under its endpoint, the host's own apart
    assert find(text, "modelyard_encoder_requests_total", endpoint=world["embed"], api="embeddings")
    assert find(text, "modelyard_encoder_memory_budget_bytes", replica="encoder-host")


def test_platform_series_count_requests_tokens_replicas_and_refusals(
    platform: PlatformProcess, world: dict[str, str]
) -> None:
    text = scrape(platform, platform.admin_key)
    a, b = world["a"], world["b"]
    assert find(text, "modelyard_gateway_requests_total", model_name="tiny", status="200")
    by_endpoint = "modelyard_gateway_endpoint_requests_total"
    assert [v for _, v in find(text, by_endpoint, endpoint=world["public"], tenant=a)] == [2.0]
    own = {lbl["status"]: v for lbl, v in find(text, by_endpoint, endpoint=world["own"])}
    assert own == {"200": 2.0, "400": 1.0}
    assert [v for _, v in find(text, "modelyard_gateway_requests_total", status="400")] == [1.0]
    served = find(
        text, "modelyard_gateway_request_latency_seconds_count", endpoint=world["public"], tenant=a
    )
    assert served and served[0][1] == 2
    assert find(text, "modelyard_gateway_time_to_first_token_seconds_count", tenant=a)
    tokens = find(text, "modelyard_gateway_tokens_total", endpoint=world["own"], kind="completion")
    assert tokens and tokens[0][1] > 0
    assert find(text, "modelyard_endpoint_replicas", endpoint=world["own"], state="ready") == [
        ({"endpoint": world["own"], "model_name": "a-tiny", "tenant": a, "state": "ready"}, 1.0)
    ]
    assert find(text, "modelyard_gateway_queue_depth", endpoint=world["public"])
    assert find(text, "modelyard_endpoint_desired_replicas", endpoint=world["own"])
    refused = find(text, "modelyard_gateway_rejected_requests_total", reason="rate_limit_rpm")
    # by tenant: b's key has the 2 rpm limit
    assert refused == [({"status": "429", "reason": "rate_limit_rpm", "tenant": b}, 1.0)]
    assert find(text, "modelyard_gateway_request_latency_seconds_count", tenant=b)


def test_a_tenants_metrics_key_sees_only_its_own_series(
    platform: PlatformProcess, world: dict[str, str]
) -> None:
    a, b = world["a"], world["b"]
    text = scrape(platform, world["a_metrics"])
    got = samples(text)
    assert got
    for name, labels, _ in got:
        if "tenant" in labels:
            assert labels["tenant"] == a, (name, labels)
        else:
            assert labels.get("endpoint") == world["own"], (name, labels)
    assert b not in text  # no other tenant's id, anywhere
    # its own endpoint's engine series, and its own requests on the public model
    assert find(text, "vllm:num_requests_running", endpoint=world["own"])
    assert find(text, "modelyard_gateway_request_latency_seconds_count", endpoint=world["public"])
    # not the public model's engine (other tenants' load), nor the platform's own series
    assert not find(text, "vllm:num_requests_running", endpoint=world["public"])
    assert not find(text, "modelyard_gateway_rejected_requests_total")
    assert "encoder-host" not in text
    # keys without the scope are refused; a metrics key is no inference key
    for key in (world["a_inference"], create_key(platform.api(), a, scopes=["admin"])["key"]):
        r = httpx.get(f"{platform.url}/metrics", headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    r = httpx.post(
        f"{platform.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {world['a_metrics']}"},
        json={"model": "a-tiny", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 403


def promql_metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads (label matchers, strings, ranges, grouping
    labels and functions taken out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\w+", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w:.])[A-Za-z_:][\w:]*", expr):  # not the unit of 5m
        rest = expr[m.end() :].lstrip()
        if rest.startswith("(") or m.group(0).lower() in PROMQL_WORDS:
            continue
        names.add(m.group(0))
    return names


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for var in board["templating"]["list"]:
        query = var.get("query")
        if var["type"] == "query":
            q = query["query"] if isinstance(query, dict) else query
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", q))
    return exprs


def test_promql_names_are_extracted() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, model_name) (rate(vllm:ttft_bucket{model_name=~"$m",'
        ' x="a{b}"}[$__rate_interval]))) / sum without (le) (foo_total offset 5m) + on (x) bar'
    )
    assert promql_metric_names(expr) == {"vllm:ttft_bucket", "foo_total", "bar"}


def test_every_dashboard_query_names_an_exported_series(
    platform: PlatformProcess, world: dict[str, str]
) -> None:
    text = scrape(platform, METRICS_TOKEN)
    exported = {name for name, _, _ in samples(text)}
    # families with no sample yet (no autoscaling decision in this short run) still say TYPE
    exported |= set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    wanted = set()
    for expr in dashboard_queries():
        names = promql_metric_names(expr)
        assert names, f"no series in {expr!r}"
        wanted |= names
    assert len(wanted) >= 15
    missing = sorted(wanted - exported)
    assert not missing, f"the dashboard reads series the platform does not export: {missing}"
    board = json.loads(DASHBOARD.read_text())
    titles = " ".join(p["title"].lower() for p in board["panels"])
    needed = ["requests", "time to first token", "inter-token", "tokens per second", "kv cache"]
    needed += ["queue depth", "replicas", "autoscaling", "429", "errors"]
    for word in needed:
        assert word in titles, word


def test_a_replica_that_does_not_answer_is_skipped_and_counted(
    platform: PlatformProcess, world: dict[str, str]
) -> None:
    endpoint = wait_status(platform.api(), world["own"], "ready")
    live = endpoint["replicas"]["items"][0]
    owner = SeriesOwner(world["own"], world["a"], "a-tiny", live["version_id"] or "")
    dead = ScrapeTarget("http://127.0.0.1:9", "rep-gone", {None: owner})
    token = {"authorization": f"Bearer {worker_token(CLUSTER_SECRET)}"}
    federation = Federation(timeout_s=2.0, cache_s=60.0, headers=token)
    # A process that takes the connection and never answers.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        hung = ScrapeTarget(f"http://127.0.0.1:{silent.getsockname()[1]}", "rep-hung", {})

        async def twice() -> tuple[list, list]:
            targets = [ScrapeTarget(live["address"], live["id"], {None: owner}), dead, hung]
            return await federation.collect(targets), await federation.collect(targets)

        first, second = asyncio.run(twice())
    text = view(first, Audience()).decode()
    assert find(text, "vllm:num_requests_running", replica=live["id"], endpoint=world["own"])
    assert find(text, "modelyard_federation_errors_total") == [
        ({"replica": "rep-gone"}, 1.0),
        ({"replica": "rep-hung"}, 1.0),
    ]
    # the second scrape within cache_s read nobody again
    assert federation.errors == {"rep-gone": 1, "rep-hung": 1}
    assert [f.name for f in second] == [f.name for f in first]


def test_metrics_names_keep_one_naming_or_both() -> None:
    def engine_families() -> list:
        families = []
        for name, label in (
            ("modelyard_num_requests_running", "model_name"),
            ("vllm:num_requests_running", "model_name"),
            ("modelyard_gateway_queue_depth", "model_name"),
        ):
            g = GaugeMetricFamily(name, "x", labels=["endpoint", label])
            g.add_metric(["ep-1", "tiny"], 1)
            families.append(g)
        return families

    def names(text: bytes) -> set[str]:
        return {n for n, _, _ in samples(text.decode())}

    both = names(view(engine_families(), Audience(), "both"))
    assert both == {
        "modelyard_num_requests_running",
        "vllm:num_requests_running",
        "modelyard_gateway_queue_depth",
    }
    assert names(view(engine_families(), Audience(), "vllm")) == {
        "vllm:num_requests_running",
        "modelyard_gateway_queue_depth",  # platform series have no vLLM twin: always there
    }
    assert names(view(engine_families(), Audience(), "modelyard")) == {
        "modelyard_num_requests_running",
        "modelyard_gateway_queue_depth",
    }
    mine = view(engine_families(), Audience("tn-a", frozenset({"ep-2"})), "both")
    assert names(mine) == set()


def test_autoscaling_decisions_are_counted_by_direction_and_reason(tmp_path: Path) -> None:
    scaler = Scaler(PlatformSettings(), TrafficHistory())
    for d in (
        Decision(0.0, 1, 3, "panic: concurrency over 6s wants 3", True),
        Decision(1.0, 3, 2, "concurrency over 60s averages to 2 replica(s)", False),
        Decision(2.0, 2, 0, "idle for 300s: scale to zero", False),
        Decision(3.0, 0, 1, "a request arrived: scale from zero", False),
        Decision(4.0, 0, 1, "pre-warm: 3.0 requests expected within 300s", False),
        Decision(5.0, 2, 0, "idle for 301s: scale to zero", False),
    ):
        scaler.count("ep-1", d)
    assert scaler.decided == {
        ("ep-1", "up", "panic"): 1,
        ("ep-1", "down", "load"): 1,
        ("ep-1", "down", "idle"): 2,
        ("ep-1", "up", "request"): 1,
        ("ep-1", "up", "prewarm"): 1,
    }
    snapshot = EndpointSnapshot("ep-1", "tn-a", "tiny", 0, 0, 1, {"ready": 1})
    text = view(
        GatewayMetrics().families(PlatformState([snapshot], scaler.decided)), Audience()
    ).decode()
    labels = {"endpoint": "ep-1", "model_name": "tiny", "tenant": "tn-a"}
    got = find(text, "modelyard_autoscaling_decisions_total", direction="down", reason="idle")
    assert got == [({**labels, "direction": "down", "reason": "idle"}, 2.0)]


def test_503s_the_platform_answers_are_counted_by_reason() -> None:
    """Refusals raised as domain errors on an inference path (limits store down, model
    unavailable, …) are counted, by tenant, where the platform's handler answers them; others
    are not."""
    metrics = GatewayMetrics()
    app = FastAPI()
    install_error_handlers(app)
    install_metrics(app, SimpleNamespace(metrics=metrics))  # type: ignore[arg-type]

    @app.post("/v1/chat/completions")
    async def chat() -> None:
        REQUEST_TENANT.set("tn-a")  # what the gateway's key check does
        raise Unavailable("limits store down", code="limits_unavailable", retry_after_s=5)

    @app.post("/v1/embeddings")
    async def embeddings() -> None:
        raise NotFound("no such model", code="model_not_found")

    @app.get("/v1/endpoints")
    async def endpoints() -> None:
        raise Unavailable("busy", code="something")

    client = TestClient(app)
    r = client.post("/v1/chat/completions")
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["code"] == "limits_unavailable"
    assert client.post("/v1/embeddings").status_code == 404
    assert client.get("/v1/endpoints").status_code == 503
    text = view(metrics.families(PlatformState()), Audience()).decode()
    assert find(text, "modelyard_gateway_rejected_requests_total") == [
        ({"status": "503", "reason": "limits_unavailable", "tenant": "tn-a"}, 1.0)
    ]
