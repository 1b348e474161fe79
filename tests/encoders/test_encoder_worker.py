"""A real encoder worker process hosting MiniLM, a tiny classifier and its ONNX twin, driven by
the official `openai` client (embeddings) and plain HTTP (Open Inference Protocol v2)."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from modelyard.encoders.classifier import SequenceClassifier
from modelyard.encoders.embedding import EmbeddingModel
from tests.conftest import WorkerProcess, free_port
from tests.tiny_encoders import build_classifier, export_onnx, minilm_folder

SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Hello world!", "Quantum computing."]


class EncoderWorkerProcess(WorkerProcess):
    """`WorkerProcess`'s readiness wait and shutdown, around the encoder worker's command."""

    def __init__(self, models: dict[str, Path], *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "modelyard.cli", "encoders", "--port", str(self.port)]
        for name, path in models.items():
            cmd += ["--model", f"{name}={path}"]
        cmd += ["--log-level", "warning", *extra]
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the worker
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoder-worker")
    clf = build_classifier(root / "clf")
    return {"minilm": minilm_folder(), "clf": clf, "clf-onnx": export_onnx(clf, root / "onnx")}


@pytest.fixture(scope="module")
def worker(folders: dict[str, Path]) -> Iterator[EncoderWorkerProcess]:
    proc = EncoderWorkerProcess(folders, "--memory-budget", "1GiB")
    try:
        proc.wait_ready(timeout=60)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def url(worker: EncoderWorkerProcess) -> str:
    return worker.url


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def minilm() -> EmbeddingModel:
    return EmbeddingModel(minilm_folder())


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics").text
    pattern = rf"^{re.escape(name)}(\{{[^}}]*{re.escape(labels)}[^}}]*\}})? ([0-9.e+-]+)$"
    return sum(float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE))


def infer(url: str, model: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=30)


def texts_tensor(data: object, shape: list[int], datatype: str = "BYTES") -> dict[str, object]:
    return {"inputs": [{"name": "text", "shape": shape, "datatype": datatype, "data": data}]}


# ----- OpenAI embeddings -------------------------------------------------------------------------


def test_embeddings_through_the_openai_client(
    client: openai.OpenAI, minilm: EmbeddingModel
) -> None:
    one = client.embeddings.create(model="minilm", input=SENTENCES[0], encoding_format="float")
    assert one.object == "list" and one.model == "minilm" and len(one.data) == 1
    assert one.data[0].index == 0 and one.data[0].object == "embedding"
    expected, counts = minilm.encode(SENTENCES)
    assert np.allclose(one.data[0].embedding, expected[0].numpy(), atol=1e-6)
    assert one.usage.prompt_tokens == one.usage.total_tokens == counts[0]

    many = client.embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    floats = np.array([d.embedding for d in many.data], dtype=np.float32)
    assert np.allclose(floats, expected.numpy(), atol=1e-6)
    assert many.usage.prompt_tokens == sum(counts)

    # Without encoding_format the client asks for base64 and decodes it itself.
    decoded = client.embeddings.create(model="minilm", input=SENTENCES)
    assert np.array_equal(np.array([d.embedding for d in decoded.data], dtype=np.float32), floats)
    raw = client.embeddings.create(model="minilm", input=SENTENCES, encoding_format="base64")
    assert all(isinstance(d.embedding, str) for d in raw.data)
    unpacked = np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in raw.data])
    assert np.array_equal(unpacked, floats)


def test_token_id_inputs(client: openai.OpenAI, minilm: EmbeddingModel) -> None:
    ids = minilm.tokenizer.tokenizer.encode(SENTENCES[1], add_special_tokens=False)
    text = client.embeddings.create(model="minilm", input=SENTENCES[1], encoding_format="float")
    single = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    several = client.embeddings.create(model="minilm", input=[ids, ids], encoding_format="float")
    assert len(single.data) == 1 and len(several.data) == 2
    for d in [*single.data, *several.data]:
        assert np.allclose(d.embedding, text.data[0].embedding, atol=1e-6)
    assert single.usage.prompt_tokens == text.usage.prompt_tokens == len(ids) + 2


# What OpenAI's cl100k tokenizer gives for SENTENCES[0] (LangChain's `OpenAIEmbeddings` sends
# these by default): common words and punctuation are small ids, BERT's reserved [unused…] ones.
OPENAI_IDS = [791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679, 13]


def test_another_tokenizers_ids_are_refused(url: str) -> None:
    for ids, words in (
        ([4062, 39935], "vocabulary"),  # 39935: past MiniLM's 30,522 entries
        ([i for i in OPENAI_IDS if i < 30522], "reserved token '[unused786]'"),
    ):
        status, error = _openai_error(url, {"model": "minilm", "input": [[2003], ids]})
        assert status == 400 and error["param"] == "input", error
        message = str(error["message"])
        assert message.startswith("input 1 ") and words in message, message
        assert "check_embedding_ctx_length=False" in message


def _openai_error(url: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    r = httpx.post(f"{url}/v1/embeddings", json=body, timeout=30)
    return r.status_code, r.json()["error"]


def test_embedding_errors_are_openai_shaped(url: str, client: openai.OpenAI) -> None:
    status, error = _openai_error(url, {"model": "minilm", "input": ["x"] * 2049})
    assert status == 400 and error["param"] == "input" and "2048" in str(error["message"])
    status, error = _openai_error(url, {"model": "minilm", "input": ["ok", "word " * 300]})
    assert status == 400 and error["param"] == "input"
    assert "input 1" in str(error["message"]) and "256" in str(error["message"])
    status, error = _openai_error(url, {"model": "minilm", "input": ["ok", ""]})
    assert status == 400 and error["param"] == "input" and "input[1]" in str(error["message"])
    status, error = _openai_error(url, {"model": "minilm", "input": []})
    assert status == 400 and error["param"] == "input"
    status, error = _openai_error(url, {"model": "minilm", "input": "x", "dimensions": 128})
    assert status == 400 and error["param"] == "dimensions"
    status, error = _openai_error(url, {"model": "minilm", "input": [[2003, 99999]]})
    assert status == 400 and "vocabulary" in str(error["message"])
    status, error = _openai_error(url, {"model": "clf", "input": "x"})
    assert status == 400 and error["param"] == "model"
    status, error = _openai_error(url, {"model": "minilm", "input": "x", "encoding_format": "hex"})
    assert status == 400 and error["param"] == "encoding_format"
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="nope", input="x")
    assert info.value.code == "model_not_found"
    assert {m.id for m in client.models.list()} == {"minilm", "clf", "clf-onnx"}


def test_a_huge_input_is_refused_by_its_characters_before_tokenizing(url: str) -> None:
    # Issue 27: 7.5 MB of text, under the body cap, tokenized in the shared encoder thread for
    # seconds (every tenant's embeddings waiting) only to be refused for its token count.
    status, error = _openai_error(url, {"model": "minilm", "input": ["ok", "word " * 1_500_000]})
    assert status == 400 and error["param"] == "input", error
    assert "input 1 has 7500000 characters" in str(error["message"]), error
    assert httpx.post(
        f"{url}/v1/embeddings", json={"model": "minilm", "input": "ok"}, timeout=60
    ).is_success


# ----- Open Inference Protocol v2 ----------------------------------------------------------------


def test_v2_health_metadata_and_ready(url: str) -> None:
    assert httpx.get(f"{url}/v2/health/live").json() == {"live": True}
    assert httpx.get(f"{url}/v2/health/ready").json() == {"ready": True}
    meta = httpx.get(f"{url}/v2/models/clf-onnx").json()
    assert meta["name"] == "clf-onnx" and meta["versions"] == ["1"]
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert [(o["name"], o["datatype"]) for o in meta["outputs"]] == [
        ("label", "BYTES"),
        ("score", "FP32"),
    ]
    meta = httpx.get(f"{url}/v2/models/minilm/versions/1").json()
    assert meta["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]
    r = httpx.get(f"{url}/v2/models/clf/ready")
    assert r.status_code == 200 and r.json() == {"name": "clf", "ready": True}
    r = httpx.get(f"{url}/v2/models/nope/ready")
    assert r.status_code == 404 and set(r.json()) == {"error"}


def test_v2_infer_kserve_and_triton_styles(url: str, folders: dict[str, Path]) -> None:
    reference = SequenceClassifier(folders["clf"]).classify(SENTENCES)
    nested = texts_tensor([[s] for s in SENTENCES], [3, 1])
    for model in ("clf", "clf-onnx"):
        for body in (texts_tensor(SENTENCES, [3]), nested, texts_tensor(SENTENCES, [3, 1])):
            r = infer(url, model, {"id": "req-1", **body})
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["model_name"] == model and out["id"] == "req-1"
            label, score = out["outputs"]
            assert label["name"] == "label" and label["datatype"] == "BYTES"
            assert score["name"] == "score" and score["datatype"] == "FP32"
            assert label["shape"] == score["shape"] == [3]
            assert label["data"] == [s[0][0] for s in reference]
            assert np.allclose(score["data"], [s[0][1] for s in reference], atol=1e-4)
    r = infer(
        url, "clf-onnx", {**nested, "parameters": {"top_k": 2}, "outputs": [{"name": "score"}]}
    )
    (score,) = r.json()["outputs"]
    assert score["name"] == "score" and score["shape"] == [3, 2]
    want = [p for s in reference for _, p in s[:2]]
    assert np.allclose(score["data"], want, atol=1e-4)


def test_v2_infer_embedding_model(url: str, minilm: EmbeddingModel) -> None:
    r = infer(url, "minilm", texts_tensor(SENTENCES[:2], [2]))
    (embedding,) = r.json()["outputs"]
    assert embedding["name"] == "embedding" and embedding["datatype"] == "FP32"
    assert embedding["shape"] == [2, 384]
    got = np.array(embedding["data"], dtype=np.float32).reshape(2, 384)
    assert np.allclose(got, minilm.encode(SENTENCES[:2])[0].numpy(), atol=1e-6)


def test_v2_binary_tensors_on_the_worker(url: str, minilm: EmbeddingModel) -> None:
    """The worker speaks the binary extension itself (`modelyard encoders` standing alone):
    `tritonclient`'s defaults, binary input and output."""
    import tritonclient.http as triton

    client = triton.InferenceServerClient(url.removeprefix("http://"))
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]
    text = triton.InferInput("text", [2], "BYTES")
    text.set_data_from_numpy(np.array([s.encode() for s in SENTENCES[:2]], dtype=np.object_))
    result = client.infer("minilm", [text])
    assert "data" not in result.get_output("embedding")
    got = result.as_numpy("embedding")
    assert np.allclose(got, minilm.encode(SENTENCES[:2])[0].numpy(), atol=1e-6)
    result = client.infer("clf", [text], outputs=[triton.InferRequestedOutput("label")])
    plain = infer(url, "clf", texts_tensor(SENTENCES[:2], [2])).json()["outputs"][0]
    assert [x.decode() for x in result.as_numpy("label")] == plain["data"]


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        (texts_tensor(["x"] * 2049, [2049]), 400, "2048"),
        (texts_tensor(["ok", "fox " * 80], [2]), 400, "input 1"),
        (texts_tensor([1.0, 2.0], [2], "FP32"), 400, "BYTES"),
        (texts_tensor(["a", "b"], [2, 2]), 400, "shape"),
        (texts_tensor(["a", "b", "c"], [2]), 400, "shape"),
        (texts_tensor([["a", "b"]], [2, 1]), 400, "shape"),
        (texts_tensor([1, 2], [2]), 400, "string"),
        ({"inputs": []}, 400, "one input"),
        ({"inputs": [{"name": "text"}]}, 400, "shape"),
        ({**texts_tensor(["a"], [1]), "parameters": {"top_k": 9}}, 400, "top_k"),
        ({**texts_tensor(["a"], [1]), "outputs": [{"name": "logits"}]}, 400, "logits"),
        (
            {"inputs": [{"name": "INPUT0", "shape": [1], "datatype": "BYTES", "data": ["a"]}]},
            400,
            "unknown input 'INPUT0'",
        ),
    ],
)
def test_v2_errors_have_the_protocol_shape(
    url: str, body: dict[str, object], status: int, words: str
) -> None:
    r = infer(url, "clf", body)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and words in r.json()["error"]


def test_v2_error_shape_for_framework_failures(url: str) -> None:
    r = infer(url, "nope", texts_tensor(["a"], [1]))
    assert r.status_code == 404 and "nope" in r.json()["error"]
    r = httpx.post(f"{url}/v2/models/clf/infer", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]
    r = httpx.get(f"{url}/v2/models/clf/infer")  # wrong method
    assert r.status_code == 405 and set(r.json()) == {"error"}
    r = httpx.get(f"{url}/v2/models/clf/versions/7")
    assert r.status_code == 404 and set(r.json()) == {"error"}


# ----- health, metrics, batching -----------------------------------------------------------------


def test_health_lists_models(url: str) -> None:
    infer(url, "clf", texts_tensor(["a"], [1]))
    body = httpx.get(f"{url}/health").json()
    assert body["status"] == "ok" and set(body["models"]) == {"minilm", "clf", "clf-onnx"}
    clf = body["models"]["clf"]
    assert clf["loaded"] and clf["kind"] == "classifier" and clf["memory_bytes"] > 0
    assert body["memory_used_bytes"] <= body["memory_budget_bytes"] == 2**30
    assert metric(url, "modelyard_encoder_memory_used_bytes") == body["memory_used_bytes"]
    assert metric(url, "modelyard_encoder_models_loaded") >= 1


async def test_concurrent_requests_are_batched(url: str) -> None:
    batches = metric(url, "modelyard_encoder_batch_size_count", 'model="minilm"')
    items = metric(url, "modelyard_encoder_batch_size_sum", 'model="minilm"')
    requests = metric(url, "modelyard_encoder_requests_total", 'model="minilm"')
    sentences = [f"Sentence number {i} about batching requests together." for i in range(32)]
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        start = time.perf_counter()
        responses = await asyncio.gather(
            *(http.post("/v1/embeddings", json={"model": "minilm", "input": s}) for s in sentences)
        )
        elapsed = time.perf_counter() - start
        single = await http.post("/v1/embeddings", json={"model": "minilm", "input": sentences[5]})
    assert all(r.status_code == 200 for r in responses)
    # Each caller got its own sentence's vector back.
    assert np.allclose(
        responses[5].json()["data"][0]["embedding"],
        single.json()["data"][0]["embedding"],
        atol=1e-6,
    )
    batches = metric(url, "modelyard_encoder_batch_size_count", 'model="minilm"') - batches
    items = metric(url, "modelyard_encoder_batch_size_sum", 'model="minilm"') - items
    assert items == 33 and items / batches > 1.0
    assert metric(url, "modelyard_encoder_requests_total", 'model="minilm"') - requests == 33
    print(f"32 concurrent requests in {elapsed:.3f}s, mean batch {items / batches:.1f}")
