"""An endpoint's configuration (its `hardware`, `scaling`, `engine` and `sampling_defaults`
blocks) parsed into what the control plane runs it with, in one place.

The same parse runs at deploy and at a PATCH, before anything is written (a bad block is a 400
and leaves nothing behind), and again when a stored row is adopted at a start or at a
controller's takeover, where a row that no longer parses is refused (the endpoint is marked
failed, with why) instead of stopping the process: what a tenant stores can never keep the
platform from starting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from modelyard.config import EngineSettings, PlatformSettings
from modelyard.control.autoscaler import ScalingPolicy
from modelyard.control.state import engine_env
from modelyard.core.errors import Invalid
from modelyard.protocol.management import Hardware, SamplingDefaults, Scaling

M = TypeVar("M", bound=BaseModel)


@dataclass(frozen=True)
class EndpointConfig:
    policy: ScalingPolicy
    engine_env: dict[str, str]  # the endpoint's engine options as the worker's env vars
    engine: EngineSettings  # effective: the platform's worker defaults under the endpoint's
    sampling_defaults: dict[str, Any]
    min_replicas: int


def parse(
    settings: PlatformSettings,
    hardware: Any,
    scaling: Any,
    engine: Any,
    sampling_defaults: Any,
    stored: bool = False,
) -> EndpointConfig:
    """The blocks checked and turned into the running configuration; `Invalid` naming the field
    when one is wrong. `stored`: blocks read back from the database, where fields this version
    does not know (older versions let `scaling` carry any key) are dropped, not refused."""
    hw = _block(Hardware, hardware, "hardware", stored)
    sc = _block(Scaling, scaling, "scaling", stored)
    sd = _block(SamplingDefaults, sampling_defaults or {}, "sampling_defaults", stored)
    if not isinstance(engine, dict):
        raise Invalid("engine must be an object of engine options", param="engine")
    env, _ = engine_env(engine)
    try:
        effective = EngineSettings(**{**settings.worker_engine, **engine})
    except ValidationError as exc:
        raise _invalid(exc, "engine") from exc
    return EndpointConfig(
        policy=ScalingPolicy.from_deploy(hw.model_dump(), sc.model_dump()),
        engine_env=env,
        engine=effective,
        sampling_defaults=sd.model_dump(exclude_none=True),
        min_replicas=hw.min_replicas,
    )


def parse_scaling(hardware: Any, scaling: Scaling) -> ScalingPolicy:
    """A PATCH's new scaling block against the endpoint's hardware (already accepted)."""
    hw = _block(Hardware, hardware, "hardware", stored=True)
    return ScalingPolicy.from_deploy(hw.model_dump(), scaling.model_dump())


def _block(model: type[M], value: Any, name: str, stored: bool) -> M:
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if not isinstance(value, dict):
        raise Invalid(f"{name} must be an object", param=name)
    if stored:
        value = {k: v for k, v in value.items() if k in model.model_fields}
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        raise _invalid(exc, name) from exc


def _invalid(exc: ValidationError, name: str) -> Invalid:
    first = exc.errors()[0]
    where = ".".join([name, *(str(p) for p in first.get("loc", ()))])
    return Invalid(f"{where}: {first['msg']}", param=where)
