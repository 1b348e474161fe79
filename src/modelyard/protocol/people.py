"""Request bodies of the users and teams API, validated at the edge: unknown fields refused,
every string bounded, an email checked for its shape (not deliverability)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

RoleName = Literal["admin", "developer", "viewer"]
# local@domain: no spaces, one @, a dot in the domain; 254 is the SMTP path limit.
Email = Annotated[
    str,
    StringConstraints(
        strip_whitespace=True, to_lower=True, max_length=254, pattern=r"^[^@\s]+@[^@\s]+\.[^@\s]+$"
    ),
]
Name = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1, max_length=200)]
# A tenant's users and teams, each; past this a tenant is an identity provider's job.
MAX_USERS = 10_000
MAX_TEAMS = 1_000


class UserCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    email: Email
    name: Name | None = None
    role: RoleName = Field("developer", description="admin, developer or viewer.")
    tenant_id: str | None = Field(
        None, max_length=64, description="Platform admin only: whose user this is."
    )


class UserUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name | None = None
    role: RoleName | None = None


class TeamCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name
    tenant_id: str | None = Field(
        None, max_length=64, description="Platform admin only: whose team this is."
    )


class MemberAdd(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: str = Field(min_length=1, max_length=64)
