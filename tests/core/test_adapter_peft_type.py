"""Only LoRA adapters are served: an `adapter_config.json` whose `peft_type` is another PEFT
method, missing, or not a string is refused at push naming `peft_type` and what is served
(`core/adapter_shapes.check_adapter`), before any shape is looked at."""

from __future__ import annotations

from typing import Any

import pytest

from modelyard.core.adapter_shapes import check_adapter
from modelyard.core.errors import Invalid

# A rank-4 adapter on q_proj of layer 0 of a base with hidden size 8 (4 heads of 2).
DIMS = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 4,
        "num_hidden_layers": 1}  # fmt: skip
SHAPES = {
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 8),
    "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (8, 4),
}


@pytest.mark.parametrize("peft_type", ["LORA", "lora"])
def test_a_lora_adapter_passes(peft_type: str) -> None:
    assert check_adapter({"peft_type": peft_type, "r": 4}, SHAPES, DIMS, 16) == 4


@pytest.mark.parametrize("peft_type", ["PREFIX_TUNING", "IA3", "LOHA", "", None, 1, ["LORA"]])
def test_another_peft_type_is_refused_naming_it(peft_type: Any) -> None:
    config: dict[str, Any] = {"r": 4}
    if peft_type is not None:
        config["peft_type"] = peft_type
    with pytest.raises(Invalid) as refused:
        check_adapter(config, SHAPES, DIMS, 16)
    exc = refused.value
    assert (exc.param, exc.code) == ("peft_type", "invalid_adapter")
    assert "peft_type" in exc.message and '"LORA"' in exc.message, exc.message
    assert ("missing" if peft_type is None else repr(peft_type)) in exc.message, exc.message
