"""API keys of the service: random 256-bit secrets, shown once, stored as SHA-256 hashes.

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

from gaussdp.budget.store import ApiKeyRow, Store
from gaussdp.errors import InvalidParameter

__all__ = ["TENANT_PATTERN", "create_api_key", "hash_api_key", "key_id_of", "verify_api_key"]

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


def create_api_key(store: Store, tenant: str) -> str:
    """Create and store a key for ``tenant``; return the key itself (it is not stored, show it once)."""
    check_tenant(tenant)
    key_id = secrets.token_hex(8)
    key = f"gdp_{key_id}_{secrets.token_urlsafe(32)}"
    store.put_api_key(ApiKeyRow(key_id, tenant, hash_api_key(key), time.time(), False))
    return key


def key_id_of(key: str) -> str:
    """The (public) id part of a well-formed key."""
    m = _KEY.match(key)
    if m is None:
        raise ValueError("not a gaussdp API key")
    return m.group(1)


def verify_api_key(store: Store, key: str) -> str | None:
    """The tenant of a valid, unrevoked key; ``None`` otherwise."""
    m = _KEY.match(key or "")
    if m is None:
        return None
    row = store.get_api_key(m.group(1))
    if row is None or row.revoked:
        return None
    if not hmac.compare_digest(row.key_hash, hash_api_key(key)):
        return None
    return row.tenant
