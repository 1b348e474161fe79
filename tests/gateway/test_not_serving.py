"""An endpoint that is only unavailable answers a retryable 503, never `404 model_not_found`.

A `modelyard serve` with an LLM endpoint and an embedding endpoint (the shared encoder host).
Its replicas are made not to serve the model the gateway resolved, as they are for a moment
while an encoder host is restarted or taken over: the LLM worker renamed, the model removed
from the encoder host (both through the replicas' own admin routes, with the platform's worker
token). Through the `openai` SDK, chat (plain and streamed) and embeddings answer 503 with
Retry-After and code `model_not_ready` (what the SDK retries), and serve again once the replica
serves the model again.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from modelyard.core.cluster_auth import worker_token
from tests.platform_harness import PlatformProcess, deploy, tiny_models_env
from tests.tiny_encoders import build_embedding_model

CLUSTER_SECRET = "not-serving-test-secret-" + "0123456789abcdef" * 2
WORKER = {"authorization": f"Bearer {worker_token(CLUSTER_SECRET)}"}


@pytest.fixture(scope="module")
def platform(
    tmp_path_factory: pytest.TempPathFactory, models_dir: Path
) -> Iterator[PlatformProcess]:
    build_embedding_model(models_dir / "embed")
    # The test's own cluster secret: it reaches the replicas' admin routes with their token.
    env = {**tiny_models_env(models_dir), "MODELYARD_CLUSTER_SECRET": CLUSTER_SECRET}
    p = PlatformProcess(tmp_path_factory.mktemp("data"), env).start()
    try:
        yield p
    except BaseException:
        print(p.output())
        raise
    finally:
        p.stop()


def _replica(platform: PlatformProcess, endpoint_id: str) -> dict[str, Any]:
    r = platform.api().get(f"/v1/endpoints/{endpoint_id}")
    assert r.status_code == 200, r.text
    return dict(r.json()["replicas"]["items"][0])


def _assert_retryable(exc: openai.APIStatusError) -> None:
    assert exc.status_code == 503, (exc.status_code, exc.response.text)
    assert exc.response.headers.get("retry-after"), exc.response.headers
    assert exc.response.json()["error"]["code"] == "model_not_ready", exc.response.text


def test_a_worker_that_does_not_serve_the_model_is_a_503(
    platform: PlatformProcess, models_dir: Path
) -> None:
    admin = platform.api()
    endpoint = deploy(admin, "tiny", str(models_dir / "tiny"))
    address = _replica(platform, endpoint)["address"]
    client = platform.openai()
    client = client.with_options(max_retries=0)
    messages: Any = [{"role": "user", "content": "hi"}]

    rename = httpx.put(f"{address}/admin/served-model", json={"name": "moved"}, headers=WORKER)
    assert rename.status_code == 200, rename.text
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    _assert_retryable(refused.value)
    with pytest.raises(openai.APIStatusError) as refused_stream:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, stream=True)
    _assert_retryable(refused_stream.value)

    back = httpx.put(f"{address}/admin/served-model", json={"name": "tiny"}, headers=WORKER)
    assert back.status_code == 200, back.text
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert answer.choices[0].finish_reason in ("length", "stop")


def test_an_encoder_host_without_the_model_is_a_503(
    platform: PlatformProcess, models_dir: Path
) -> None:
    admin = platform.api()
    endpoint = deploy(admin, "embed", str(models_dir / "embed"))
    address = _replica(platform, endpoint)["address"]
    client = platform.openai().with_options(max_retries=0)
    assert client.embeddings.create(model="embed", input="hello").data[0].embedding

    gone = httpx.delete(f"{address}/admin/models/{endpoint}", headers=WORKER)
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.APIStatusError) as refused:
        client.embeddings.create(model="embed", input="hello")
    _assert_retryable(refused.value)

    body = {"path": str(models_dir / "embed")}
    again = httpx.put(f"{address}/admin/models/{endpoint}", json=body, headers=WORKER)
    assert again.status_code == 200, again.text
    assert client.embeddings.create(model="embed", input="hello").data[0].embedding
