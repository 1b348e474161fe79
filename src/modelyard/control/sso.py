"""Console sign-in with single sign-on: who an ID token's claims are, and their session.

The verified claims (`control/oidc.py`) name a user this way, first match wins: the user already
linked to this provider's subject; else the one user (of `oidc_tenant`, when set) a tenant
admin created with the token's email, which is linked now; else, when `oidc_tenant` and
`oidc_default_role` are set, a new user of that tenant with that role. The email must be
verified (`email_verified` not false) and, with `oidc_allowed_domains`, of one of those domains,
at every sign-in. The session is a row of `console_sessions` (its token's hash, an expiry);
the sign-in is audited (`user.sign_in`). A user holds at most `MAX_SESSIONS_PER_USER` sessions
(the oldest ends first), and expired ones are dropped at each sign-in.
"""

from __future__ import annotations

import asyncio
import hashlib
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from modelyard.config import PlatformSettings
from modelyard.control.audit import AuditAction, AuditLog, AuditTarget
from modelyard.control.people import user_view
from modelyard.core.errors import Forbidden
from modelyard.core.identity import Principal
from modelyard.protocol.people import MAX_USERS
from modelyard.store import people
from modelyard.store import repository as repo
from modelyard.store.db import Database
from modelyard.store.people_tables import User
from modelyard.store.tables import Tenant

# A user's console sessions at once (signing in again past this ends the oldest).
MAX_SESSIONS_PER_USER = 20


def _refused(message: str) -> Forbidden:
    return Forbidden(f"single sign-on refused: {message}", code="sso_refused")


def subject_of(issuer: str, sub: str) -> str:
    """The stored subject: the provider's `sub` is unique per issuer only."""
    return hashlib.sha256(f"{issuer}\0{sub}".encode()).hexdigest()


def _email(claims: dict[str, Any], allowed: list[str]) -> str:
    email = claims.get("email")
    if not isinstance(email, str) or "@" not in email or len(email) > 254:
        raise _refused("the provider sent no email address (ask for the 'email' scope)")
    if claims.get("email_verified") is False:
        raise _refused("the email address is not verified at the provider")
    email = email.strip().lower()
    if allowed and email.rpartition("@")[2] not in allowed:
        raise _refused("this email domain may not sign in here")
    return email


class ConsoleSignIn:
    def __init__(self, db: Database, audit: AuditLog, settings: PlatformSettings) -> None:
        self.db = db
        self.audit = audit
        self.settings = settings

    def _user_for(self, s: Session, issuer: str, claims: dict[str, Any]) -> tuple[User, bool]:
        """The user, and whether it was made now."""
        st = self.settings
        email = _email(claims, st.oidc_allowed_domains)
        subject = subject_of(issuer, str(claims["sub"]))
        user = people.user_by_subject(s, subject)
        if user is not None:
            return user, False
        tenant = None
        if st.oidc_tenant:
            tenant = s.scalar(select(Tenant).where(Tenant.name == st.oidc_tenant))
            if tenant is None:
                raise _refused(f"the sign-in tenant {st.oidc_tenant!r} does not exist")
        q = select(User).where(User.email == email, User.subject.is_(None))
        if tenant is not None:
            q = q.where(User.tenant_id == tenant.id)
        found = s.scalars(q.limit(2)).all()
        if len(found) > 1:
            raise _refused("this email is a user of several tenants; set oidc_tenant")
        if found:
            found[0].subject = subject
            return found[0], False
        if tenant is None or st.oidc_default_role is None:
            raise _refused(f"{email} is no user here; ask a tenant admin to add you")
        if people.count_users(s, tenant.id) >= MAX_USERS:
            raise _refused("the tenant holds as many users as it may")
        name = claims.get("name")
        name = name[:200] if isinstance(name, str) and name.strip() else None
        return people.add_user(s, tenant.id, email, name, st.oidc_default_role, subject), True

    async def sign_in(self, issuer: str, claims: dict[str, Any], token_hash: str) -> Principal:
        """The user the claims name, signed in: a new console session (stored as
        `token_hash`), returned as the principal it authenticates to."""
        ttl = timedelta(seconds=self.settings.console_session_ttl_s)

        def begin() -> tuple[Principal, dict[str, Any], bool]:
            with self.db.session() as s:
                people.drop_expired_sessions(s)
                user, created = self._user_for(s, issuer, claims)
                s.flush()
                tenant = repo.get_tenant(s, user.tenant_id)
                assert tenant is not None
                row = people.add_session(s, user.id, token_hash, repo.now() + ttl)
                s.flush()
                people.trim_sessions(s, user.id, MAX_SESSIONS_PER_USER)
                principal = Principal.for_session(row, user, tenant)
                return principal, user_view(user, people.user_teams(s, user.id)), created

        principal, view, created = await asyncio.to_thread(begin)
        if created:
            await self.audit.record(principal, AuditAction.USER_CREATE, AuditTarget.USER,
                                    view["id"], None, view, view["tenant_id"])  # fmt: skip
        after = {"session_id": principal.key_id, "email": view["email"], "role": view["role"]}
        await self.audit.record(principal, AuditAction.USER_SIGN_IN, AuditTarget.USER, view["id"],
                                None, after, view["tenant_id"])  # fmt: skip
        return principal

    async def sign_out(self, principal: Principal) -> bool:
        """End the caller's console session (False: the caller is an API key, not one)."""
        if not principal.key_id.startswith("ses-"):
            return False

        def end() -> None:
            with self.db.session() as s:
                people.end_session(s, principal.key_id)

        await asyncio.to_thread(end)
        return True
