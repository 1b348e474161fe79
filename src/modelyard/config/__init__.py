"""Configuration in one place: `MODELYARD_*` environment variables over an optional TOML file.

Precedence (highest first): explicit keyword arguments, environment variables, the TOML file named
by `MODELYARD_CONFIG_FILE` (default `./modelyard.toml` when it exists), then each setting's
default. Every settings class reads its values the same way (`sources.py`); each class lives in
its own module, and every importer takes them from here (`from modelyard.config import ...`):

- `sources.py`: where values come from (`SettingsBase`), byte sizes (`parse_size`);
- `engine_settings.py`: `EngineSettings`, the LLM engine and its worker;
- `process_settings.py`: `TelemetrySettings` (logs, traces, the loop-stall guard) and
  `WorkerAuthSettings`;
- `platform_settings.py`: `PlatformSettings`, `modelyard serve`; `ModelPrice`, `PrefixCacheScope`;
  its single sign-on settings in `sso_settings.py` (`SsoSettings`).
"""

from modelyard.config.engine_settings import BATCH_PRIORITY, EngineSettings
from modelyard.config.platform_settings import (
    ModelPrice,
    PlatformSettings,
    PrefixCacheScope,
    RedisOutage,
)
from modelyard.config.process_settings import TelemetrySettings, WorkerAuthSettings
from modelyard.config.sources import SettingsBase, parse_size

__all__ = [
    "BATCH_PRIORITY",
    "EngineSettings",
    "ModelPrice",
    "PlatformSettings",
    "PrefixCacheScope",
    "RedisOutage",
    "SettingsBase",
    "TelemetrySettings",
    "WorkerAuthSettings",
    "parse_size",
]
