"""Embedding and classifier endpoints on `modelyard serve`: the official `openai` client's
`embeddings.create` and the Open Inference Protocol v2 through the gateway with tenant keys,
metering, limits, isolation, several models sharing one host process, host repair, and a batch
of embeddings."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from modelyard.encoders.embedding import EmbeddingModel
from tests.platform_harness import (
    PlatformProcess,
    create_key,
    create_tenant,
    deploy,
    wait_status,
    wait_usage,
)
from tests.tiny_encoders import build_classifier, export_onnx, minilm_folder

SENTENCES = ["The cat sat on the mat.", "Quantum computing uses qubits.", "Hello!"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    clf = build_classifier(root / "clf")
    return {"minilm": minilm_folder(), "clf": clf, "clf-onnx": export_onnx(clf, root / "onnx")}


@pytest.fixture(scope="module")
def platform(
    platform_env: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
    folders: dict[str, Path],
    cache_dir: Path,
) -> Iterator[PlatformProcess]:
    """Both store modes: encoder requests are metered and rate limited like any other."""
    env = {**platform_env, "MODELYARD_HEALTH_CHECK_INTERVAL_S": "0.5"}
    p = PlatformProcess(tmp_path_factory.mktemp("data"), env).start()
    try:
        admin = p.api()
        for name, folder in folders.items():
            deploy(admin, name, str(folder), public=True)
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def tenant(platform: PlatformProcess) -> tuple[str, str]:
    admin = platform.api()
    tenant = create_tenant(admin, "encoders-tenant")
    return tenant, create_key(admin, tenant, rpm_limit=1000)["key"]


def test_embeddings_through_the_gateway_are_exact_and_metered(
    platform: PlatformProcess, tenant: tuple[str, str]
) -> None:
    tenant_id, key = tenant
    client = platform.openai(key)
    reference, counts = EmbeddingModel(minilm_folder()).encode(SENTENCES)
    resp = client.embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
    assert resp.model == "minilm" and [d.index for d in resp.data] == [0, 1, 2]
    got = np.array([d.embedding for d in resp.data], dtype=np.float32)
    assert np.abs(got - reference.numpy()).max() < 1e-5
    assert resp.usage.prompt_tokens == sum(counts) == resp.usage.total_tokens
    decoded = client.embeddings.create(model="minilm", input=SENTENCES[0])  # base64 on the wire
    assert np.allclose(decoded.data[0].embedding, got[0], atol=1e-6)
    rows = wait_usage(
        platform.api(),
        lambda rows: len([r for r in rows if r["kind"] == "embeddings"]) >= 2,
        tenant_id=tenant_id,
    )
    rows = [r for r in rows if r["kind"] == "embeddings"]
    assert sorted(int(r["prompt_tokens"]) for r in rows) == sorted([sum(counts), counts[0]])
    assert all(r["model"] == "minilm" and r["completion_tokens"] == "0" for r in rows)


def test_open_inference_protocol_through_the_gateway(
    platform: PlatformProcess, tenant: tuple[str, str]
) -> None:
    tenant_id, key = tenant
    http = platform.api(key)
    meta = http.get("/v2/models/clf").json()
    assert meta["name"] == "clf" and meta["outputs"][0]["name"] in ("label", "score")
    assert http.get("/v2/models/clf/ready").status_code == 200
    assert http.get("/v2/health/live").status_code == 200
    kserve = {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES",
                          "data": ["good movie", "bad movie"]}]}  # fmt: skip
    outputs = {}
    for model in ("clf", "clf-onnx"):
        r = http.post(f"/v2/models/{model}/infer", json=kserve)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model_name"] == model
        outputs[model] = {o["name"]: o for o in body["outputs"]}
        assert outputs[model]["label"]["shape"] == [2]
    assert outputs["clf"]["label"]["data"] == outputs["clf-onnx"]["label"]["data"]
    assert np.allclose(outputs["clf"]["score"]["data"], outputs["clf-onnx"]["score"]["data"],
                       atol=1e-4)  # fmt: skip
    triton = {"inputs": [{"name": "text", "shape": [2, 1], "datatype": "BYTES",
                          "data": ["good movie", "bad movie"]}]}  # fmt: skip
    r = http.post("/v2/models/clf/infer", json=triton)
    assert r.status_code == 200
    rows = wait_usage(
        platform.api(),
        lambda rows: len([r for r in rows if r["kind"] == "oip.infer"]) >= 3,
        tenant_id=tenant_id,
    )
    rows = [r for r in rows if r["kind"] == "oip.infer"]
    assert len(rows) == 3  # one metered request each, billed the tokens its texts took
    assert {r["prompt_tokens"] for r in rows} == {str(body["parameters"]["usage"]["prompt_tokens"])}
    assert int(rows[0]["prompt_tokens"]) > 0


def test_tritonclient_on_its_defaults(platform: PlatformProcess, tenant: tuple[str, str]) -> None:
    """`tritonclient[http]` as its docs show it: binary input tensors, binary outputs (asked by
    default when no outputs are named), server metadata; the numbers match the JSON route's."""
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

    tenant_id, key = tenant
    auth = {"Authorization": f"Bearer {key}"}
    client = triton.InferenceServerClient(platform.url.removeprefix("http://"))
    meta = client.get_server_metadata()
    assert meta["name"] == "modelyard" and "binary_tensor_data" in meta["extensions"]
    assert client.is_server_live() and client.is_model_ready("minilm", headers=auth)
    assert client.get_model_metadata("minilm", headers=auth)["inputs"][0]["name"] == "text"
    texts = np.array([[t.encode()] for t in SENTENCES], dtype=np.object_)
    text = triton.InferInput("text", list(texts.shape), "BYTES")
    text.set_data_from_numpy(texts)  # binary_data=True: the client's default
    result = client.infer("minilm", [text], headers=auth)
    assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] == 3 * 384 * 4
    got = result.as_numpy("embedding")
    reference, counts = EmbeddingModel(minilm_folder()).encode(SENTENCES)
    assert got.shape == (3, 384) and np.abs(got - reference.numpy()).max() < 1e-5
    assert result.get_response()["parameters"]["usage"]["prompt_tokens"] == sum(counts)
    # The classifier, its outputs named (binary by default) and one asked for as JSON.
    outputs = [triton.InferRequestedOutput("label"), triton.InferRequestedOutput("score", False)]
    result = client.infer("clf", [text], outputs=outputs, headers=auth)
    tensor = {"name": "text", "shape": [3], "datatype": "BYTES", "data": SENTENCES}
    plain = platform.api(key).post("/v2/models/clf/infer", json={"inputs": [tensor]}).json()
    by_name = {o["name"]: o for o in plain["outputs"]}
    assert [x.decode() for x in result.as_numpy("label")] == by_name["label"]["data"]
    assert "data" in result.get_output("score") and "data" not in result.get_output("label")
    assert np.allclose(result.as_numpy("score"), by_name["score"]["data"], atol=1e-6)
    # An input name the model does not take is refused, naming it.
    wrong = triton.InferInput("INPUT0", [1], "BYTES")
    wrong.set_data_from_numpy(np.array([b"x"], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="unknown input 'INPUT0'"):
        client.infer("clf", [wrong], headers=auth)
    rows = wait_usage(
        platform.api(),
        lambda rows: (
            len([r for r in rows if r["model"] == "minilm" and r["kind"] == "oip.infer"]) >= 1
        ),
        tenant_id=tenant_id,
    )
    assert [r["prompt_tokens"] for r in rows if r["model"] == "minilm" and r["kind"] == "oip.infer"
            ] == [str(sum(counts))]  # fmt: skip


def test_binary_bodies_are_bounded(platform: PlatformProcess, tenant: tuple[str, str]) -> None:
    """Sizes that do not add up to the body are refused, naming what is wrong."""
    http = platform.api(tenant[1])
    header = b'{"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", '
    one = header + b'"parameters": {"binary_data_size": 6}}]}'
    element = (2).to_bytes(4, "little") + b"hi"

    def post(body: bytes, length: object) -> httpx.Response:
        headers = {"Inference-Header-Content-Length": str(length)}
        return http.post("/v2/models/clf/infer", content=body, headers=headers)

    assert post(one + element, len(one)).status_code == 200
    cases = [
        (one + element + b"x", len(one), "1 bytes no input"),
        (one + element[:-1], len(one), "runs past"),
        (one + element, len(one) + 100, "the body holds"),
        (one + element, "ten", "not an integer"),
        (one + (9).to_bytes(4, "little") + b"hi", len(one), "runs past its binary data"),
        (one + (1).to_bytes(4, "little") + b"\xff" + b"x", len(one), "not UTF-8"),
    ]
    # 20,000 dimensions of 2**62: their product (one C call holding the GIL) froze the gateway.
    dims = b",".join([b"4611686018427387904"] * 20_000)
    huge = b'{"inputs": [{"name": "text", "shape": [' + dims + b'], "datatype": "BYTES", '
    huge += b'"parameters": {"binary_data_size": 6}}]}'
    cases.append((huge + element, len(huge), "at most 16 items"))
    for body, length, message in cases:
        r = post(body, length)
        assert r.status_code == 400 and message in r.json()["error"], (message, r.text)
    platform.assert_no_loop_stalls()


def test_oip_errors_take_the_protocol_shape(platform: PlatformProcess, tenant: tuple[str, str]):
    _, key = tenant
    http = platform.api(key)
    r = http.post("/v2/models/nope/infer", json={"inputs": []})
    assert r.status_code == 404 and set(r.json()) == {"error"}
    r = httpx.post(f"{platform.url}/v2/models/clf/infer", json={"inputs": []})
    assert r.status_code == 401 and set(r.json()) == {"error"}
    bad_type = {"inputs": [{"name": "text", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
    r = http.post("/v2/models/clf/infer", json=bad_type)
    assert r.status_code == 400 and r.json() == {
        "error": "input 'text' has datatype FP32; expected BYTES (texts)"
    }
    bad_shape = {"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": ["a"]}]}
    assert http.post("/v2/models/clf/infer", json=bad_shape).status_code == 400
    with pytest.raises(openai.NotFoundError):
        platform.openai(key).embeddings.create(model="nope", input="x")
    with pytest.raises(openai.BadRequestError):
        platform.openai(key).embeddings.create(model="minilm", input="x", dimensions=8)


def test_rate_limits_apply_to_oip_requests(platform: PlatformProcess) -> None:
    admin = platform.api()
    key = create_key(admin, create_tenant(admin, "oip-limited"), rpm_limit=2)["key"]
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}
    http = platform.api(key)
    assert [http.post("/v2/models/clf/infer", json=body).status_code for _ in range(2)] == [
        200,
        200,
    ]
    r = http.post("/v2/models/clf/infer", json=body)
    assert r.status_code == 429 and "error" in r.json() and int(r.headers["retry-after"]) >= 1


def test_small_models_share_one_host_process(platform: PlatformProcess) -> None:
    endpoints = platform.api().get("/v1/endpoints").json()["data"]
    pids = {e["model_name"]: e["replicas"]["items"][0]["pid"] for e in endpoints}
    assert pids["minilm"] == pids["clf"] == pids["clf-onnx"]
    assert {e["kind"] for e in endpoints} == {"embedding", "classifier", "onnx-classifier"}
    # The host holds its memory budget on one device, placed like any replica.
    (device,) = {tuple(e["replicas"]["items"][0]["devices"]) for e in endpoints}
    assert len(device) == 1
    devices = {d["name"]: d for d in platform.api().get("/v1/devices").json()["data"]}
    host = devices[device[0]]
    assert len(host["replicas"]) == 1 and host["used_bytes"] > 0


def test_private_encoder_endpoints_stay_private(
    platform: PlatformProcess, folders: dict[str, Path]
) -> None:
    admin = platform.api()
    a = create_tenant(admin, "enc-a")
    b_key = create_key(admin, create_tenant(admin, "enc-b"))["key"]
    a_admin = create_key(admin, a, scopes=["admin", "inference"])["key"]
    # The platform admin deploys for nobody else; tenant A pushes its own classifier instead.
    from modelyard.registry_client import RegistryClient

    RegistryClient(platform.url, a_admin).push(folders["clf"], "a-clf")
    endpoint = deploy(platform.api(a_admin), "a-clf", "a-clf")
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}
    assert platform.api(a_admin).post("/v2/models/a-clf/infer", json=body).status_code == 200
    assert platform.api(b_key).post("/v2/models/a-clf/infer", json=body).status_code == 404
    assert platform.api(b_key).post(f"/v2/models/{endpoint}/infer", json=body).status_code == 404
    platform.api(a_admin).delete(f"/v1/endpoints/{endpoint}")
    wait_status(platform.api(a_admin), endpoint, "gone")


def test_a_batch_of_embeddings(platform: PlatformProcess, tenant: tuple[str, str]) -> None:
    _, key = tenant
    client = platform.openai(key)
    lines = [
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "minilm", "input": SENTENCES[i % 3]}}
        for i in range(12)
    ]  # fmt: skip
    data = "\n".join(json.dumps(x) for x in lines).encode()
    upload = client.files.create(file=("e.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while (b := client.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline, b.status
        time.sleep(0.2)
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert len(out) == 12
    assert all(len(o["response"]["body"]["data"][0]["embedding"]) == 384 for o in out)
    assert {o["response"]["body"]["model"] for o in out} == {"minilm"}


def test_a_killed_encoder_host_is_restarted_with_its_models(
    platform: PlatformProcess, tenant: tuple[str, str]
) -> None:
    _, key = tenant
    admin = platform.api()
    (minilm,) = [
        e for e in admin.get("/v1/endpoints").json()["data"] if e["model_name"] == "minilm"
    ]
    old_pid = minilm["replicas"]["items"][0]["pid"]
    os.kill(old_pid, signal.SIGKILL)
    client = platform.openai(key)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.embeddings.create(model="minilm", input="back again?")
            break
        except (openai.APIStatusError, openai.APIConnectionError):
            assert time.monotonic() < deadline
            time.sleep(0.5)
    endpoint = admin.get(f"/v1/endpoints/{minilm['endpoint_id']}").json()
    assert endpoint["replicas"]["items"][0]["pid"] != old_pid
    assert endpoint["replicas"]["restarts"] >= 1
    # The dead host's reservation was given back: one host, one reservation.
    placed = [r for d in admin.get("/v1/devices").json()["data"] for r in d["replicas"]]
    assert len(placed) == 1
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["x"]}]}
    assert platform.api(key).post("/v2/models/clf/infer", json=body).status_code == 200
