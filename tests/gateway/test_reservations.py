"""Quota and TPM reservations are upper bounds, through a real `modelyard serve` in both
platform modes (SQLite with limits in memory; PostgreSQL with limits in Redis).

Admission reserves the most a request can use (`gateway/reservation.py`) and refuses once the
month's counter reaches the quota, so whatever a tenant sends, concurrently or in a batch, its
usage rows add up to at most its quota plus one reservation, and a key's tokens per minute to
its TPM plus what refills meanwhile. Text of 4-byte characters (U+1D518, 4 tokens each for the
tiny model's byte-level BPE) is what a characters ÷ 4 estimate under-reserved most; batch
items never reached the quota at all (the runner called a verb the recorder no longer had).

The property test at the end generates requests over every token-producing route (`ROUTES`:
add a route there and it is generated too) against tenants with small quotas."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from modelyard.gateway.reservation import reservation_bound
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    deploy,
    jsonl,
    tiny_models_env,
    usage_rows,
    wait_batch,
    wait_usage,
)
from tests.tiny_encoders import build_embedding_model

# A hostile input must not hold any process's event loop (tests/loop_stalls.py).
pytestmark = pytest.mark.usefixtures("no_loop_stalls")

ASTRAL = "\U0001d518"  # 𝔘: 4 UTF-8 bytes, 4 tokens for the tiny model's byte-level BPE
CAP = 4096  # the endpoints' max_tokens cap (the engine's default)


@pytest.fixture(scope="module")
def platform(
    platform_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    models_dir: Path,
    cache_dir: Path,
) -> Iterator[PlatformProcess]:
    emb = build_embedding_model(models_dir / "emb")
    env = {**platform_env, **tiny_models_env(models_dir), "MODELYARD_BATCH_POLL_INTERVAL_S": "0.1"}
    p = PlatformProcess(tmp_path_factory.mktemp("data"), env).start()
    try:
        admin = p.api()
        deploy(admin, "tiny", str(models_dir / "tiny"), public=True)
        deploy(admin, "emb", str(emb), public=True)
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def admin(platform: PlatformProcess) -> httpx.Client:
    return platform.api()


class Tenant:
    """A fresh tenant with `quota` tokens a month and one inference key (`key_fields`: its
    limits)."""

    def __init__(
        self, platform: PlatformProcess, admin: httpx.Client, quota: int | None, **key_fields: Any
    ) -> None:
        r = admin.post(
            "/v1/tenants", json={"name": f"r-{time.time_ns()}", "monthly_token_quota": quota}
        )
        assert r.status_code == 201, r.text
        self.id = str(r.json()["id"])
        self.key = str(create_key(admin, self.id, scopes=["inference"], **key_fields)["key"])
        self.platform = platform
        self.admin = admin
        # One client (thread-safe) made up front, so that requests released together arrive
        # together.
        self.http = platform.api(self.key)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(path, json=body, timeout=120)

    def billed(self, rows_at_least: int) -> list[int]:
        """Total tokens of each of the tenant's usage rows, once there are `rows_at_least`."""
        rows = wait_usage(self.admin, lambda r: len(r) >= rows_at_least, tenant_id=self.id)
        return [int(r["prompt_tokens"]) + int(r["completion_tokens"]) for r in rows]


def concurrently(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run `calls` in threads released together; their results in order."""
    start = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        start.wait()
        results[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def astral_chat(chars: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": ASTRAL * chars}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }


def run_batch(t: Tenant, bodies: list[dict[str, Any]], url: str = "/v1/chat/completions") -> Any:
    client = t.platform.openai(t.key)
    lines = [
        {"custom_id": f"i-{i}", "method": "POST", "url": url, "body": b}
        for i, b in enumerate(bodies)
    ]
    upload = client.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint=url,  # type: ignore[arg-type]
        completion_window="24h",
    )
    return wait_batch(client, batch.id, {"completed", "failed"})


# ----- the findings, reproduced ----------------------------------------------------------------


def test_a_batch_stops_at_the_monthly_quota(platform: PlatformProcess, admin: httpx.Client):
    """Before: items never moved the quota counter (an AttributeError after each commit), so
    12 items of ~120 tokens all ran against a 400-token quota."""
    t = Tenant(platform, admin, quota=400)
    body = astral_chat(25, 8)
    done = run_batch(t, [body] * 12)
    assert done.status == "completed"
    counts = done.request_counts
    assert counts.completed >= 1 and counts.failed >= 1, counts
    errors = [
        line
        for line in platform.openai(t.key).files.content(done.error_file_id).text.splitlines()
        if line
    ]
    assert all("insufficient_quota" in line for line in errors)
    billed = t.billed(counts.completed)
    assert len(billed) == counts.completed
    assert sum(billed) <= 400 + reservation_bound("chat", body, CAP)


def test_concurrent_four_byte_text_stays_within_quota_and_one_reservation(
    platform: PlatformProcess, admin: httpx.Client
) -> None:
    """Before: each request reserved ~30 tokens (characters ÷ 4) and used ~420; six at once
    against 1,100 tokens all ran."""
    t = Tenant(platform, admin, quota=1100)
    body = astral_chat(100, 8)
    responses = concurrently([lambda: t.post("/v1/chat/completions", body)] * 6)
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert ok and refused
    assert all(r.json()["error"]["code"] == "insufficient_quota" for r in refused)
    billed = t.billed(len(ok))
    assert len(billed) == len(ok)
    assert sum(billed) <= 1100 + reservation_bound("chat", body, CAP)


def test_tpm_is_honoured_for_four_byte_text(platform: PlatformProcess, admin: httpx.Client):
    """Before: a key of 1,000 tokens a minute ran six ~420-token requests at once. The bucket
    holds 1,000 and refills 1,000 a minute, so what runs within `elapsed` seconds is bounded by
    1,000 × (1 + elapsed / 60)."""
    t = Tenant(platform, admin, quota=None, tpm_limit=1000)
    body = astral_chat(100, 8)
    started = time.monotonic()
    responses = concurrently([lambda: t.post("/v1/chat/completions", body)] * 6)
    elapsed = time.monotonic() - started
    ok = [r for r in responses if r.status_code == 200]
    assert ok and all(r.status_code in (200, 429) for r in responses)
    billed = t.billed(len(ok))
    assert sum(billed) <= 1000 * (1 + elapsed / 60)


def test_a_request_that_can_never_fit_the_tpm_says_so(
    platform: PlatformProcess, admin: httpx.Client
) -> None:
    t = Tenant(platform, admin, quota=None, tpm_limit=1000)
    r = t.post(
        "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 429
    assert "Request too large" in r.json()["error"]["message"]


# ----- the property: Σ usage ≤ quota + one reservation, over every route -----------------------

# Heavy on 4-byte characters (where tokens outnumber characters most), up to 400 tokens: with
# 16 generated, the tiny model's 512-token context holds it.
TEXT = st.text(
    alphabet=st.sampled_from(["a", " ", "é", "中", "\n", ASTRAL, ASTRAL, ASTRAL]), max_size=100
)
MAX_TOKENS = st.integers(1, 16)


@dataclass
class Route:
    """A token-producing route: how to draw a request body for it, the kind its reservation is
    computed as, and whether its requests go as batch lines (with `url`)."""

    bodies: st.SearchStrategy[dict[str, Any]]
    kind: str
    path: str
    batch: bool = False


ROUTES: dict[str, Route] = {
    "chat": Route(
        st.builds(
            lambda text, m, n, sys: {
                "model": "tiny",
                "messages": ([{"role": "system", "content": sys}] if sys else [])
                + [{"role": "user", "content": text}],
                "max_tokens": m,
                "n": n,
                "ignore_eos": True,
            },
            TEXT,
            MAX_TOKENS,
            st.integers(1, 2),
            st.one_of(st.none(), TEXT),
        ),
        "chat",
        "/v1/chat/completions",
    ),
    "completions": Route(
        st.builds(
            lambda prompt, m, n: {
                "model": "tiny",
                "prompt": prompt,
                "max_tokens": m,
                "n": n,
                "ignore_eos": True,
            },
            st.one_of(TEXT.filter(bool), st.lists(TEXT.filter(bool), min_size=1, max_size=2)),
            MAX_TOKENS,
            st.integers(1, 2),
        ),
        "completions",
        "/v1/completions",
    ),
    "responses": Route(
        st.builds(
            lambda text, m, instructions: {
                "model": "tiny",
                "input": text,
                "max_output_tokens": m,
                **({"instructions": instructions} if instructions else {}),
            },
            TEXT.filter(bool),
            MAX_TOKENS,
            st.one_of(st.none(), TEXT),
        ),
        "chat",
        "/v1/responses",
    ),
    "embeddings": Route(
        st.builds(
            lambda inputs: {"model": "emb", "input": inputs},
            st.lists(TEXT.filter(bool), min_size=1, max_size=3),
        ),
        "embeddings",
        "/v1/embeddings",
    ),
    "batch chat": Route(
        st.builds(
            lambda text, m: {
                "model": "tiny",
                "messages": [{"role": "user", "content": text}],
                "max_tokens": m,
                "ignore_eos": True,
            },
            TEXT,
            MAX_TOKENS,
        ),
        "chat",
        "/v1/chat/completions",
        batch=True,
    ),
}

# A few requests, each sent several times at once (as an attacker would).
REQUESTS = st.lists(
    st.tuples(
        st.sampled_from(sorted(ROUTES)).flatmap(
            lambda name: st.tuples(st.just(name), ROUTES[name].bodies)
        ),
        st.integers(1, 4),
    ),
    min_size=1,
    max_size=4,
).map(lambda drawn: [request for request, times in drawn for _ in range(times)])


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(quota=st.integers(20, 600), requests=REQUESTS)
def test_usage_never_passes_the_quota_by_more_than_one_reservation(
    platform: PlatformProcess, admin: httpx.Client, quota: int, requests: list[tuple[str, dict]]
) -> None:
    t = Tenant(platform, admin, quota=quota)
    interactive = [(n, b) for n, b in requests if not ROUTES[n].batch]
    batched: dict[str, list[dict[str, Any]]] = {}
    for n, b in requests:
        if ROUTES[n].batch:
            batched.setdefault(ROUTES[n].path, []).append(b)
    calls: list[Callable[[], Any]] = [
        lambda n=n, b=b: t.post(ROUTES[n].path, b) for n, b in interactive
    ]
    calls += [lambda p=p, bs=bs: run_batch(t, bs, p) for p, bs in batched.items()]
    results = concurrently(calls)
    served = 0
    for result in results[: len(interactive)]:
        assert result.status_code < 500, result.text
        served += result.status_code == 200
    for done in results[len(interactive) :]:
        assert done.status == "completed", done
        served += done.request_counts.completed
    if not served:
        assert usage_rows(admin, tenant_id=t.id) == []
        return
    billed = t.billed(served)
    assert len(billed) == served
    one = max(reservation_bound(ROUTES[n].kind, b, CAP) for n, b in requests)
    target(sum(billed) - quota - one)  # toward the largest overshoot
    assert sum(billed) <= quota + one, (billed, one)
