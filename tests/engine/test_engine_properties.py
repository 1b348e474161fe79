"""Property tests over the engine's request surface (issue 10): no request takes a model down.

Hypothesis draws requests from the whole input space, far outside the valid ranges (ints past
64 bits, NaN and infinities, token ids outside the vocabulary, empty and over-long prompts,
stop strings of any Unicode including lone surrogates, huge n and max_tokens). Each must
either be refused by admission with an error naming a field, or be answered in full; no step
may fail, and the engine answers a normal request afterwards. Two surfaces:

- in process: `LLMEngine.check_request` (the worker's admission) then `AsyncEngine.generate`;
- over HTTP: a real worker process with a tiny model, raw JSON bodies (httpx).

Runs are derandomized (the same examples every run, as CI needs); set
`MODELYARD_HYPOTHESIS_PROFILE=explore` locally for fresh random examples and more of them.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from modelyard.engine.async_engine import AsyncEngine
from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.request_checks import RequestRejected
from modelyard.engine.sampling_params import SamplingParams
from tests.conftest import WorkerProcess
from tests.parity import make_engine

CAP = 48  # max_tokens cap of the engines under test: keeps answered requests short
IN_PROCESS_EXAMPLES = 200
HTTP_EXAMPLES = 150

_COMMON: dict[str, Any] = {
    "deadline": None,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile("ci", derandomize=True, **_COMMON)
settings.register_profile("explore", derandomize=False, **_COMMON)
PROFILE = settings.get_profile(os.environ.get("MODELYARD_HYPOTHESIS_PROFILE", "ci"))
SCALE = 1 if os.environ.get("MODELYARD_HYPOTHESIS_PROFILE", "ci") == "ci" else 10

# ----- strategies --------------------------------------------------------------------------------
#
# Every field has a plausible strategy (in range, so that a good share of the requests is
# answered and the engine really runs them) and a wild one: the edges of the model's own limits
# (vocabulary, cap, context) most often, else anything of the field's type and more. Each
# example draws a few fields, often none, to be wild.

BIG = 2**70
VOCAB = 384  # tests.tiny_models: the tiny tokenizer's vocabulary


def ids(min_size: int, max_size: int) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, VOCAB - 1), min_size=min_size, max_size=max_size)


def wild_int(edges: list[int]) -> st.SearchStrategy[int]:
    edge = st.sampled_from(edges)
    return st.one_of(edge, edge, st.integers(-BIG, BIG), st.integers(-3, 3))


WILD_FLOAT = st.one_of(
    st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-6, 2.0000001, 1e300, -1.0]),
    st.floats(allow_nan=True, allow_infinity=True),
)

# Any code point, lone surrogates included (st.characters leaves them out unless asked).
ANY_CHAR = st.one_of(
    st.characters(exclude_categories=()),
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
)
WILD_TEXT = st.text(ANY_CHAR, max_size=40) | st.text(ANY_CHAR, min_size=250, max_size=300)
PLAIN_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)
WILD_IDS = st.one_of(
    ids(0, 5).map(lambda found: [*found, VOCAB]),
    st.lists(wild_int([VOCAB, VOCAB + 1, -1, 2**31, -(2**63)]), max_size=30),
)

# field: (plausible, wild)
PARAMS: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]] = {
    "n": (st.integers(1, 3), wild_int([0, -1, 128, 129])),
    "max_tokens": (st.integers(1, 10), wild_int([0, -1, CAP, CAP + 1, 511, 512])),
    "temperature": (st.floats(0.0, 2.0) | st.just(1e-300), WILD_FLOAT),
    "top_p": (st.floats(1e-9, 1.0), WILD_FLOAT),
    "top_k": (st.integers(-1, VOCAB), wild_int([VOCAB + 1, 100_000, VOCAB, VOCAB - 1, -2])),
    "min_p": (st.floats(0.0, 1.0), WILD_FLOAT),
    "presence_penalty": (st.floats(-2.0, 2.0), WILD_FLOAT),
    "frequency_penalty": (st.floats(-2.0, 2.0), WILD_FLOAT),
    "repetition_penalty": (st.floats(0.01, 100.0), WILD_FLOAT),
    "seed": (st.none() | st.integers(-(2**63), 2**63 - 1), wild_int([2**63, -(2**63) - 1])),
    "stop": (
        st.lists(PLAIN_TEXT, max_size=3).map(tuple),
        st.lists(WILD_TEXT, max_size=18).map(tuple),
    ),
    "stop_token_ids": (
        ids(0, 3).map(tuple),
        WILD_IDS.map(tuple) | st.lists(st.integers(0, VOCAB - 1), max_size=300).map(tuple),
    ),
    "ignore_eos": (st.booleans(), st.booleans()),
    "logprobs": (st.none() | st.integers(0, 5), wild_int([20, 21, VOCAB])),
    "skip_special_tokens": (st.booleans(), st.booleans()),
}


# Checked against the model, not a fixed range: three times as likely to be drawn wild.
MODEL_LIMITED = ["top_k", "stop_token_ids", "prompt", "max_tokens", "logprobs", "top_logprobs"]


def draw_fields(
    data: st.DataObject, fields: dict[str, tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]]
) -> dict[str, Any]:
    names = sorted(fields) + [f for f in MODEL_LIMITED if f in fields] * 2
    # A seeded Random chooses uniformly: st.sampled_from favours the first names of a list.
    chooser = data.draw(st.randoms(use_true_random=False), "chooser")
    wild = set(chooser.sample(names, chooser.choice([0, 1, 1, 2])))
    return {
        name: data.draw(pair[1] if name in wild else pair[0], name) for name, pair in fields.items()
    }


REQUEST = {
    **PARAMS,
    "prompt": (ids(1, 40), WILD_IDS | ids(490, 560)),  # max_model_len is 512
    "priority": (st.integers(0, 9), wild_int([10, -1])),
}


# ----- in process: admission, then the engine -----------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[AsyncEngine]:
    async_engine = AsyncEngine(make_engine(tiny_llama, max_tokens_cap=CAP), request_timeout_s=60)
    async_engine.start()
    yield async_engine
    async_engine.shutdown()


def answer(engine: AsyncEngine, prompt: list[int], params: SamplingParams, priority: int) -> dict:
    """Run one request to its end; per choice, its token count and finish reason."""

    async def go() -> dict[int, tuple[int, str | None]]:
        choices: dict[int, tuple[int, str | None]] = {}
        async for out in engine.generate(prompt, params, priority=priority):
            for d in out.deltas:
                count, _ = choices.get(d.index, (0, None))
                reason = d.finish_reason.value if d.finish_reason else None
                choices[d.index] = (count + len(d.token_ids), reason)
        return choices

    return asyncio.run(go())


NORMAL = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@settings(PROFILE, max_examples=IN_PROCESS_EXAMPLES * SCALE)
@given(data=st.data())
def test_every_request_is_refused_by_name_or_answered_in_full(
    engine: AsyncEngine, data: st.DataObject
) -> None:
    core: LLMEngine = engine.engine
    assert core.model_config.vocab_size == VOCAB
    fields = draw_fields(data, REQUEST)
    prompt, priority = fields.pop("prompt"), fields.pop("priority")
    params = SamplingParams(**fields)
    try:
        core.check_request(prompt, params, priority)
    except RequestRejected as exc:
        assert exc.param and str(exc), exc  # a clear refusal, naming the field
        event(f"refused: {exc.param}")
    else:
        event("answered")
        choices = answer(engine, prompt, params, priority)
        assert sorted(choices) == list(range(params.n))
        for count, reason in choices.values():
            assert reason in ("stop", "length") and count <= params.max_tokens
    assert core.stats.failed_steps == 0 and engine.healthy
    assert answer(engine, [5, 6, 7], NORMAL, 0) == {0: (3, "length")}
    assert core.kv.pool.num_free == core.kv.num_blocks


# ----- over HTTP: a real worker process -----------------------------------------------------------


@pytest.fixture(scope="module")
def worker(tiny_llama: Path) -> Iterator[WorkerProcess]:
    process = WorkerProcess(str(tiny_llama), {"MODELYARD_MAX_TOKENS_CAP": str(CAP)})
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


WILD_NUMBER = st.one_of(
    st.integers(-BIG, BIG), st.floats(allow_nan=False, allow_infinity=False), st.integers(-3, 60)
)
WILD_JSON = st.one_of(WILD_NUMBER, WILD_TEXT, st.none(), st.booleans(), st.lists(st.integers()))
PLAIN_MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": PLAIN_TEXT}
)
WILD_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "wizard"]),
        "content": st.one_of(
            WILD_TEXT,
            st.none(),
            st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": WILD_TEXT})),
            st.integers(),
        ),
    },
    optional={"name": WILD_TEXT | st.integers()},
)


def api(
    plausible: st.SearchStrategy[Any], wild: st.SearchStrategy[Any] = WILD_JSON
) -> tuple[st.SearchStrategy[Any], st.SearchStrategy[Any]]:
    return plausible, wild | WILD_JSON


# The API's fields, as JSON (absent is a value too: a field drawn as None is left out).
COMMON_FIELDS = {
    "n": api(st.integers(1, 3), wild_int([0, 128, 129])),
    "max_tokens": api(st.none() | st.integers(1, 8), wild_int([0, CAP, CAP + 1, 512])),
    "temperature": api(st.none() | st.floats(0, 2), WILD_FLOAT.filter(lambda f: f == f)),
    "top_p": api(st.none() | st.floats(1e-9, 1)),
    "top_k": api(st.none() | st.integers(-1, VOCAB), wild_int([VOCAB + 1, 100_000, -2])),
    "min_p": api(st.none() | st.floats(0, 1)),
    "presence_penalty": api(st.none() | st.floats(-2, 2)),
    "frequency_penalty": api(st.none() | st.floats(-2, 2)),
    "repetition_penalty": api(st.none() | st.floats(0.1, 3)),
    "seed": api(st.none() | st.integers(0, 2**63 - 1), wild_int([2**63, -(2**63) - 1])),
    "stop": api(st.none() | PLAIN_TEXT | st.lists(PLAIN_TEXT, max_size=3), st.lists(WILD_TEXT)),
    "stop_token_ids": api(st.none() | ids(0, 3), WILD_IDS),
    "priority": api(st.none() | st.integers(0, 9), wild_int([10, -1])),
    "stream": api(st.booleans()),
    "stream_options": api(st.none() | st.fixed_dictionaries({"include_usage": st.booleans()})),
    "ignore_eos": api(st.none() | st.booleans()),
    "logit_bias": api(st.none(), st.dictionaries(st.sampled_from(["1", "x"]), WILD_NUMBER)),
    "user": api(st.none() | PLAIN_TEXT, WILD_TEXT),
}
CHAT_FIELDS = {
    **COMMON_FIELDS,
    "messages": api(st.lists(PLAIN_MESSAGE, min_size=1, max_size=3), st.lists(WILD_MESSAGE)),
    "max_completion_tokens": api(st.none() | st.integers(1, 8)),
    "logprobs": api(st.none() | st.booleans()),
    "top_logprobs": api(st.none() | st.integers(0, 5), wild_int([20, 21])),
}
TEXT_FIELDS = {
    **COMMON_FIELDS,
    "prompt": api(
        st.one_of(
            PLAIN_TEXT,
            st.lists(PLAIN_TEXT, min_size=1, max_size=3),
            ids(1, 20),
            st.lists(ids(1, 8), min_size=1, max_size=3),
        ),
        st.one_of(
            st.lists(WILD_TEXT, max_size=3),
            WILD_IDS,
            st.lists(WILD_IDS, max_size=3),
            st.lists(ids(1, 2), max_size=70),
            st.lists(st.integers(0, VOCAB - 1), min_size=505, max_size=520),
        ),
    ),
    "logprobs": api(st.none() | st.integers(0, 5), wild_int([20, 21])),
    "echo": api(st.none() | st.just(False), st.booleans()),
}


def check_response(r: httpx.Response, body: dict[str, Any]) -> None:
    assert r.status_code in (200, 400), (r.status_code, r.text)
    if r.status_code == 400:
        error = r.json()["error"]
        event(f"refused: {str(error['param']).split('.')[0]}")
        assert error["type"] == "invalid_request_error" and error["message"], error
        return
    event("answered")
    if not body.get("stream"):
        reply = r.json()
        assert reply["choices"] and reply["usage"]["completion_tokens"] >= 0
        return
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    usage = [c for c in chunks if c.get("usage")]
    wants = bool((body.get("stream_options") or {}).get("include_usage"))
    assert usage == ([chunks[-1]] if wants else []) and (not usage or chunks[-1]["choices"] == [])


@settings(PROFILE, max_examples=HTTP_EXAMPLES * SCALE)
@given(route=st.sampled_from(["chat", "text"]), data=st.data())
def test_every_http_request_is_a_400_or_an_answer(
    worker: WorkerProcess, tiny_llama: Path, route: str, data: st.DataObject
) -> None:
    fields = draw_fields(data, CHAT_FIELDS if route == "chat" else TEXT_FIELDS)
    body = {name: value for name, value in fields.items() if value is not None}
    body["model"] = tiny_llama.name
    path = "chat/completions" if route == "chat" else "completions"
    # json.dumps escapes lone surrogates (valid JSON); httpx's own encoder would refuse them.
    raw = json.dumps(body).encode()
    r = httpx.post(
        f"{worker.url}/v1/{path}",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    check_response(r, body)


def test_the_worker_is_healthy_after_the_fuzzing(worker: WorkerProcess) -> None:
    # Runs after the HTTP property (file order): no step failed, and it still answers.
    health = httpx.get(f"{worker.url}/health").json()
    assert health["status"] == "ok" and health["failed_steps"] == 0
    body = {"model": health["model"], "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    r = httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
