"""Structured outputs through a real SmolLM2 worker and real clients (the `openai` SDK, its
pydantic `parse`, LangChain's `with_structured_output`): twenty strict schemas at temperature 0
and 1 always parse and validate; json_object, regex, choice and EBNF extras; a schema that does
not compile is a 400 naming the field; two constraints at once are refused; streams. Through the
platform's gateway (metered, refused, batched): tests/api/test_responses_api.py, on its platform."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.agent_fixtures import MODEL, response_format, sdk_client
from tests.conftest import WorkerProcess
from tests.structured_schemas import SCHEMAS

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def client(smollm2_worker: WorkerProcess) -> openai.OpenAI:
    return sdk_client(smollm2_worker)


def test_twenty_schemas_at_temperature_0_and_1_parse_and_validate(
    smollm2_worker: WorkerProcess,
) -> None:
    """All 40 requests go at once (the engine batches them): every answer is valid JSON of its
    schema, ended by the grammar (finish_reason stop), not by max_tokens."""
    assert len(SCHEMAS) == 20
    aclient = openai.AsyncOpenAI(
        base_url=f"{smollm2_worker.url}/v1", api_key="unused", max_retries=0
    )

    async def one(name: str, temperature: float) -> tuple[str, float, Any]:
        prompt, schema = SCHEMAS[name]
        r = await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"{prompt} Answer in JSON."}],
            response_format=response_format(name, schema),  # type: ignore[arg-type]
            temperature=temperature,
            seed=7,
            max_tokens=MAX_TOKENS,
        )
        return name, temperature, r.choices[0]

    async def all_of_them() -> list[tuple[str, float, Any]]:
        try:
            jobs = [one(name, t) for name in SCHEMAS for t in (0.0, 1.0)]
            return await asyncio.gather(*jobs)
        finally:
            await aclient.close()

    failures = []
    for name, temperature, choice in asyncio.run(all_of_them()):
        try:
            assert choice.finish_reason == "stop", choice.finish_reason
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name][1])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures.append((name, temperature, choice.message.content, repr(exc)[:200]))
    assert not failures, failures


class Country(BaseModel):
    name: str = Field(max_length=40)
    capital: str = Field(max_length=40)
    continent: Literal["Africa", "Americas", "Asia", "Europe", "Oceania"]


def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    r = client.beta.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about France."}],
        response_format=Country,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Country) and parsed.continent in {
        "Europe",
        "Africa",
        "Americas",
        "Asia",
        "Oceania",
    }


def test_langchain_with_structured_output_json_schema_and_json_mode(
    smollm2_worker: WorkerProcess,
) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL,
        base_url=f"{smollm2_worker.url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        temperature=0,
        max_tokens=MAX_TOKENS,  # type: ignore[call-arg]
        max_retries=0,
    )
    structured = llm.with_structured_output(Country, method="json_schema", strict=True)
    result = structured.invoke("Tell me about Japan.")
    assert isinstance(result, Country)
    # json_mode asks for any JSON object (response_format json_object): it always parses.
    loose = llm.with_structured_output(method="json_mode")
    assert isinstance(loose.invoke("Describe Japan as a JSON object."), dict)


def test_json_object_regex_choice_and_grammar(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "Give me a JSON object about a cat."}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=ask,
        response_format={"type": "json_object"},
        temperature=1.0,
        max_tokens=48,
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # a free-form object may run past max_tokens: then it says so
        assert r.choices[0].finish_reason == "length"

    phone = r"\(\d{3}\) \d{3}-\d{4}"
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A phone number?"}],
        extra_body={"guided_regex": phone},
        temperature=1.0,
        n=2,
        # Any Unicode decimal digit matches \d, and a 4-byte one (U+1FBF8, drawn in CI) takes up
        # to 4 byte-level tokens: 10 digits and 4 marks always fit in 48.
        max_tokens=48,
    )
    for c in r.choices:
        assert re.fullmatch(phone, c.message.content) and c.finish_reason == "stop"

    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        extra_body={"guided_choice": ["yes", "no"]},
        temperature=0,
        max_tokens=10,
    )
    assert r.choices[0].message.content in {"yes", "no"}

    r = client.completions.create(
        model=MODEL,
        prompt="The answer is",
        extra_body={"guided_grammar": 'root ::= " " ("yes" | "no") "."'},
        temperature=1.0,
        max_tokens=10,
    )
    assert r.choices[0].text in {" yes.", " no."} and r.choices[0].finish_reason == "stop"


def test_completions_take_response_format(client: openai.OpenAI) -> None:
    schema = SCHEMAS["rating"][1]
    r = client.completions.create(
        model=MODEL,
        prompt=["Rate Titanic as JSON:", "Rate Alien as JSON:"],
        extra_body={"response_format": response_format("rating", schema)},
        temperature=1.0,
        max_tokens=MAX_TOKENS,
    )
    assert len(r.choices) == 2
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), schema)
    # vLLM's spelling: the schema as guided_json.
    r = client.completions.create(
        model=MODEL,
        prompt="Rate Heat as JSON:",
        extra_body={"guided_json": schema},
        temperature=1.0,
        max_tokens=MAX_TOKENS,
    )
    jsonschema.validate(json.loads(r.choices[0].text), schema)


def test_stream_assembles_to_valid_json(client: openai.OpenAI) -> None:
    name, (prompt, schema) = "rating", SCHEMAS["rating"]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        response_format=response_format(name, schema),  # type: ignore[arg-type]
        temperature=1.0,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    parts, reasons = [], []
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)
    assert len([p for p in parts if p]) > 3 and reasons[-1] == "stop"
    jsonschema.validate(json.loads("".join(parts)), schema)


def test_max_tokens_before_the_schema_completes_is_length(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a city."}],
        response_format=response_format("city", SCHEMAS["city"][1]),  # type: ignore[arg-type]
        temperature=0,
        max_tokens=4,
    )
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {"response_format": response_format("bad", {"type": "objekt"})},
            "response_format",
        ),
        (
            {"response_format": response_format("bad", {"type": "string", "pattern": "(("})},
            "response_format",
        ),
        (
            {
                "response_format": response_format(
                    "bad", {"type": "integer", "minimum": 5, "maximum": 1}
                )
            },
            "response_format",
        ),
        ({"guided_regex": "(("}, "guided_regex"),
        ({"guided_grammar": "root ::= (("}, "guided_grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_object", "schema": {}}},
            "response_format.json_object.schema",
        ),
    ],
)
def test_refusals_name_the_field(
    smollm2_worker: WorkerProcess, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    r = httpx.post(f"{smollm2_worker.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param.split(".")[0]), error
    assert error["message"]
