"""The global options (`--profile`, `--url`, `--api-key`) and the client they select."""

from __future__ import annotations

from dataclasses import dataclass

from modelyard.cli_commands.client import PlatformClient
from modelyard.cli_commands.profiles import Target, resolve


@dataclass
class Selection:
    profile: str | None = None
    url: str | None = None
    api_key: str | None = None


# Set by the app's callback before any subcommand runs (once per invocation).
selection = Selection()


def target() -> Target:
    return resolve(selection.profile, selection.url, selection.api_key)


def resolve_with(url: str | None, api_key: str | None) -> Target:
    """As `target()`, a command's own --url/--api-key taking precedence over the global ones."""
    return resolve(selection.profile, url or selection.url, api_key or selection.api_key)


def client(timeout: float = 60.0) -> PlatformClient:
    return PlatformClient(target(), timeout=timeout)
