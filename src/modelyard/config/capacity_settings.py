"""`CapacitySettings`: where replicas' nodes come from (static or Ray's autoscaler, on-demand and
spot classes) and how much of a warm replica batch backfill may take; part of `PlatformSettings`
with the gateways' access settings (`AccessSettings`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from modelyard.config.access_settings import AccessSettings


class CapacitySettings(AccessSettings):
    backfill_reserved_slots: int = Field(
        0,
        ge=0,
        le=4096,
        description="Slots of each replica batch items leave to interactive "
        "bursts (backfill: an item goes to a warm replica only while it reports more free slots "
        "than this and admission_tokens_per_request free KV tokens).",
    )
    node_provider: Literal["static", "ray"] = Field(
        "static",
        description="static (the nodes there are) or ray (nodes carry a "
        "modelyard.node_class.on-demand or .spot resource; a replica no node has room for asks "
        "Ray's autoscaler for one; a node idle node_idle_release_s is drained; docs/scaling.md).",
    )
    node_idle_release_s: float = Field(
        300.0, gt=0, le=86_400, description="ray nodes: one that held nothing this long goes."
    )
    spot_policy: Literal["batch", "overflow", "never"] = Field(
        "batch",
        description="node_provider ray: which replicas may run on spot nodes: batch (those of "
        "endpoints with hardware.workload batch, spot first), overflow (real-time ones too, "
        "once on-demand nodes are full) or never.",
    )
