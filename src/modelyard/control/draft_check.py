"""Deploy check of a draft model (`engine.speculative_model`, speculative decoding): the caller
may read it, it exists, and its vocabulary is the model's; otherwise a 400 naming the field at
deploy, not a replica that fails to load later. The worker checks the tokenizers themselves
again when it loads both (`engine/draft_model.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from modelyard.config import PlatformSettings
from modelyard.control.registry import Registry, ResolvedVersion
from modelyard.core.errors import Invalid
from modelyard.core.gguf_header import TOKENS_COUNT, gguf_ints
from modelyard.core.identity import Principal
from modelyard.core.model_file_limits import (
    MAX_CONFIG_BYTES,
    ModelFileError,
    Reader,
    bounded_json,
    read_exact,
)

FIELD = "engine.speculative_model"


def _vocab_from_config(raw: Any) -> int | None:
    if not isinstance(raw, dict):
        return None
    for cfg in (raw, raw.get("text_config")):
        if isinstance(cfg, dict) and isinstance(cfg.get("vocab_size"), int):
            return int(cfg["vocab_size"])
    return None


def _vocab_from_gguf(reader: Reader, name: str) -> int | None:
    meta = gguf_ints(reader, name)
    sizes = [v for k, v in meta.items() if k.endswith(".vocab_size")]
    return sizes[0] if sizes else meta.get(TOKENS_COUNT)


def vocab_of_path(path: Path) -> int | None:
    """The vocabulary size of a model folder's config.json or of a .gguf file (None: unknown)."""
    try:
        if path.is_file():
            with path.open("rb") as f:
                return _vocab_from_gguf(f, path.name)
        config = path / "config.json"
        size = config.stat().st_size
        if size > MAX_CONFIG_BYTES:
            return None
        with config.open("rb") as f:
            return _vocab_from_config(bounded_json(read_exact(f, size, "config.json"), "config"))
    except (OSError, ModelFileError):
        return None


def vocab_of_version(registry: Registry, version: ResolvedVersion) -> int | None:
    """The vocabulary size of a registry version (its config.json, else its .gguf file)."""
    store = registry.store
    try:
        if "config.json" in version.files:
            sha = version.files["config.json"]
            size = store.size(sha)
            if size > MAX_CONFIG_BYTES:
                return None
            reader = store.open(sha)
            try:
                raw = bounded_json(read_exact(reader, size, "config.json"), "config.json")
            finally:
                reader.close()
            return _vocab_from_config(raw)
        gguf = next((p for p in version.files if p.endswith(".gguf")), None)
        if gguf is None:
            return None
        reader = store.open(version.files[gguf])
        try:
            return _vocab_from_gguf(reader, gguf)
        finally:
            reader.close()
    except (OSError, ModelFileError):
        return None


def draft_path(settings: PlatformSettings, principal: Principal, raw: Any) -> Path:
    """Where the draft model lies: a bundled model, or an absolute path that exists (under
    `local_artifact_roots` unless the caller is the platform admin)."""
    from modelyard.engine.models.bundled import BUNDLED_MODELS, resolve_model_path  # torch-free

    name = str(raw)
    if name.lower() in BUNDLED_MODELS:
        try:
            return resolve_model_path(name)
        except Exception as exc:
            raise Invalid(f"{FIELD}: {exc}", param=FIELD, code="artifact_not_found") from exc
    path = Path(name)
    roots = [r.resolve() for r in settings.local_artifact_roots]
    allowed = principal.platform_admin or any(path.resolve().is_relative_to(r) for r in roots)
    if not path.is_absolute() or not allowed:
        raise Invalid(
            f"{FIELD} must be a bundled model ({', '.join(BUNDLED_MODELS)}) or an absolute path "
            f"under MODELYARD_LOCAL_ARTIFACT_ROOTS ({', '.join(map(str, roots)) or 'none'})",
            param=FIELD,
            code="path_not_allowed",
        )
    if not path.exists():
        raise Invalid(f"{FIELD}: {path} does not exist", param=FIELD, code="artifact_not_found")
    return path.resolve()


def check_draft_model(
    settings: PlatformSettings,
    principal: Principal,
    engine: dict[str, Any],
    registry: Registry,
    target_path: Path | None,
    target_version: ResolvedVersion | None,
) -> None:
    """Refuse (400 naming `engine.speculative_model`) a draft the caller may not read, that does
    not exist, or whose vocabulary differs from the model's."""
    raw = engine.get("speculative_model")
    if raw is None:
        return
    draft_vocab = vocab_of_path(draft_path(settings, principal, raw))
    if draft_vocab is None:
        raise Invalid(
            f"{FIELD}: not a model (no vocab_size in its config.json, no GGUF vocabulary)",
            param=FIELD,
            code="invalid_draft_model",
        )
    if target_path is not None:
        target_vocab = vocab_of_path(target_path)
    elif target_version is not None:
        target_vocab = vocab_of_version(registry, target_version)
    else:
        target_vocab = None
    if target_vocab is not None and target_vocab != draft_vocab:
        raise Invalid(
            f"{FIELD}: the draft model's vocabulary has {draft_vocab} tokens and the model's "
            f"{target_vocab}; a draft model must share the model's tokenizer",
            param=FIELD,
            code="draft_model_mismatch",
        )
