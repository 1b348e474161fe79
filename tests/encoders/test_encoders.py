"""Encoder models, the dynamic batcher and the model host, in process: MiniLM against the
sentence-transformers reference, tiny random models for pooling modes and classifiers (torch vs
their ONNX export), and the batcher's and host's behaviour under concurrency."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from modelyard.core.model_files import inspect_local
from modelyard.encoders.batcher import DynamicBatcher
from modelyard.encoders.classifier import OnnxClassifier, SequenceClassifier
from modelyard.encoders.embedding import EmbeddingModel
from modelyard.encoders.errors import (
    DimensionsNotSupported,
    HostBusy,
    InputTooLong,
    InvalidTokenId,
    ModelTooLarge,
    UnknownModel,
)
from modelyard.encoders.host import ModelHost
from modelyard.encoders.loading import detect_kind, estimate_bytes
from tests.tiny_encoders import (
    LABELS,
    build_classifier,
    build_embedding_model,
    export_onnx,
    minilm_folder,
)
from tests.waiting import async_wait_until

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map sentences to vectors.",
    "hi",
    "Machine learning models can be trained on large datasets, and this sentence is a good "
    "deal longer than the others so that padding matters in the batch.",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("encoders")


@pytest.fixture(scope="module")
def minilm() -> EmbeddingModel:
    return EmbeddingModel(minilm_folder())


@pytest.fixture(scope="module")
def classifier_folder(tiny: Path) -> Path:
    return build_classifier(tiny / "clf")


@pytest.fixture(scope="module")
def onnx_folder(tiny: Path, classifier_folder: Path) -> Path:
    return export_onnx(classifier_folder, tiny / "clf-onnx")


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    assert (a - b).abs().max().item() < 1e-5
    assert F.cosine_similarity(a, b).min().item() > 0.9999


# ----- embeddings --------------------------------------------------------------------------------


def test_minilm_matches_sentence_transformers(minilm: EmbeddingModel) -> None:
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(minilm_folder()), device="cpu", local_files_only=True)
    vectors, counts = minilm.encode(TEXTS)
    expected = torch.from_numpy(reference.encode(TEXTS, convert_to_numpy=True))
    _close(vectors, expected)
    assert vectors.dtype == torch.float32 and vectors.shape == (len(TEXTS), 384)
    assert counts == [len(minilm.tokenizer.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert counts[2] == 3  # [CLS] hi [SEP]


def test_minilm_matches_masked_mean_reference(minilm: EmbeddingModel) -> None:
    """The model card's own recipe: AutoModel, attention-masked mean, L2 normalization."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_folder()), local_files_only=True)
    model = AutoModel.from_pretrained(str(minilm_folder()), local_files_only=True).eval()
    enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    expected = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)
    vectors, _ = minilm.encode(TEXTS)
    _close(vectors, expected)
    assert minilm.config.pooling == ("mean",) and minilm.config.normalize
    assert minilm.max_length == 256


@pytest.mark.parametrize("pooling", ["cls", "max", "lasttoken", "mean"])
def test_pooling_mode_read_from_config(tiny: Path, pooling: str) -> None:
    folder = build_embedding_model(tiny / f"pool-{pooling}", pooling=pooling)
    model = EmbeddingModel(folder)
    assert model.config.pooling == (pooling,) and model.max_length == 60
    vectors, counts = model.encode(TEXTS)
    # The same computation by hand from the raw network.
    from transformers import AutoModel

    net = AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
    rows = []
    for text, n in zip(TEXTS, counts, strict=True):
        ids = torch.tensor([model.tokenizer.ids([text])[0]])
        with torch.no_grad():
            hidden = net(input_ids=ids).last_hidden_state[0]
        assert hidden.shape[0] == n
        rows.append(
            {
                "cls": hidden[0],
                "max": hidden.max(0).values,
                "lasttoken": hidden[-1],
                "mean": hidden.mean(0),
            }[pooling]
        )
    _close(vectors, F.normalize(torch.stack(rows), dim=1))


def test_tiny_pooling_matches_sentence_transformers(tiny: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    folder = build_embedding_model(tiny / "st-cls", pooling="cls", normalize=False)
    reference = st.SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    vectors, _ = EmbeddingModel(folder).encode(TEXTS)
    _close(vectors, torch.from_numpy(reference.encode(TEXTS, convert_to_numpy=True)))


def test_plain_bert_folder_defaults(tiny: Path) -> None:
    folder = build_embedding_model(tiny / "plain", sentence_transformers=False)
    model = EmbeddingModel(folder)
    assert model.config.pooling == ("mean",) and not model.config.normalize
    assert model.max_length == 64  # the position table: no sentence_bert_config.json
    vectors, _ = model.encode(TEXTS[:2])
    assert not torch.allclose(vectors.norm(dim=1), torch.ones(2))


def test_token_ids_give_the_same_vector_as_the_text(minilm: EmbeddingModel) -> None:
    ids = minilm.tokenizer.tokenizer.encode(TEXTS[0], add_special_tokens=False)
    vectors, counts = minilm.encode([TEXTS[0], ids])
    _close(vectors[:1], vectors[1:])
    assert counts[0] == counts[1] == len(ids) + 2


def test_too_long_input_is_refused_with_its_index(minilm: EmbeddingModel, tiny: Path) -> None:
    with pytest.raises(InputTooLong) as info:
        minilm.encode(["short", "word " * 300])
    assert info.value.index == 1 and info.value.limit == 256 and info.value.n_tokens == 302
    assert "input 1" in str(info.value) and "256" in str(info.value)
    moved = info.value.reindexed(7)
    assert isinstance(moved, InputTooLong) and moved.index == 7 and moved.limit == 256
    assert str(moved).startswith("input 7 has 302 tokens")
    with pytest.raises(InputTooLong) as info:
        minilm.encode([[1000] * 255])  # 255 ids + [CLS] + [SEP]
    assert info.value.n_tokens == 257
    minilm.encode([[1000] * 254])  # exactly at the limit
    with pytest.raises(InvalidTokenId):
        minilm.encode([[5, 40000]])


def test_dimensions_refused_unless_declared(minilm: EmbeddingModel, tiny: Path) -> None:
    with pytest.raises(DimensionsNotSupported, match="'dimensions'"):
        minilm.check_dimensions(128)
    folder = build_embedding_model(tiny / "matryoshka", matryoshka=True)
    model = EmbeddingModel(folder)
    vectors, _ = model.encode(TEXTS)
    short = model.truncate(vectors, 8)
    assert short.shape == (len(TEXTS), 8)
    _close(short, F.normalize(vectors[:, :8], dim=1))
    with pytest.raises(DimensionsNotSupported):
        model.check_dimensions(33)


def test_memory_bytes_counts_parameters(minilm: EmbeddingModel) -> None:
    params = sum(p.numel() for p in minilm.model.parameters())
    assert params * 4 <= minilm.memory_bytes() < params * 4 * 1.01
    recorded = inspect_local(minilm_folder()).param_count
    assert estimate_bytes("embedding", minilm_folder(), recorded) == pytest.approx(
        minilm.memory_bytes(), rel=0.01
    )


# ----- classifiers -------------------------------------------------------------------------------


def test_onnx_export_gives_the_same_labels_and_scores(
    classifier_folder: Path, onnx_folder: Path
) -> None:
    torch_model = SequenceClassifier(classifier_folder)
    onnx_model = OnnxClassifier(onnx_folder)
    assert torch_model.labels == onnx_model.labels == list(LABELS)
    assert torch_model.max_length == onnx_model.max_length == 64
    texts = [*TEXTS, "fox " * 40]  # longer than the traced example: dynamic axes
    expected, got = torch_model.classify(texts), onnx_model.classify(texts)
    for want, have in zip(expected, got, strict=True):
        assert [label for label, _ in want] == [label for label, _ in have]
        assert np.allclose([s for _, s in want], [s for _, s in have], atol=1e-4)
        scores = [s for _, s in have]
        assert scores == sorted(scores, reverse=True) and sum(scores) == pytest.approx(1.0)
    assert detect_kind(classifier_folder) == "classifier"
    assert detect_kind(onnx_folder) == "onnx-classifier"
    assert onnx_model.memory_bytes() > 0


def test_classifier_scores_are_the_softmax_of_the_logits(classifier_folder: Path) -> None:
    model = SequenceClassifier(classifier_folder)
    enc = model.tokenizer.tokenizer([TEXTS[0]], return_tensors="pt")
    with torch.no_grad():
        probs = model.model(**enc).logits.softmax(-1)[0]
    (scores,) = model.classify([TEXTS[0]])
    assert dict(scores) == pytest.approx(
        {model.labels[i]: float(p) for i, p in enumerate(probs)}, abs=1e-6
    )
    with pytest.raises(InputTooLong) as info:
        model.classify(["ok", "ok", "fox " * 80])
    assert info.value.index == 2 and info.value.limit == 64


# ----- dynamic batcher ---------------------------------------------------------------------------


class Recorder:
    """A batch function doubling numbers, remembering its batches; negatives make it fail."""

    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.delay = delay
        self.threads: set[str] = set()

    def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay)
        if any(i < 0 for i in items):
            raise ValueError(f"negative input in {items}")
        return [2 * i for i in items]


async def test_concurrent_submits_share_one_batch() -> None:
    fn = Recorder()
    batcher = DynamicBatcher(fn, max_batch_size=32, max_wait_ms=50)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(10)))
    assert results == [2 * i for i in range(10)]
    assert fn.batches == [list(range(10))]
    assert batcher.stats.batches == 1 and batcher.stats.mean_batch_size == 10
    assert threading.main_thread().name not in fn.threads
    batcher.close()


async def test_max_batch_size_is_respected() -> None:
    fn = Recorder()
    batcher = DynamicBatcher(fn, max_batch_size=4, max_wait_ms=20)
    results = await asyncio.gather(*(batcher.submit(i) for i in range(10)))
    assert results == [2 * i for i in range(10)]
    assert [len(b) for b in fn.batches] == [4, 4, 2]
    batcher.close()


async def test_a_failing_item_fails_alone() -> None:
    fn = Recorder()
    batcher = DynamicBatcher(fn, max_batch_size=8, max_wait_ms=20)
    outcomes = await asyncio.gather(
        *(batcher.submit(i) for i in [1, -1, 3]), return_exceptions=True
    )
    assert outcomes[0] == 2 and outcomes[2] == 6
    assert isinstance(outcomes[1], ValueError)
    assert fn.batches == [[1, -1, 3], [1], [-1], [3]]
    assert batcher.stats.fallbacks == 1
    batcher.close()


async def test_late_items_wait_at_most_the_window() -> None:
    fn = Recorder()
    batcher = DynamicBatcher(fn, max_batch_size=32, max_wait_ms=10)
    first = asyncio.ensure_future(batcher.submit(1))
    # Nothing else came within the window: the first batch goes alone.
    await async_wait_until(lambda: fn.batches == [[1]], "the first batch to go alone", 10)
    assert await first == 2 and await batcher.submit(2) == 4
    assert fn.batches == [[1], [2]]
    batcher.close()


async def test_cancelled_callers_do_not_break_the_batch() -> None:
    fn = Recorder(delay=0.1)
    batcher = DynamicBatcher(fn, max_batch_size=8, max_wait_ms=30)
    tasks = [asyncio.ensure_future(batcher.submit(i)) for i in range(4)]
    await asyncio.sleep(0)
    tasks[1].cancel()  # still queued: it drops out of the batch
    await async_wait_until(lambda: fn.batches, "the batch to start running", 10)
    tasks[2].cancel()  # its batch is running: the others still get theirs
    assert await tasks[0] == 0 and await tasks[3] == 6
    assert tasks[1].cancelled() and tasks[2].cancelled()
    assert fn.batches == [[0, 2, 3]]
    assert await batcher.submit(5) == 10  # and the batcher goes on
    batcher.close()


async def test_the_event_loop_stays_free_while_a_batch_runs() -> None:
    batcher = DynamicBatcher(Recorder(delay=0.3), max_wait_ms=1)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    tick = asyncio.ensure_future(ticker())
    await batcher.submit(1)
    tick.cancel()
    assert ticks >= 10
    batcher.close()


# ----- model host --------------------------------------------------------------------------------


def _params(folder: Path) -> int:
    return inspect_local(folder).param_count


@pytest.fixture(scope="module")
def three_models(tiny: Path) -> list[Path]:
    return [build_embedding_model(tiny / f"host-{i}", seed=i) for i in range(3)]


@pytest.fixture
def host(three_models: list[Path]) -> Iterator[ModelHost]:
    size = estimate_bytes("embedding", three_models[0], _params(three_models[0]))
    host = ModelHost(memory_budget=int(size * 2.5), max_wait_ms=1)
    for i, folder in enumerate(three_models):
        host.register(f"m{i}", folder, param_count=_params(folder))
    yield host
    host.close()


async def test_host_loads_on_first_use(host: ModelHost) -> None:
    assert [s.loaded for s in host.status()] == [False, False, False]
    async with host.use("m0") as loaded:
        assert isinstance(loaded.model, EmbeddingModel)
        vector, n_tokens = await loaded.batcher.submit("hello")
        assert vector.shape == (32,) and n_tokens == 3
    assert [s.loaded for s in host.status()] == [True, False, False]
    assert host.memory_used == loaded.model.memory_bytes()
    with pytest.raises(UnknownModel):
        async with host.use("nope"):
            pass


async def test_host_evicts_the_least_recently_used_idle_model(host: ModelHost) -> None:
    for name in ("m0", "m1", "m0"):  # m1 is now the least recently used
        async with host.use(name) as loaded:
            await loaded.batcher.submit("hello")
    async with host.use("m2"):
        assert {s.name for s in host.status() if s.loaded} == {"m0", "m2"}
        assert host.evictions == 1
        assert host.memory_used <= host.memory_budget


async def test_host_does_not_evict_a_busy_model(host: ModelHost) -> None:
    async with host.use("m0"), host.use("m1"):
        with pytest.raises(HostBusy):
            async with host.use("m2"):
                pass
    async with host.use("m2"):  # once they are idle, it fits
        pass


def test_host_refuses_a_model_larger_than_its_budget(three_models: list[Path]) -> None:
    params = _params(three_models[0])
    size = estimate_bytes("embedding", three_models[0], params)
    small = ModelHost(memory_budget=size // 2)
    with pytest.raises(ModelTooLarge, match="memory budget"):
        small.register("big", three_models[0], param_count=params)
    # A model whose files understate it is refused at load time all the same.
    host = ModelHost(memory_budget=size * 4)
    host.register("big", three_models[0], param_count=params)
    host.memory_budget = size // 2
    with pytest.raises(ModelTooLarge):
        host.load("big")
    assert host.memory_used == 0


def test_concurrent_first_uses_load_once(host: ModelHost) -> None:
    with ThreadPoolExecutor(8) as pool:
        loaded = list(pool.map(lambda _: host.load("m1"), range(8)))
    assert all(m is loaded[0] for m in loaded)
    assert host.evictions == 0 and loaded[0].leases == 0
