"""Tool calling on chat completions: a real SmolLM2 worker driven by the `openai` SDK and by
LangChain, plus the prompt rendering and the output parsers on their own.

SmolLM2's chat template renders no tools, so the server's default (Hermes-style) tool prompt is
used; `required` and named choices are constrained by the grammar of the tools' parameter
schemas, so their calls always parse and validate, at temperature 1 too.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from modelyard.engine.models.loader import read_model_config
from modelyard.engine.tokenizer import Tokenizer
from modelyard.protocol.openai import ChatCompletionRequest
from modelyard.worker.tool_parsers import HermesParser, Llama3JsonParser, parser_for
from modelyard.worker.tool_prompt import template_messages
from modelyard.worker.tool_stream import (
    CallArgs,
    CallDone,
    CallHead,
    Content,
    Finished,
    StreamDecoder,
)
from modelyard.worker.tools import decode, plan_tools
from tests.agent_fixtures import ADD, MODEL, WEATHER, sdk_client, user
from tests.conftest import WorkerProcess

TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = [
    "What is the weather like in Paris today?",
    "Please add 17 and 25.",
    "Is it cold in Oslo? Use fahrenheit.",
]


@pytest.fixture(scope="module")
def client(smollm2_worker: WorkerProcess) -> openai.OpenAI:
    return sdk_client(smollm2_worker)


@pytest.fixture(scope="module")
def url(smollm2_worker: WorkerProcess) -> str:
    return smollm2_worker.url


def assert_valid_calls(message: Any, names: set[str]) -> list[Any]:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return list(message.tool_calls)


def test_required_and_named_choices_always_give_valid_calls(smollm2_worker: WorkerProcess) -> None:
    """Every prompt x {required, named} x temperature {0, 1}: twelve requests sent at once
    (the engine batches them), each a valid call of an offered tool."""
    aclient = openai.AsyncOpenAI(
        base_url=f"{smollm2_worker.url}/v1", api_key="unused", max_retries=0
    )
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def one(i: int, choice: Any, temperature: float) -> tuple[Any, Any]:
        r = await aclient.chat.completions.create(
            model=MODEL, messages=user(PROMPTS[i]), tools=TOOLS, tool_choice=choice,
            temperature=temperature, seed=i, max_tokens=120,
        )  # fmt: skip
        return choice, r.choices[0]

    async def all_of_them() -> list[tuple[Any, Any]]:
        try:
            return await asyncio.gather(
                *(one(i, c, t) for i in range(len(PROMPTS)) for c in ("required", named)
                  for t in (0.0, 1.0))
            )  # fmt: skip
        finally:
            await aclient.close()

    answers = asyncio.run(all_of_them())
    assert len(answers) == 12
    for choice, answer in answers:
        assert answer.finish_reason == "tool_calls" and answer.message.content is None
        if choice == "required":
            assert_valid_calls(answer.message, {"get_weather", "add"})
        else:
            assert len(assert_valid_calls(answer.message, {"get_weather"})) == 1


def test_parallel_tool_calls_false_gives_one_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=user("Weather in Paris and in Rome?"), tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=100,
    )  # fmt: skip
    assert len(assert_valid_calls(r.choices[0].message, {"get_weather", "add"})) == 1


def test_two_turn_loop_with_the_sdk(client: openai.OpenAI) -> None:
    messages: list[Any] = user("What is the weather in Paris?")
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=100,
    )  # fmt: skip
    message = first.choices[0].message
    (call,) = assert_valid_calls(message, {"get_weather", "add"})[:1]
    # The SDK's own message object goes back into the history (content null, tool_calls).
    messages.append(message)
    result = json.dumps({"temperature": 21, "sky": "sunny"})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", temperature=0,
        max_tokens=40,
    )  # fmt: skip
    answer = second.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")
    # The call and its result were rendered into the prompt, not dropped.
    alone = client.chat.completions.create(
        model=MODEL, messages=messages[:1], tools=TOOLS, tool_choice="none", max_tokens=1
    )
    assert second.usage.prompt_tokens > alone.usage.prompt_tokens + 30


def test_streamed_tool_call_deltas_reassemble_to_the_unstreamed_call(
    client: openai.OpenAI,
) -> None:
    """Arguments stream as they decode (several fragments for a two-field call, the first
    before the call's object is complete), and join into the unstreamed call's arguments."""
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        kwargs: Any = dict(
            model=MODEL, messages=user("Add 2 and 3."), tools=TOOLS, tool_choice=choice,
            temperature=0, max_tokens=80,
        )  # fmt: skip
        whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
        calls: dict[int, dict[str, Any]] = {}
        finish = None
        fragments = 0
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            if not chunk.choices:
                continue
            finish = chunk.choices[0].finish_reason or finish
            for tc in chunk.choices[0].delta.tool_calls or []:
                if tc.id:  # the first delta of a call names it
                    assert tc.type == "function" and tc.function.name
                    assert tc.function.arguments == ""
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                    continue
                assert tc.function.arguments
                fragments += 1
                if fragments == 1:  # the object is still open when its first piece goes out
                    assert not tc.function.arguments.rstrip().endswith("}")
                calls[tc.index]["arguments"] += tc.function.arguments
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (c.function.name, c.function.arguments) for c in whole
        ]
        assert fragments > 1, choice


def test_auto_streams_content_when_the_model_answers_in_text(client: openai.OpenAI) -> None:
    kwargs: Any = dict(
        model=MODEL, messages=user("Say hello."), tools=TOOLS, temperature=0, max_tokens=20
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    if whole.message.tool_calls:  # the model may call a tool on its own: then no text
        assert whole.finish_reason == "tool_calls"
    else:
        assert text == whole.message.content


def test_legacy_functions_map_onto_tools(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=user("Add 1 and 2"), functions=[ADD["function"]],
        function_call={"name": "add"}, temperature=0, max_tokens=60,
    )  # fmt: skip
    choice = r.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.function_call
    assert choice.message.function_call.name == "add"
    jsonschema.validate(json.loads(choice.message.function_call.arguments), SCHEMAS["add"])
    # A legacy `function` result in the history is accepted and rendered.
    history = [
        *user("Add 1 and 2"),
        {"role": "assistant", "content": None, "function_call": {"name": "add",
                                                                  "arguments": '{"a":1,"b":2}'}},
        {"role": "function", "name": "add", "content": "3"},
    ]  # fmt: skip
    r = client.chat.completions.create(model=MODEL, messages=history, max_tokens=10)
    assert r.choices[0].message.content is not None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"functions": [ADD["function"]]}, "functions"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools[0].function.name"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
    ],
)  # fmt: skip
def test_impossible_tool_requests_are_refused_by_name(
    url: str, body: dict[str, Any], param: str
) -> None:
    payload = {"model": MODEL, "messages": user("hi"), "tools": TOOLS, "max_tokens": 5, **body}
    r = httpx.post(f"{url}/v1/chat/completions", json=payload, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ----- LangChain -------------------------------------------------------------------------------


def test_langchain_bind_tools_loop_and_structured_output(url: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=f"{url}/v1", api_key="unused", temperature=0, max_tokens=80,
        max_retries=0,
    )  # fmt: skip

    class Weather(BaseModel):
        """Get the current weather in a city."""

        city: str = Field(max_length=24)
        unit: str = Field(json_schema_extra={"enum": ["celsius", "fahrenheit"]})

    bound = llm.bind_tools([Weather], tool_choice="required")
    history: list[Any] = [HumanMessage("What is the weather in Paris?")]
    ai = bound.invoke(history)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "Weather"
    Weather.model_validate(ai.tool_calls[0]["args"])
    history += [ai, ToolMessage("21 degrees, sunny", tool_call_id=ai.tool_calls[0]["id"])]
    answer = llm.bind_tools([Weather]).invoke(history)
    assert answer.content or answer.tool_calls

    structured = llm.with_structured_output(Weather, method="function_calling")
    result = structured.invoke("The weather in Rome, in celsius please.")
    assert isinstance(result, Weather)


# ----- rendering and parsing, no worker --------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(smollm2_folder: Path) -> Tokenizer:
    return Tokenizer.load(smollm2_folder, read_model_config(smollm2_folder))


def _request(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, **body})


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 and sunny"},
]  # fmt: skip


def test_default_tool_prompt_renders_tools_and_history(tokenizer: Tokenizer) -> None:
    assert not tokenizer.template_supports_tools  # SmolLM2: the default prompt is used
    req = _request(messages=HISTORY, tools=TOOLS)
    plan = plan_tools(req)
    messages, tools = template_messages(req.messages, plan, renders_tools=False)
    prompt = tokenizer.render_chat(messages, tools=tools)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and '"name": "add"' in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in prompt
    assert '<tool_response>\n{"name": "get_weather", "content": "21 and sunny"}' in prompt


def test_a_template_that_renders_tools_gets_them_natively(tokenizer: Tokenizer) -> None:
    template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }} "
        "{{ c.function.arguments.city }}{% endfor %}"
        "{% if m.tool_call_id %} RESULT OF {{ m.name }}{% endif %}\n{% endfor %}"
    )
    native = Tokenizer(tokenizer.backend, tokenizer.eos_token_ids, template, {})
    assert native.template_supports_tools
    req = _request(messages=HISTORY, tools=TOOLS)
    messages, tools = template_messages(req.messages, plan_tools(req), renders_tools=True)
    prompt = native.render_chat(messages, tools=tools)
    assert "TOOL get_weather\nTOOL add\n" in prompt
    assert "CALL get_weather Paris" in prompt and "RESULT OF get_weather" in prompt
    assert parser_for("llama", "<|python_tag|> tools", True).name == "llama3_json"
    assert parser_for("qwen2", "<tool_call> tools", True).name == "hermes"
    assert parser_for("llama", None, False).name == "hermes"


def test_hermes_parser() -> None:
    p = HermesParser()
    names = {"add", "get_weather"}
    out = p.parse('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                  '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": '
                  '"{\\"city\\": \\"Oslo\\"}"}</tool_call>', names)  # fmt: skip
    assert out.content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"}),
    ]  # fmt: skip
    # Not a call: an unknown function, broken JSON; the text stays the answer.
    for text in ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "<tool_call>{"):
        assert p.parse(text, names).calls == [] and p.parse(text, names).content == text
    # Streams hold back only what may start a call.
    assert p.content_end("Hello <tool") == len("Hello")
    assert p.content_end("Hello <b>") == len("Hello <b>")
    assert p.content_end("Hi\n<tool_call>{") == len("Hi")


def _stream(choice: Any, text: str, parser: Any = None, **body: Any) -> tuple[list[Any], Any]:
    """`text` fed to a StreamDecoder three characters at a time: its events, and the
    unstreamed answer (`decode`) of the same text."""
    req = _request(messages=user("x"), tools=TOOLS, tool_choice=choice, **body)
    plan, parser = plan_tools(req), parser or HermesParser()
    decoder = StreamDecoder(plan, parser)
    events = [e for i in range(0, len(text), 3) for e in decoder.feed(text[i : i + 3])]
    return events + decoder.finish("stop"), decode(plan, parser, text)


def _joined(events: list[Any]) -> tuple[str, list[tuple[str, str]], int]:
    content, calls, fragments = "", {}, 0
    for e in events:
        if isinstance(e, Content):
            content += e.text
        elif isinstance(e, CallHead):
            calls[e.call] = [e.name, ""]
        elif isinstance(e, CallArgs):
            calls[e.call][1] += e.text
            fragments += 1
    return content, [(n, a) for n, a in calls.values()], fragments


@pytest.mark.parametrize(
    ("choice", "text", "parser"),
    [
        ("required", '[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                     '{"name": "get_weather", "arguments": {"city": "a\\"}b", "unit": "celsius"}}]',
         None),
        ({"type": "function", "function": {"name": "add"}}, '{"a": 10, "b": 22}', None),
        ("auto", 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                 '</tool_call>', None),
        ("auto", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                 '{"name": "add", "parameters": {"a": 3, "b": 4}}', Llama3JsonParser()),
    ],
)  # fmt: skip
def test_stream_decoder_sends_arguments_as_they_decode(choice: Any, text: str, parser: Any) -> None:
    events, whole = _stream(choice, text, parser)
    content, calls, fragments = _joined(events)
    assert calls == [(c.name, c.arguments) for c in whole.calls] and calls
    assert content == (whole.content or "")
    assert fragments > len(calls)  # not one piece per call at the end
    # Each call's head comes before its first fragment, and the first fragment before the end.
    first_args = next(i for i, e in enumerate(events) if isinstance(e, CallArgs))
    assert isinstance(events[first_args - 1], CallHead | CallArgs | Content)
    assert [type(e) for e in events[-2:]] == [CallDone, Finished]
    assert events[-1].reason == "tool_calls"


def test_stream_decoder_edge_cases() -> None:
    # A call to a function not offered is text, as unstreamed; no call is opened.
    text = '<tool_call>{"name": "nope", "arguments": {"a": 1}}</tool_call>'
    events, whole = _stream("auto", text)
    assert _joined(events) == (text, [], 0) and whole.content == text
    # Cut by max_tokens mid-call: the fragments sent so far, no content, finish as the engine's.
    events, whole = _stream("required", '[{"name": "add", "arguments": {"a": 1, "b"')
    assert _joined(events)[:2] == ("", [("add", '{"a": 1, "b"')]) and not whole.calls
    assert isinstance(events[-2], CallDone) and not events[-2].complete
    assert events[-1].reason == "stop"
    # Arguments written as JSON text are not streamed as they come: sent whole at the end.
    events, whole = _stream(
        "auto", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    assert _joined(events)[1] == [("add", '{"a": 1}')]
    # parallel_tool_calls=false: one call only, streamed too.
    two = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call><tool_call>{"name": '
    events, whole = _stream("auto", two + '"add", "arguments": {"a": 2}}</tool_call>',
                            parallel_tool_calls=False)  # fmt: skip
    assert (
        _joined(events)[1] == [("add", '{"a": 1}')] == [(c.name, c.arguments) for c in whole.calls]
    )


def test_llama3_json_parser() -> None:
    p = Llama3JsonParser()
    out = p.parse('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                  '{"name": "add", "parameters": {"a": 3, "b": 4}}', {"add"})  # fmt: skip
    assert out.content is None and [json.loads(c.arguments)["a"] for c in out.calls] == [1, 3]
    assert p.parse("The answer is 3.", {"add"}).content == "The answer is 3."
    assert p.content_end("  {") == 0 and p.content_end("The") == 3
