"""API keys of the service: random 256-bit secrets, shown once, stored as SHA-256 hashes.

Each key has one scope: ``read`` (GET routes), ``release`` (read, open sessions, releases) or
``admin`` (release and the audit export); an optional expiry; rotation makes a new key for the same
tenant and scope and expires the old one after a grace period.

A key reads ``gdp_<key_id>_<secret>``. The key id (not secret) finds the row; the hash of the whole key
is compared in constant time. A fast hash is the right tool here: the secret has 256 bits of
entropy, so there is nothing for a slow password hash to protect against (as for GitHub's tokens).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time

from gaussdp.budget.store import ApiKeyRow, KeyStore
from gaussdp.errors import InvalidParameter

__all__ = [
    "SCOPES",
    "TENANT_PATTERN",
    "check_api_key",
    "create_api_key",
    "hash_api_key",
    "key_id_of",
    "rotate_api_key",
    "scope_allows",
    "verify_api_key",
]

SCOPES = ("read", "release", "admin")  # each allows what the ones before it allow

TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_KEY = re.compile(r"^gdp_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_tenant(tenant: object) -> str:
    if not isinstance(tenant, str) or not re.match(TENANT_PATTERN, tenant):
        raise InvalidParameter(
            "tenant must be 1 to 64 characters of letters, digits, '_', '.', '-' (not first), "
            f"got tenant={tenant!r}"
        )
    return tenant


def scope_allows(scope: str, needed: str) -> bool:
    """Whether a key of ``scope`` may use a route that needs ``needed``."""
    return scope in SCOPES and SCOPES.index(scope) >= SCOPES.index(needed)


def create_api_key(
    store: KeyStore, tenant: str, *, scope: str = "release", expires_at: float | None = None
) -> str:
    """Create and store a key for ``tenant``; return the key itself (it is not stored, show it once).

    Args:
        scope: ``read``, ``release`` (default) or ``admin``.
        expires_at: unix time after which the key is refused; ``None``: never.
    """
    check_tenant(tenant)
    if scope not in SCOPES:
        raise InvalidParameter(f"scope must be one of {', '.join(SCOPES)}, got scope={scope!r}")
    if expires_at is not None and not (isinstance(expires_at, int | float) and expires_at == expires_at):
        raise InvalidParameter(f"expires_at must be a unix time or None, got expires_at={expires_at!r}")
    key_id = secrets.token_hex(8)
    key = f"gdp_{key_id}_{secrets.token_urlsafe(32)}"
    row = ApiKeyRow(key_id, tenant, hash_api_key(key), time.time(), False, scope, expires_at)
    store.put_api_key(row)
    return key


def rotate_api_key(store: KeyStore, key_id: str, *, grace_s: float = 3600.0) -> str:
    """A new key with the tenant and scope of ``key_id``; the old one expires ``grace_s`` from now.

    Raises:
        InvalidParameter: no such key, it is revoked or expired, or a negative grace.
    """
    if not grace_s >= 0:
        raise InvalidParameter(f"grace_s must be >= 0, got grace_s={grace_s!r}")
    old = store.get_api_key(key_id)
    now = time.time()
    if old is None or old.revoked or (old.expires_at is not None and old.expires_at <= now):
        raise InvalidParameter(f"no valid key with id {key_id!r} to rotate")
    key = create_api_key(store, old.tenant, scope=old.scopes, expires_at=old.expires_at)
    store.expire_api_key(key_id, now + grace_s)
    return key


def key_id_of(key: str) -> str:
    """The (public) id part of a well-formed key."""
    m = _KEY.match(key)
    if m is None:
        raise ValueError("not a gaussdp API key")
    return m.group(1)


def check_api_key(store: KeyStore, key: str, now: float | None = None) -> ApiKeyRow | None:
    """The stored row of a valid key (well formed, known, matching, unrevoked, unexpired); else None."""
    m = _KEY.match(key or "")
    if m is None:
        return None
    row = store.get_api_key(m.group(1))
    if row is None or row.revoked:
        return None
    if row.expires_at is not None and row.expires_at <= (time.time() if now is None else now):
        return None
    if not hmac.compare_digest(row.key_hash, hash_api_key(key)):
        return None
    return row


def verify_api_key(store: KeyStore, key: str) -> str | None:
    """The tenant of a valid key; ``None`` otherwise."""
    row = check_api_key(store, key)
    return None if row is None else row.tenant
