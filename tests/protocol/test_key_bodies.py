"""The integers a key's owner writes (rate limits, a rotation's grace period) are JSON integers:
`true` is refused naming the field, never read as 1 (`protocol/management.py`)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from modelyard.protocol.errors import validation_failure
from modelyard.protocol.management import KeyCreate, KeyRotate, KeyUpdate

INTEGERS: list[tuple[type[BaseModel], str]] = [
    (KeyRotate, "grace_period_seconds"),
    (KeyCreate, "rpm_limit"),
    (KeyCreate, "tpm_limit"),
    (KeyUpdate, "rpm_limit"),
    (KeyUpdate, "tpm_limit"),
]


@pytest.mark.parametrize(("model", "field"), INTEGERS)
@pytest.mark.parametrize("value", [True, False, 1.0, "60"])
def test_a_key_bodys_integers_refuse_what_is_not_an_integer(
    model: type[BaseModel], field: str, value: Any
) -> None:
    with pytest.raises(ValidationError) as refused:
        model.model_validate({field: value})
    message, param, _ = validation_failure(refused.value.errors())
    assert param == field and field in message, (message, param)


def test_a_key_bodys_integers_take_integers() -> None:
    assert KeyRotate.model_validate({"grace_period_seconds": 0}).grace_period_seconds == 0
    assert KeyRotate.model_validate({}).grace_period_seconds == 86_400
    assert KeyCreate.model_validate({"rpm_limit": 60, "tpm_limit": None}).rpm_limit == 60
    assert KeyUpdate.model_validate({"tpm_limit": 1000}).tpm_limit == 1000
