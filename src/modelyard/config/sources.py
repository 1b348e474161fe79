"""Where every settings class reads its values: arguments, then `MODELYARD_*` environment
variables, then the TOML file named by `MODELYARD_CONFIG_FILE` (default `./modelyard.toml` when it
exists), then its defaults; and the byte sizes (`512MiB`, `2GB`) settings accept."""

from __future__ import annotations

import os
import re
from pathlib import Path

from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(value: str | int) -> int:
    """Parse a byte size such as `512MiB`, `2GB` or `1048576` into bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a byte size: {value!r} (use e.g. 512MiB, 2GiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _default_config_file() -> Path:
    return Path(os.environ.get("MODELYARD_CONFIG_FILE", "modelyard.toml"))


class SettingsBase(BaseSettings):
    """Arguments, then `MODELYARD_*` environment variables, then the TOML file."""

    model_config = SettingsConfigDict(env_prefix="MODELYARD_", extra="ignore")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = TomlConfigSettingsSource(settings_cls, toml_file=_default_config_file())
        return (init_settings, env_settings, toml)
