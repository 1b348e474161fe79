"""Models say what they are, through a real `modelyard serve` and the `openai` SDK: each
`/v1/models` entry (list and retrieve) carries its `kind` (chat, embedding, classifier) and
capabilities, and a request sent to a route its model's kind does not answer is a 400
`wrong_model_kind` naming the kind and the right route (it was the worker's 404 "Unknown request
URL"), on every route: chat, completions, Responses, embeddings and the Open Inference Protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.platform_harness import PlatformProcess, deploy, tiny_models_env, wait_status
from tests.tiny_encoders import build_classifier, build_embedding_model


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path
) -> Iterator[PlatformProcess]:
    build_embedding_model(models_dir / "emb")
    build_classifier(models_dir / "clf")
    p = PlatformProcess(tmp_path_factory.mktemp("data"), tiny_models_env(models_dir)).start()
    try:
        admin = p.api()
        endpoints = [deploy(admin, "tiny", str(models_dir / "tiny"), wait=False, public=True,
                            sampling_defaults={"temperature": 0.3})]  # fmt: skip
        for name in ("emb", "clf"):
            endpoints.append(deploy(admin, name, str(models_dir / name), wait=False, public=True))
        for endpoint_id in endpoints:  # provisioned side by side
            wait_status(admin, endpoint_id, "ready")
        yield p
    except BaseException:
        print(p.output())
        raise
    finally:
        p.stop()


def test_models_carry_their_kind_and_capabilities(platform: PlatformProcess) -> None:
    client = platform.openai()
    models = {m.id: m.model_dump() for m in client.models.list()}
    assert {k: models[k]["kind"] for k in ("tiny", "emb", "clf")} == {
        "tiny": "chat",
        "emb": "embedding",
        "clf": "classifier",
    }
    assert models["tiny"]["capabilities"] == {
        "tools": True,
        "structured_outputs": True,
        "reasoning": False,
        "adapters": False,
        "max_context": 512,  # the tiny Llama's max_position_embeddings
    }
    assert models["tiny"]["sampling_defaults"] == {"temperature": 0.3}
    assert models["emb"]["capabilities"] == {"max_context": 60}  # its max_seq_length
    one = client.models.retrieve("emb").model_dump()
    assert (one["kind"], one["capabilities"]) == ("embedding", {"max_context": 60})


def _refused(call: Callable[[], Any]) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    error: dict[str, Any] = caught.value.response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "wrong_model_kind",
        "model",
    ), error
    return error


def test_a_call_to_the_wrong_kind_is_a_400_naming_the_right_route(
    platform: PlatformProcess,
) -> None:
    client = platform.openai()
    messages = [{"role": "user", "content": "hi"}]
    error = _refused(lambda: client.embeddings.create(model="tiny", input="hi"))
    assert "`tiny` is a chat model" in error["message"]
    assert "/v1/chat/completions" in error["message"]
    error = _refused(lambda: client.chat.completions.create(model="emb", messages=messages))
    assert "`emb` is an embedding model" in error["message"]
    assert "/v1/embeddings" in error["message"]
    error = _refused(lambda: client.completions.create(model="clf", prompt="hi", max_tokens=2))
    assert "classifier" in error["message"] and "/v2/models/clf/infer" in error["message"]
    _refused(lambda: client.responses.create(model="emb", input="hi"))
    _refused(lambda: client.embeddings.create(model="clf", input="hi"))
    # The Open Inference Protocol route, in its own error shape.
    texts = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
    r = platform.api().post("/v2/models/tiny/infer", json=texts)
    assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
    assert "chat model" in r.json()["error"] and "/v1/chat/completions" in r.json()["error"]
    # The right kinds still serve.
    assert client.embeddings.create(model="emb", input="hi").data
    assert platform.api().post("/v2/models/clf/infer", json=texts).status_code == 200
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert reply.choices[0].message is not None
