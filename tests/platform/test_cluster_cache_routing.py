"""Cache-aware routing in cluster mode, with real processes: one `modelyard controller` (the
leader, whose health checks read the replicas' prefix digests) and two `modelyard gateway`s on
one PostgreSQL and one Redis database, two local replicas of a tiny random model.

Gateway 1 places two long prompts on different replicas: system prompt A by chat (on the replica
it lands on), then, with that replica held loaded (stopped by SIGSTOP with a request in flight on
it), instructions B by the Responses API, which goes to the other one. Gateway 2 never saw either
prompt. Once it shows each replica's digest as the replica itself reports it (its admin
`/health`), a chat sharing A and a Responses request sharing B each go to their holder: their
usage shows the prefix read from its cache. Without the digests gateway 2 would send both to the
same replica (the least loaded; on a tie, the first), and one of them would find nothing cached.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.core.prefix_keys import decode_digest
from tests.cluster_harness import Cluster, kill_workers
from tests.databases import fresh_postgres, fresh_redis
from tests.platform_harness import deploy
from tests.waiting import wait_until

ENGINE = json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"})
SYSTEM_A = "You answer questions about the accounts of a small bank, briefly and politely. " * 6
SYSTEM_B = "Tu réponds aux questions sur la météo des côtes bretonnes, en peu de mots. " * 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Cluster]:
    env = {
        "MODELYARD_WORKER_ENGINE": ENGINE,
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.3",
        # A stopped replica's probe waits instead of taking it out of routing.
        "MODELYARD_HEALTH_PROBE_TIMEOUT_S": "120",
    }
    with fresh_postgres() as database_url, fresh_redis() as redis_url:
        c = Cluster(tmp_path_factory.mktemp("cache"), models_dir, database_url, redis_url, env)
        try:
            c.controllers[0].start()
            c.leader()  # leads (and writes the admin key) before the gateways come
            for p in c.gateways:
                p.launch()
            for p in c.gateways:
                p.wait_up()
            yield c
        finally:
            for p in c.gateways + c.controllers:
                p.kill(signal.SIGTERM)
            kill_workers(str(models_dir))


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[None]:
    """The roles' logs and the replicas' (the controller's data dir holds theirs) on failure."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed > failed_before:
        logs = sorted((cluster.control_dir / "logs").glob("*.log"))
        print(cluster.output())
        for f in logs:
            print(f"===== {f.name}\n{f.read_text(errors='replace')[-3000:]}")


def ask_chat(api: httpx.Client, system: str, question: str) -> int:
    """A chat with this system prompt; the prompt tokens its replica read from its cache."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    r = api.post(
        "/v1/chat/completions", json={"model": "pair", "messages": messages, "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def ask_responses(api: httpx.Client, instructions: str, question: str) -> int:
    """A Responses API request with these instructions; the input tokens read from a cache."""
    body = {"model": "pair", "instructions": instructions, "input": question}
    r = api.post("/v1/responses", json={**body, "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["input_tokens_details"]["cached_tokens"])


def digest(address: str) -> tuple[int, frozenset[bytes]]:
    """The replica's own report: its digest's generation and keys."""
    report = httpx.get(f"{address}/health", timeout=10).json()["prefix_digest"]
    keys = decode_digest(report["keys"])
    assert keys is not None
    return int(report["generation"]), keys


def test_every_gateway_routes_by_the_replicas_digests(cluster: Cluster) -> None:
    with cluster.api(0) as g1, cluster.api(1) as g2:
        endpoint = deploy(g1, "pair", str(cluster.models_dir / "tiny"),
                          hardware={"min_replicas": 2, "max_replicas": 2})  # fmt: skip

        def replicas() -> list[dict[str, Any]]:
            items = g1.get(f"/v1/endpoints/{endpoint}").json()["replicas"]["items"]
            return list(items)

        def routed_by(api: httpx.Client) -> dict[str, Any]:
            """The replicas' digests a gateway holds (its admin `/health`)."""
            known: dict[str, Any] = api.get("/health").json()["prefix_digests"]
            return known.get(endpoint, {})

        wait_until(
            lambda: [r["state"] for r in replicas()] == ["ready", "ready"], "two ready replicas"
        )
        # Both gateways route to both (their first, empty digests have reached them).
        for api in (g1, g2):
            wait_until(lambda a=api: len(routed_by(a)) == 2, "both replicas at both gateways")
        assert ask_chat(g1, SYSTEM_A, "What is my balance?") == 0  # nobody has seen it
        holder_a = wait_until(
            lambda: next((r for r in replicas() if digest(r["address"])[1]), None),
            "a replica reporting prompt A",
        )
        holder_b = next(r for r in replicas() if r["id"] != holder_a["id"])
        assert not digest(holder_b["address"])[1]

        # A's holder loaded past its bound (a request in flight on it, the other idle): B,
        # sent meanwhile, goes to the other replica.
        os.kill(holder_a["pid"], signal.SIGSTOP)
        try:
            stuck: dict[str, int] = {}
            t = threading.Thread(
                target=lambda: stuck.update(n=ask_chat(g1, SYSTEM_A, "Where is my bank?"))
            )
            t.start()
            wait_until(
                lambda: (
                    next(r for r in replicas() if r["id"] == holder_a["id"])["outstanding"] == 1
                ),
                "the stopped holder of A having a request in flight",
            )
            assert ask_responses(g1, SYSTEM_B, "Will it rain in Brest?") == 0
        finally:
            os.kill(holder_a["pid"], signal.SIGCONT)
        t.join(timeout=120)
        assert stuck["n"] > 0  # the request in flight was A's holder's, read from its cache

        # What each replica holds now (nothing more is sent to them until gateway 2 knows it).
        reported = {r["id"]: digest(r["address"]) for r in (holder_a, holder_b)}
        assert all(keys for _, keys in reported.values()), reported

        def known_to_gateway_2() -> bool:
            known = routed_by(g2)
            return all(
                known.get(rid) == {"generation": gen, "keys": len(keys)}
                for rid, (gen, keys) in reported.items()
            )

        wait_until(known_to_gateway_2, "gateway 2 holding both replicas' digests")
        # Gateway 2 never sent either prompt: each goes to its holder, read from its cache.
        assert ask_chat(g2, SYSTEM_A, "Can I open a savings account?") > 0
        assert ask_responses(g2, SYSTEM_B, "Et demain à Quimper ?") > 0
        for r in (holder_a, holder_b):  # one request each, noted by the replica
            assert digest(r["address"])[0] == reported[r["id"]][0] + 1
