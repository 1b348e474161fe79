"""The answers of the users, teams and sign-in routes as documented models (`openapi_edge.py`
puts them on the routes with the other management answers): what `control/people.py` and
`api/routes_sso.py` return."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class User(BaseModel):
    id: str
    object: Literal["user"]
    tenant_id: str
    email: str
    name: str | None
    role: Literal["admin", "developer", "viewer"]
    sso: bool = Field(description="Linked to the single sign-on provider's subject.")
    teams: list[str]
    created_at: int


class UserList(BaseModel):
    object: Literal["list"]
    data: list[User]
    has_more: bool


class Team(BaseModel):
    id: str
    object: Literal["team"]
    tenant_id: str
    name: str
    members: list[str] = Field(description="The members' user ids.")
    created_at: int


class TeamList(BaseModel):
    object: Literal["list"]
    data: list[Team]


class PersonDeleted(BaseModel):
    id: str
    object: Literal["user", "team"]
    deleted: bool


class Caller(BaseModel):
    object: Literal["caller"]
    key_id: str
    tenant_id: str
    tenant_name: str
    scopes: list[str]
    role: Literal["admin", "developer", "viewer"] | None
    user: dict[str, Any] | None = Field(description="The user behind the key or session.")
    team_id: str | None
    platform_admin: bool


class AuthConfig(BaseModel):
    object: Literal["auth.config"]
    api_key: bool
    oidc: bool = Field(description="Single sign-on is configured.")


class SignedOut(BaseModel):
    object: Literal["auth.logout"]
    ended: bool


PEOPLE_RESPONSES: dict[tuple[str, str], type[BaseModel]] = {
    ("get", "/v1/me"): Caller,
    ("post", "/v1/users"): User,
    ("get", "/v1/users"): UserList,
    ("get", "/v1/users/{user_id}"): User,
    ("patch", "/v1/users/{user_id}"): User,
    ("delete", "/v1/users/{user_id}"): PersonDeleted,
    ("post", "/v1/teams"): Team,
    ("get", "/v1/teams"): TeamList,
    ("get", "/v1/teams/{team_id}"): Team,
    ("delete", "/v1/teams/{team_id}"): PersonDeleted,
    ("post", "/v1/teams/{team_id}/members"): Team,
    ("delete", "/v1/teams/{team_id}/members/{user_id}"): Team,
    ("get", "/v1/auth/config"): AuthConfig,
    ("post", "/v1/auth/logout"): SignedOut,
}
