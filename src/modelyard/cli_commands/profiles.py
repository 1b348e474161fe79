"""Where the CLI finds the platform's URL and API key: flags, then the environment, then a
profile of `$XDG_CONFIG_HOME/modelyard/config.toml` (default `~/.config/...`)."""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
# `modelyard serve` keeps its admin key here (next to where it was started, by default).
LOCAL_ADMIN_KEY = Path(".modelyard") / "admin_key"


class ProfileError(ValueError):
    """The config file or the chosen profile is unusable; its message says why."""


def platform_url(url: str) -> str:
    """The platform's base URL: given with or without the OpenAI base path (`…/v1`, what the
    serve banner and the OpenAI SDKs use), the same one, since every command names its path."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[: -len("/v1")].rstrip("/")
    return url


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "modelyard" / "config.toml"


def load_config(path: Path | None = None) -> dict[str, Any]:
    path = path or config_path()
    if not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{path} is not valid TOML: {exc}") from exc


@dataclass(frozen=True)
class Target:
    """The platform a command talks to, and where each half of it came from (for `whoami`)."""

    url: str
    api_key: str | None
    url_from: str
    key_from: str


def resolve(
    profile: str | None = None, url: str | None = None, api_key: str | None = None
) -> Target:
    """Each of URL and key, first found wins: the flag, then `MODELYARD_URL` /
    `MODELYARD_API_KEY`, then the profile (`--profile`, else `MODELYARD_PROFILE`, else the file's
    `default_profile`), then the defaults (local URL; `.modelyard/admin_key` if present)."""
    config = load_config()
    name = profile or os.environ.get("MODELYARD_PROFILE") or config.get("default_profile")
    profiles = config.get("profiles", {})
    chosen: dict[str, Any] = {}
    if name:
        if name not in profiles:
            if profile or os.environ.get("MODELYARD_PROFILE"):  # asked for explicitly
                known = ", ".join(sorted(profiles)) or "none"
                raise ProfileError(f"no profile {name!r} in {config_path()} (profiles: {known})")
        else:
            chosen = profiles[name]
    where = f"profile {name}"
    url_found = _first(
        (url, "--url"),
        (os.environ.get("MODELYARD_URL"), "MODELYARD_URL"),
        (chosen.get("url"), where),
        (DEFAULT_URL, "default"),
    )
    local_key = LOCAL_ADMIN_KEY.read_text().strip() if LOCAL_ADMIN_KEY.is_file() else None
    key_found = _first(
        (api_key, "--api-key"),
        (os.environ.get("MODELYARD_API_KEY"), "MODELYARD_API_KEY"),
        (chosen.get("api_key"), where),
        (local_key, str(LOCAL_ADMIN_KEY)),
        (None, "none"),
    )
    return Target(platform_url(str(url_found[0])), key_found[0], url_found[1], key_found[1])


def _first(*candidates: tuple[str | None, str]) -> tuple[str | None, str]:
    for value, source in candidates:
        if value:
            return value, source
    return candidates[-1]


def save_profile(name: str, url: str, api_key: str, make_default: bool = True) -> Path:
    """Write (or replace) `[profiles.NAME]`, keeping the other profiles; the file is the owner's
    alone (mode 0600, created so, never world-readable even for an instant)."""
    path = config_path()
    config = load_config(path)
    config.setdefault("profiles", {})[name] = {"url": url, "api_key": api_key}
    if make_default or not config.get("default_profile"):
        config["default_profile"] = name
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".toml.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(_to_toml(config))
    os.chmod(tmp, 0o600)  # an older tmp file may have had another mode
    os.replace(tmp, path)
    return path


def _to_toml(config: dict[str, Any]) -> str:
    """The small subset of TOML this file holds: top-level strings and string tables under
    `profiles` (a JSON string is a valid TOML basic string for the characters keys and URLs use)."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in config.items() if not isinstance(v, dict)]
    for name, profile in config.get("profiles", {}).items():
        lines += ["", f"[profiles.{json.dumps(name)}]"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in profile.items()]
    return "\n".join(lines) + "\n"
