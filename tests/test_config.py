"""Configuration: defaults, the TOML file, environment variables over it, and size parsing."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from modelyard.config import EngineSettings, PlatformSettings, parse_size


def test_sizes() -> None:
    assert parse_size("1GiB") == 2**30
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size(1234) == 1234
    with pytest.raises(ValueError, match="byte size"):
        parse_size("lots")


def test_toml_file_then_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "modelyard.toml"
    config.write_text(
        'kv_cache_memory = "256MiB"\nmax_num_seqs = 8\nport = 9000\n'
        "[prices.tiny]\ninput = 0.5\noutput = 1.5\n"
    )
    monkeypatch.setenv("MODELYARD_CONFIG_FILE", str(config))
    engine = EngineSettings()
    assert engine.kv_cache_memory == 256 * 2**20 and engine.max_num_seqs == 8
    platform = PlatformSettings()
    assert platform.port == 9000 and platform.prices["tiny"].output == 1.5
    monkeypatch.setenv("MODELYARD_MAX_NUM_SEQS", "4")
    monkeypatch.setenv("MODELYARD_PORT", "9100")
    assert EngineSettings().max_num_seqs == 4  # the environment wins over the file
    assert PlatformSettings().port == 9100
    assert EngineSettings(max_num_seqs=2).max_num_seqs == 2  # and arguments over both


def test_bad_values_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODELYARD_CONFIG_FILE", "/nonexistent.toml")
    monkeypatch.setenv("MODELYARD_DTYPE", "float16")
    with pytest.raises(ValidationError, match="dtype"):
        EngineSettings()


def test_a_deploys_lookup_ngrams_are_bounded() -> None:
    """A draft's n-gram search is a loop per step over each length up to prompt_lookup_max."""
    assert EngineSettings(prompt_lookup_max=16).prompt_lookup_max == 16
    for field in ("prompt_lookup_min", "prompt_lookup_max"):
        with pytest.raises(ValidationError, match=field):
            EngineSettings(**{field: 10**9})
