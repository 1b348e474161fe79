"""Reasoning models: the thinking as `reasoning_content`, the answer as `content`.

The splitter on its own, at every split point of its input; the thinking tokens counted; the
constraint held back until the thinking ends, in the engine; and a worker serving a tiny Qwen3
with Qwen3's real chat template, rigged to think one word and answer another
(`tests/tiny_reasoning.py`), over chat (whole and streamed) and the Responses API.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from modelyard.engine.llm_engine import LLMEngine
from modelyard.engine.models.loader import read_model_config
from modelyard.engine.sampling_params import SamplingParams
from modelyard.engine.structured import StructuredKind, StructuredOutput, ThinkingGate
from modelyard.engine.tokenizer import Tokenizer
from modelyard.worker.reasoning import (
    ReasoningFormat,
    ReasoningSplitter,
    ReasoningTokens,
    ThinkMode,
    reasoning_format,
    split_reasoning,
)
from tests.conftest import WorkerProcess
from tests.parity import make_engine
from tests.tiny_reasoning import build_reasoning_model, rigged_words

TEXTS = [
    "<think>\nLet me see.\n</think>\n\nThe answer.",
    "<think>a</think>b",
    "<think></think>",
    "<think>\n\n</think>\n\nNo thinking here",
    "Just an answer <think>not thinking</think>",
    "thinking with no end\n",
    "<thi",
    "<think>cut short </thi",
    "x</think> y </think> z",
    "",
    "  <think>leading space</think>",
]


def streamed(text: str, mode: ThinkMode, cuts: list[int]) -> tuple[str, str]:
    splitter = ReasoningSplitter(mode)
    thinking = answer = ""
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        t, c = splitter.feed(text[a:b])
        thinking, answer = thinking + t, answer + c
    t, c = splitter.finish()
    return thinking + t, answer + c


@pytest.mark.parametrize("mode", list(ThinkMode))
def test_a_stream_splits_as_the_whole_text_at_every_split_point(mode: ThinkMode) -> None:
    for text in TEXTS:
        whole = split_reasoning(text, mode)
        expected = (whole[0] or "", whole[1])
        for i in range(len(text) + 1):
            assert streamed(text, mode, [i]) == expected, (text, i)
            for j in range(i, len(text) + 1):
                assert streamed(text, mode, [i, j]) == expected, (text, i, j)
        assert streamed(text, mode, list(range(1, len(text)))) == expected  # char by char


def test_what_is_thinking_and_what_is_the_answer() -> None:
    may, inside, off = ThinkMode.MAY, ThinkMode.INSIDE, ThinkMode.OFF
    assert split_reasoning(TEXTS[0], may) == ("Let me see.", "The answer.")
    assert split_reasoning(TEXTS[3], may) == (None, "No thinking here")
    assert split_reasoning(TEXTS[4], may) == (None, TEXTS[4])  # tags only count first
    assert split_reasoning("<thi", may) == (None, "<thi")
    assert split_reasoning("<think>cut short </thi", may) == ("cut short </thi", "")
    # The prompt opened the thinking (DeepSeek-R1 distills): all is thinking until `</think>`.
    assert split_reasoning("Hmm.\n</think>\n\nYes.", inside) == ("Hmm.", "Yes.")
    assert split_reasoning("thinking with no end\n", inside) == ("thinking with no end", "")
    assert split_reasoning("x</think> y </think> z", inside) == ("x", "y </think> z")
    # The prompt closed it (enable_thinking: false): everything is the answer, as written.
    assert split_reasoning(TEXTS[0], off) == (None, TEXTS[0])


def test_thinking_tokens_are_counted_by_id() -> None:
    fmt = ReasoningFormat(start_id=1, end_id=2)
    tokens = ReasoningTokens(fmt, ThinkMode.MAY)
    tokens.add((0, 0), [1, 7, 8])
    tokens.add((0, 0), [9, 2, 5, 6])  # <think> 7 8 9 </think>: five
    tokens.add((0, 1), [5, 1, 2])  # answered at once: none
    assert tokens.total == 5
    inside = ReasoningTokens(fmt, ThinkMode.INSIDE)
    inside.add((0, 0), [7, 8, 2, 9])
    inside.add((1, 0), [7, 8])  # never ended: all of it
    assert inside.total == 5
    off = ReasoningTokens(fmt, ThinkMode.OFF)
    off.add((0, 0), [1, 7, 2])
    assert off.total == 0


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_reasoning_model(tmp_path_factory.mktemp("qwen3-thinking"))


@pytest.fixture(scope="module")
def words(folder: Path) -> tuple[str, str]:
    from transformers import AutoTokenizer

    return rigged_words(AutoTokenizer.from_pretrained(str(folder)))


def test_the_qwen3_template_says_where_the_output_starts(folder: Path) -> None:
    tokenizer = Tokenizer.load(folder, read_model_config(folder))
    fmt = reasoning_format(tokenizer)
    assert fmt is not None and fmt.end_id == tokenizer.token_id("</think>")
    messages = [{"role": "user", "content": "Hi"}]
    assert fmt.mode(tokenizer.render_chat(messages)) is ThinkMode.MAY
    off = tokenizer.render_chat(messages, variables={"enable_thinking": False})
    assert fmt.mode(off) is ThinkMode.OFF
    # The template's own variables are never replaced by a request's.
    same = tokenizer.render_chat(messages, variables={"messages": [], "enable_thinking": True})
    assert same == tokenizer.render_chat(messages)
    assert fmt.mode(tokenizer.render_chat(messages) + "<think>\n") is ThinkMode.INSIDE
    # A model without the tags does not reason.
    plain = Tokenizer(tokenizer.backend, tokenizer.eos_token_ids, "{{ messages }}", {})
    assert reasoning_format(plain) is None


@pytest.fixture(scope="module")
def engine(folder: Path) -> LLMEngine:
    return make_engine(folder, max_tokens_cap=64)


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> str:
    engine.add_request("r", prompt, params)
    text = ""
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None, out.error
            text += "".join(d.text for d in out.deltas)
    return text


def test_the_constraint_starts_after_the_thinking(engine: LLMEngine, words: list[str]) -> None:
    tok = engine.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Hi"}])
    start, end = tok.token_id("<think>"), tok.token_id("</think>")
    assert start is not None and end is not None
    choice = StructuredOutput(StructuredKind.CHOICE, json.dumps(["yes", "no"]))
    free = run(engine, prompt, SamplingParams(max_tokens=16, temperature=0.0))
    assert free == f"<think>{words[0]}</think>{words[1]}"
    # The model may open its thinking with its first token; the answer is the grammar's.
    gated = StructuredOutput(choice.kind, choice.spec, gate=ThinkingGate(end, start))
    text = run(engine, prompt, SamplingParams(max_tokens=16, temperature=0.0, structured=gated))
    assert text in (f"<think>{words[0]}</think>yes", f"<think>{words[0]}</think>no")
    # The prompt opened the thinking (DeepSeek-R1's way): unconstrained until `</think>`.
    inside = StructuredOutput(choice.kind, choice.spec, gate=ThinkingGate(end))
    params = SamplingParams(max_tokens=16, temperature=0.0, structured=inside)
    assert run(engine, [*prompt, start], params) in (
        f"{words[0]}</think>yes",
        f"{words[0]}</think>no",
    )
    # Without a gate the grammar holds from the first token: no thinking at all.
    assert run(
        engine, prompt, SamplingParams(max_tokens=16, temperature=0.0, structured=choice)
    ) in ("yes", "no")


# ----- a worker ----------------------------------------------------------------------------------

WORKER_ENV = {"MODELYARD_DTYPE": "float32", "MODELYARD_KV_CACHE_MEMORY": "16MiB",
              "MODELYARD_MAX_TOKENS_CAP": "256"}  # fmt: skip


@pytest.fixture(scope="module")
def worker(folder: Path) -> Iterator[WorkerProcess]:
    process = WorkerProcess(str(folder), WORKER_ENV)
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def chat(worker: WorkerProcess, **body: Any) -> dict[str, Any]:
    model = httpx.get(f"{worker.url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], **body}
    r = httpx.post(f"{worker.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return dict(r.json())


def sse(worker: WorkerProcess, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    body = {"model": httpx.get(f"{worker.url}/v1/models").json()["data"][0]["id"], **body}
    with httpx.stream("POST", f"{worker.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]


def test_chat_answers_the_thinking_apart(worker: WorkerProcess, words: list[str]) -> None:
    r = chat(worker, max_tokens=16, temperature=0)
    msg, usage = r["choices"][0]["message"], r["usage"]
    assert (msg["reasoning_content"], msg["content"]) == (words[0], words[1])
    # <think> word </think> word <|im_end|>: five tokens, three of them thinking.
    assert usage["completion_tokens"] == 5
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 3}
    # max_tokens counts the thinking: cut inside it, there is no answer.
    cut = chat(worker, max_tokens=2, temperature=0)
    assert cut["choices"][0]["finish_reason"] == "length"
    assert cut["choices"][0]["message"]["reasoning_content"] == words[0]
    assert cut["choices"][0]["message"]["content"] == ""
    assert cut["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
    # Thinking turned off through the template: the prompt closed it, all is the answer.
    off = chat(worker, max_tokens=4, temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert off["choices"][0]["message"]["reasoning_content"] is None
    assert off["usage"]["prompt_tokens"] > usage["prompt_tokens"]
    assert off["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_chat_streams_the_thinking_then_the_answer(worker: WorkerProcess, words: list[str]) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = sse(worker, "/v1/chat/completions", body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    kinds = [k for d in deltas for k in d if k in ("reasoning_content", "content") and d[k]]
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # thinking first
    assert "".join(d.get("reasoning_content", "") for d in deltas) == words[0]
    assert "".join(d.get("content") or "" for d in deltas) == words[1]
    assert chunks[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}


def test_structured_outputs_and_tool_calls_apply_to_the_answer(
    worker: WorkerProcess, words: list[str]
) -> None:
    r = chat(worker, max_tokens=16, temperature=0, guided_choice=["yes", "no"])
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == words[0] and msg["content"] in ("yes", "no")
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["c", "f"]}},
                "required": ["unit"],
            },
        },
    }
    r = chat(worker, max_tokens=32, temperature=0, tools=[tool],
             tool_choice={"type": "function", "function": {"name": "get_weather"}})  # fmt: skip
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == words[0]
    call = msg["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"])["unit"] in ("c", "f")


def test_responses_api_gives_a_reasoning_item(worker: WorkerProcess, words: list[str]) -> None:
    model = httpx.get(f"{worker.url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "input": "Hi", "max_output_tokens": 16, "temperature": 0}
    r = httpx.post(f"{worker.url}/v1/responses", json=body, timeout=60).json()
    reasoning, message = r["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": words[0]}]
    assert message["content"][0]["text"] == words[1]
    assert r["usage"]["output_tokens"] == 5
    assert r["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
    events = sse(worker, "/v1/responses", {"input": "Hi", "max_output_tokens": 16,
                                           "temperature": 0, "stream": True})  # fmt: skip
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert thought == words[0]
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": words[0]}]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}
