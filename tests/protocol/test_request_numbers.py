"""Every number and flag a tenant writes in a request body (inference, deploy, tenant, key and
version bodies) is a JSON number or boolean of the right kind: `true` is not 1, `"5"` is not 5,
`5.0` is not a count, `1` is not `true`. Pydantic's lax mode would take each of them, so every
such field is strict (`protocol/openai.py`, `responses_api.py`, `embeddings.py`,
`management.py`), and a refusal names the field."""

from __future__ import annotations

import types
import typing
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from modelyard.protocol.embeddings import EmbeddingRequest
from modelyard.protocol.errors import validation_failure
from modelyard.protocol.management import (
    DeployRequest,
    Hardware,
    KeyCreate,
    KeyRotate,
    KeyUpdate,
    SamplingDefaults,
    Scaling,
    TenantCreate,
    TenantUpdate,
    VersionCreate,
)
from modelyard.protocol.openai import ChatCompletionRequest, CompletionRequest
from modelyard.protocol.responses_api import ResponsesRequest

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
# A valid body per model: each field is then replaced by values of the wrong kind, one at a time.
BODIES: list[tuple[type[BaseModel], dict[str, Any]]] = [
    (ChatCompletionRequest, CHAT),
    (CompletionRequest, {"model": "m", "prompt": "hi"}),
    (ResponsesRequest, {"model": "m", "input": "hi"}),
    (EmbeddingRequest, {"model": "m", "input": "hi"}),
    (Hardware, {}),
    (Scaling, {}),
    (SamplingDefaults, {}),
    (TenantCreate, {"name": "t"}),
    (TenantUpdate, {}),
    (KeyCreate, {}),
    (KeyUpdate, {}),
    (KeyRotate, {}),
]
WRONG: dict[type, list[Any]] = {
    int: [True, False, 1.0, "1"],
    float: [True, "0.5"],
    bool: [1, 0, "true"],
}


def _scalar_kind(annotation: Any) -> type | None:
    """int, float or bool where the field is one of them (or one of them | None)."""
    union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    args = typing.get_args(annotation) if union else ()
    members = [a for a in args if a is not type(None)] if args else [annotation]
    if len(members) != 1:
        return None
    base = typing.get_origin(members[0]) or members[0]
    if base is typing.Annotated:
        base = typing.get_args(members[0])[0]
    return base if base in (int, float, bool) else None


def _cases() -> list[tuple[type[BaseModel], dict[str, Any], str, Any]]:
    cases = []
    for model, body in BODIES:
        for name, field in model.model_fields.items():
            kind = _scalar_kind(field.annotation)
            for value in WRONG.get(kind, []) if kind else []:
                cases.append((model, body, field.alias or name, value))
    return cases


CASES = _cases()


def test_the_walk_finds_the_fields_it_must() -> None:
    found = {(m.__name__, f) for m, _, f, _ in CASES}
    for expected in [
        ("ChatCompletionRequest", "max_tokens"),
        ("ChatCompletionRequest", "temperature"),
        ("ChatCompletionRequest", "stream"),
        ("ChatCompletionRequest", "top_k"),
        ("ResponsesRequest", "max_output_tokens"),
        ("Hardware", "gpu_count"),
        ("Scaling", "panic_threshold"),
        ("SamplingDefaults", "top_k"),
        ("TenantCreate", "max_replicas"),
        ("KeyCreate", "rpm_limit"),
    ]:
        assert expected in found, expected
    assert len(CASES) > 150


@pytest.mark.parametrize(
    ("model", "body", "field", "value"),
    CASES,
    ids=[f"{m.__name__}.{f}={v!r}" for m, _, f, v in CASES],
)
def test_a_number_or_flag_of_the_wrong_kind_is_refused_naming_the_field(
    model: type[BaseModel], body: dict[str, Any], field: str, value: Any
) -> None:
    with pytest.raises(ValidationError) as refused:
        model.model_validate({**body, field: value})
    message, param, _ = validation_failure(refused.value.errors())
    assert param is not None and param.split(".")[0] == field, (message, param)


def test_numbers_of_the_right_kind_are_taken() -> None:
    chat = ChatCompletionRequest.model_validate(
        {**CHAT, "max_tokens": 5, "temperature": 1, "top_p": 0.5, "stream": True, "seed": -3}
    )
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.stream) == (5, 1.0, 0.5, True)
    assert Scaling.model_validate({"panic_threshold": 2, "scale_to_zero": True}).scale_to_zero
    assert Hardware.model_validate({"gpu_count": 2, "max_replicas": 3}).gpu_count == 2
    assert DeployRequest.model_fields and VersionCreate.model_fields
