"""Cache-aware routing end to end: `modelyard serve` with two real replicas of a tiny random model.

A replica reports in its health check which prefix keys its KV cache holds; a request sharing a
long prefix with an earlier one goes to the replica that served that one (its usage shows the
prefix read from the cache), and a holder loaded past its bound is skipped: the other replica
takes the request (and computes the prefix: no cached tokens). A replica is held loaded by
stopping its process (SIGSTOP) with a request in flight on it; the health probe's timeout is
long, so a probe meanwhile waits instead of taking it out of routing.
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
from tests.platform_harness import PlatformProcess, deploy
from tests.tiny_models import build_model
from tests.waiting import wait_until

ENGINE = json.dumps({"kv_cache_memory": "64MiB", "dtype": "float32"})
SYSTEM = "You answer questions about the accounts of a small bank, briefly and politely. " * 6


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("m") / "tiny", "llama")


@pytest.fixture()
def platform(tmp_path: Path, cache_dir: Path) -> Iterator[PlatformProcess]:
    env = {
        "MODELYARD_WORKER_ENGINE": ENGINE,
        "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.3",
        "MODELYARD_HEALTH_PROBE_TIMEOUT_S": "120",
    }
    p = PlatformProcess(tmp_path / "data", env).start()
    try:
        yield p
    finally:
        p.stop()


def ask(p: PlatformProcess, question: str) -> int:
    """One chat request sharing the system prompt; the prompt tokens read from a cache."""
    r = p.openai().chat.completions.create(
        model="pair",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=2,
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return int(r.usage.prompt_tokens_details.cached_tokens or 0)


def held(address: str) -> frozenset[bytes]:
    body = httpx.get(f"{address}/health", timeout=10).json()
    keys = decode_digest(body["prefix_digest"]["keys"])
    assert keys is not None
    return keys


def test_routes_to_the_replica_holding_the_prefix_and_skips_it_when_loaded(
    platform: PlatformProcess, tiny_dir: Path
) -> None:
    api = platform.api()
    endpoint = deploy(api, "pair", str(tiny_dir), hardware={"min_replicas": 2, "max_replicas": 2})

    def replicas() -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = api.get(f"/v1/endpoints/{endpoint}").json()["replicas"][
            "items"
        ]
        return items

    assert ask(platform, "What is my balance?") == 0  # nobody has seen the prompt
    # Exactly one replica, the one that served it, reports its prefix in its digest.
    holder, other = wait_until(
        lambda: _split(replicas()), "one replica reporting the prompt's prefix"
    )
    for question in ("Can I open a savings account?", "How do I close my card?", "Fees?"):
        assert ask(platform, question) > 0  # the holder served it, from its cache
    assert not held(other["address"])  # and the other replica never saw the prompt

    # The holder loaded past its bound (one request in flight, the other replica idle): skipped.
    os.kill(holder["pid"], signal.SIGSTOP)
    try:
        stuck: dict[str, int] = {}
        t = threading.Thread(target=lambda: stuck.update(n=ask(platform, "Where is my bank?")))
        t.start()
        wait_until(
            lambda: next(r for r in replicas() if r["id"] == holder["id"])["outstanding"] == 1,
            "the stopped holder having a request in flight",
        )
        assert ask(platform, "Can I get a loan?") == 0  # the other replica, computing it all
    finally:
        os.kill(holder["pid"], signal.SIGCONT)
    t.join(timeout=120)
    assert stuck["n"] > 0  # the request in flight was the holder's, read from its cache
    wait_until(lambda: held(other["address"]), "the other replica reporting the prefix too")


def _split(items: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(the replica whose digest holds keys, the one whose digest is empty), else None."""
    if len(items) != 2:
        return None
    a, b = items
    ha, hb = held(a["address"]), held(b["address"])
    if ha and not hb:
        return a, b
    if hb and not ha:
        return b, a
    return None
