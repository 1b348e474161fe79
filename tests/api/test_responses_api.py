"""The Responses API (`POST /v1/responses`, stateless): a real SmolLM2 worker driven by the
`openai` SDK's `client.responses` and LangChain's `use_responses_api=True`; then through the
platform's gateway (a tiny random model, in both store modes): responses, tool calls and
response_format are routed and metered like chat, a responses stream is billed from its final
`response.completed` usage, a schema that does not compile is a 400 naming response_format,
a batch line may carry tools, response_format and guided_choice, and LangChain pointed at
`modelyard serve` gets tool calls (`bind_tools`), structured output (`with_structured_output`,
all three methods) and `use_responses_api=True`, each metered.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest

from tests.agent_fixtures import MODEL, WEATHER, response_format, responses_tool, sdk_client
from tests.conftest import WorkerProcess
from tests.platform_harness import (
    PlatformProcess,
    batch_line,
    create_key,
    create_tenant,
    deploy,
    jsonl,
    read_jsonl,
    tiny_models_env,
    wait_batch,
    wait_request_ids,
)
from tests.tiny_models import build_model

FRANCE = "What is the capital of France?"
WEATHER_TOOL = responses_tool(WEATHER)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(smollm2_worker: WorkerProcess) -> openai.OpenAI:
    return sdk_client(smollm2_worker)


@pytest.fixture(scope="module")
def url(smollm2_worker: WorkerProcess) -> str:
    return smollm2_worker.url


def test_plain_response_with_usage(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input=FRANCE, max_output_tokens=30, temperature=0)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert "Paris" in r.output_text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"
    assert r.usage.input_tokens > 10 and 0 < r.usage.output_tokens <= 30
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    told = client.responses.create(
        model=MODEL, input=FRANCE, instructions="Answer in one short sentence.",
        max_output_tokens=1,
    )  # fmt: skip
    # The instructions are the system message (SmolLM2's template has a default one otherwise).
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=1, messages=[
            {"role": "system", "content": "Answer in one short sentence."},
            {"role": "user", "content": FRANCE},
        ],
    )  # fmt: skip
    assert told.usage.input_tokens == chat.usage.prompt_tokens
    cut = client.responses.create(model=MODEL, input=FRANCE, max_output_tokens=2)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_stream_sends_typed_events_that_add_up_to_the_response(client: openai.OpenAI) -> None:
    kwargs: Any = dict(model=MODEL, input=FRANCE, max_output_tokens=30, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert types[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens
    # The SDK's stream helper assembles the same final response.
    with client.responses.stream(**kwargs) as stream:
        assert stream.get_final_response().output_text == text


def test_function_tool_loop(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=80, temperature=0,
    )  # fmt: skip
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_TOOL["parameters"])
    streamed = client.responses.create(
        model=MODEL, input=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL], tool_choice="required", max_output_tokens=80, temperature=0,
        stream=True,
    )  # fmt: skip
    events = list(streamed)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    assert len(deltas) > 1  # streamed as the arguments decode, not whole at the end
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [(d.item.name, d.item.arguments, d.item.status) for d in done] == [
        (call.name, call.arguments, "completed")
    ]
    second = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name,
             "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id,
             "output": '{"temperature": 21}'},
        ],
        tools=[WEATHER_TOOL], tool_choice="none", max_output_tokens=30, temperature=0,
    )  # fmt: skip
    assert second.output_text and second.usage.input_tokens > first.usage.input_tokens - 200


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    for temperature in (0.0, 1.0):
        r = client.responses.create(
            model=MODEL, input="Invent a person.", max_output_tokens=60, temperature=temperature,
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                             "strict": True}},
        )  # fmt: skip
        jsonschema.validate(json.loads(r.output_text), PERSON)


def test_langchain_use_responses_api(url: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=f"{url}/v1", api_key="unused", temperature=0, max_tokens=20,
        use_responses_api=True, max_retries=0,
    )  # fmt: skip
    message = llm.invoke(FRANCE)
    assert "Paris" in message.text
    assert message.usage_metadata and message.usage_metadata["output_tokens"] > 0


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"metadata": {"a": "b"}}, "metadata"),
    ],
)
def test_state_and_unsupported_features_are_refused_by_name(
    url: str, extra: dict[str, Any], param: str
) -> None:
    r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_refusals_name_the_responses_fields(url: str) -> None:
    """A request the chat path refuses names the Responses API's field, not chat's."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 10**6}
    r = httpx.post(f"{url}/v1/responses", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_output_tokens", r.text
    r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi " * 10_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    bad = {"format": {"type": "json_schema", "name": "bad", "schema": {"type": "objekt"}}}
    r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi", "text": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text
    assert "objekt" in r.json()["error"]["message"]


def test_builtin_tools_and_unknown_arguments_are_refused(url: str) -> None:
    body = {"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}
    r = httpx.post(f"{url}/v1/responses", json=body)
    assert r.status_code == 400 and "web_search" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": "hi", "bogus": 1})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "Unrecognized request argument supplied: bogus"
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
    r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, "input": image})
    assert r.status_code == 400 and "input_image" in r.json()["error"]["message"]


# ----- through the gateway ---------------------------------------------------------------------

TINY = "tiny"
# Enums and booleans only: a random model under a grammar must still end its output quickly.
CHOICE_TOOL = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
            "required": ["color", "ok"],
        },
    },
}
FLAG = {
    "type": "object",
    "properties": {"flag": {"type": "boolean"}},
    "required": ["flag"],
    "additionalProperties": False,
}


# A compact template that renders tools itself (the tiny model's 512-token context has no room
# for the default tool prompt): tools reach it as transformers passes them.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}"
    "{% endfor %}<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>"
    "{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def gateway(
    platform_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory, cache_dir: Path
) -> Iterator[tuple[PlatformProcess, openai.OpenAI, httpx.Client]]:
    """Both store modes: everything through it is metered, and batches run on its store."""
    models_dir = tmp_path_factory.mktemp("responses-models")
    build_model(models_dir / TINY, "llama")
    settings_file = models_dir / TINY / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    settings_file.write_text(json.dumps({**settings, "chat_template": TOOLS_TEMPLATE}))
    env = {
        **platform_env,
        **tiny_models_env(models_dir),
        "MODELYARD_BATCH_POLL_INTERVAL_S": "0.2",
    }
    p = PlatformProcess(tmp_path_factory.mktemp("responses-data"), env).start()
    try:
        admin = p.api()
        deploy(admin, TINY, str(models_dir / TINY), public=True)
        tenant = create_tenant(admin, f"responses-{time.time_ns()}")
        admin_key = create_key(admin, tenant, scopes=["admin", "inference"])["key"]
        key = create_key(admin, tenant, scopes=["inference"])["key"]
        yield p, p.openai(key), p.api(admin_key)
    finally:
        p.stop()


def test_gateway_routes_and_meters_responses_tools_and_response_format(
    gateway: tuple[PlatformProcess, openai.OpenAI, httpx.Client],
) -> None:
    _, client, api = gateway
    plain = client.responses.with_raw_response.create(model=TINY, input="hi", max_output_tokens=5)
    streamed = client.responses.with_raw_response.create(
        model=TINY, input="hi", max_output_tokens=5, stream=True
    )
    events = list(streamed.parse())
    assert events[-1].type in ("response.completed", "response.incomplete")
    final_usage = events[-1].response.usage
    tools = client.chat.completions.with_raw_response.create(
        model=TINY, messages=[{"role": "user", "content": "pick"}], tools=[CHOICE_TOOL],
        tool_choice="required", max_tokens=150,
    )  # fmt: skip
    call = tools.parse().choices[0].message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), CHOICE_TOOL["function"]["parameters"])
    fmt = client.chat.completions.with_raw_response.create(
        model=TINY, messages=[{"role": "user", "content": "flag"}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": FLAG}},
    )  # fmt: skip
    jsonschema.validate(json.loads(fmt.parse().choices[0].message.content), FLAG)
    with pytest.raises(openai.BadRequestError) as over_cap:  # the gateway's own cap check
        client.responses.create(model=TINY, input="hi", max_output_tokens=10**6)
    assert over_cap.value.body["param"] == "max_output_tokens"  # type: ignore[index]
    ids = [r.headers["x-request-id"] for r in (plain, streamed, tools, fmt)]
    rows = {r["request_id"]: r for r in wait_request_ids(api, ids)}
    assert [rows[i]["kind"] for i in ids] == [
        "responses", "responses", "chat.completions", "chat.completions",
    ]  # fmt: skip
    assert int(rows[ids[0]]["completion_tokens"]) == plain.parse().usage.output_tokens
    # The stream is billed from its final event's usage.
    assert int(rows[ids[1]]["prompt_tokens"]) == final_usage.input_tokens
    assert int(rows[ids[1]]["completion_tokens"]) == final_usage.output_tokens
    assert int(rows[ids[2]]["completion_tokens"]) == tools.parse().usage.completion_tokens


def test_batch_lines_may_carry_tools_and_response_format(
    gateway: tuple[PlatformProcess, openai.OpenAI, httpx.Client],
) -> None:
    _, client, _ = gateway
    lines = [
        batch_line(
            "tools", model=TINY, max_tokens=150, tools=[CHOICE_TOOL], tool_choice="required"
        ),
        batch_line("format", model=TINY, max_tokens=60, response_format={
            "type": "json_schema", "json_schema": {"name": "f", "schema": FLAG}}),
    ]  # fmt: skip
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_batch(client, batch.id, {"completed", "failed"})
    assert batch.status == "completed", batch
    out = {o["custom_id"]: o["response"]["body"] for o in read_jsonl(client, batch.output_file_id)}
    call = out["tools"]["choices"][0]["message"]["tool_calls"][0]
    assert out["tools"]["choices"][0]["finish_reason"] == "tool_calls"
    jsonschema.validate(
        json.loads(call["function"]["arguments"]), CHOICE_TOOL["function"]["parameters"]
    )
    jsonschema.validate(json.loads(out["format"]["choices"][0]["message"]["content"]), FLAG)


FINITE_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["positive", "negative"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["label", "score"],
    "additionalProperties": False,
}


def test_structured_output_through_the_gateway_metered_refused_and_in_a_batch(
    gateway: tuple[PlatformProcess, openai.OpenAI, httpx.Client],
) -> None:
    """response_format on chat through the platform (one platform with the tests above). The
    tiny model writes noise, so each valid answer is the grammar's doing."""
    p, client, _ = gateway
    r = client.chat.completions.with_raw_response.create(
        model=TINY,
        messages=[{"role": "user", "content": "Classify: great"}],
        response_format=response_format("label", FINITE_SCHEMA),  # type: ignore[arg-type]
        temperature=1.0,
        max_tokens=64,
    )
    answer = r.parse()
    jsonschema.validate(json.loads(answer.choices[0].message.content), FINITE_SCHEMA)
    rows = wait_request_ids(p.api(), [r.headers["x-request-id"]])
    row = next(x for x in rows if x["request_id"] == r.headers["x-request-id"])
    assert int(row["completion_tokens"]) == answer.usage.completion_tokens > 0

    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": "hi"}],
            response_format=response_format("bad", {"type": "objekt"}),  # type: ignore[arg-type]
        )
    assert refused.value.body["param"] == "response_format"  # type: ignore[index]
    assert "objekt" in refused.value.body["message"]  # type: ignore[index]

    lines = [
        batch_line("a", model=TINY, max_tokens=64,
                   response_format=response_format("label", FINITE_SCHEMA)),
        batch_line("b", model=TINY, max_tokens=8, guided_choice=["yes", "no"]),
    ]  # fmt: skip
    batch_file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=batch_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    batch = wait_batch(client, batch.id, {"completed", "failed"})
    assert batch.status == "completed", batch
    results = {x["custom_id"]: x for x in read_jsonl(client, batch.output_file_id)}
    content = results["a"]["response"]["body"]["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(content), FINITE_SCHEMA)
    assert results["b"]["response"]["body"]["choices"][0]["message"]["content"] in {"yes", "no"}


def test_langchain_through_the_gateway(
    gateway: tuple[PlatformProcess, openai.OpenAI, httpx.Client],
) -> None:
    """LangChain as a new user points it at `modelyard serve`: `bind_tools` (a forced call, then
    the tool's result in the history), `with_structured_output` by all three methods, and
    `use_responses_api=True` (plain, streamed, a forced function tool). The tiny model writes
    noise, so each valid call or object is the grammar's doing; every request is metered."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    _, client, api = gateway
    request_ids: list[str] = []

    def keep_request_id(response: httpx.Response) -> None:
        request_ids.append(response.headers["x-request-id"])

    http = httpx.Client(event_hooks={"response": [keep_request_id]}, timeout=60)

    def llm(**fields: Any) -> ChatOpenAI:
        return ChatOpenAI(
            model=TINY, base_url=str(client.base_url), api_key=client.api_key, max_retries=0,
            http_client=http, **{"max_tokens": 150, **fields},
        )  # fmt: skip

    class Pick(BaseModel):
        """Pick a colour."""

        color: Literal["red", "green"]
        ok: bool

    chat = llm()
    ai = chat.bind_tools([Pick], tool_choice="required").invoke("pick")
    (call,) = ai.tool_calls
    assert call["name"] == "Pick" and call["id"]
    Pick.model_validate(call["args"])
    history = [HumanMessage("pick"), ai, ToolMessage("picked", tool_call_id=call["id"])]
    answer = llm(max_tokens=5).bind_tools([Pick]).invoke(history)
    # The call and its result were rendered into the prompt, not dropped.
    assert answer.usage_metadata and ai.usage_metadata
    assert answer.usage_metadata["input_tokens"] > ai.usage_metadata["input_tokens"]

    for method in ("json_schema", "function_calling"):
        assert isinstance(chat.with_structured_output(Pick, method=method).invoke("pick"), Pick)
    assert isinstance(chat.with_structured_output(method="json_mode").invoke("json"), dict)

    responses = llm(use_responses_api=True, max_tokens=8)
    message = responses.invoke("hi")
    assert isinstance(message.text, str)
    assert message.usage_metadata and message.usage_metadata["output_tokens"] > 0
    chunks = list(responses.stream("hi"))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert whole.usage_metadata and whole.usage_metadata["output_tokens"] > 0
    forced = llm(use_responses_api=True).bind_tools([Pick], tool_choice="required").invoke("pick")
    (call,) = forced.tool_calls
    assert call["name"] == "Pick"
    Pick.model_validate(call["args"])

    rows = {r["request_id"]: r for r in wait_request_ids(api, request_ids)}
    kinds = [rows[i]["kind"] for i in request_ids]
    assert kinds == ["chat.completions"] * 5 + ["responses"] * 3, kinds
