"""Who makes a request: API key -> (tenant, key id, scope, expiry), verified against the ledger's
store and remembered for at most :data:`KEY_CACHE_SECONDS` (so that a revoked key stops working
within that time in every worker process)."""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

from gaussdp.budget import Ledger
from gaussdp.service.keys import check_api_key, key_id_of

__all__ = ["KEY_CACHE_SECONDS", "Caller", "KeyCache"]

# A verified key is remembered this long: a revoked key stops working within it, in every worker.
KEY_CACHE_SECONDS = 0.5  # half the 1 s promise: room for a loaded machine


class Caller(NamedTuple):
    """Who makes a request: the tenant of the API key, the key's id (recorded with each charge), its
    scope, and its expiry."""

    tenant: str
    key_id: str
    scope: str = "release"
    expires_at: float | None = None


class KeyCache:
    """API key -> tenant, verified against the store, remembered for a short while (revocation lag)."""

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger
        self._cache: dict[str, tuple[Caller, float]] = {}
        self._alive: dict[str, tuple[bool, float]] = {}  # key id -> (valid, when checked)
        self._lock = threading.Lock()

    def tenant(self, key: str) -> Caller | None:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None and now - hit[1] < KEY_CACHE_SECONDS:
            expires_at = hit[0].expires_at
            return hit[0] if expires_at is None or time.time() < expires_at else None
        row = check_api_key(self._ledger.store, key)
        if row is None:
            return None
        caller = Caller(row.tenant, key_id_of(key), row.scopes, row.expires_at)
        with self._lock:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[key] = (caller, now)
        return caller

    def alive(self, caller: Caller) -> bool:
        """Whether the key that authenticated ``caller`` is still valid (not revoked, not expired),
        as the store said at most :data:`KEY_CACHE_SECONDS` ago: what a long request (a stream)
        asks before each charge, so that a revoked key stops being charged within 1 s."""
        if caller.expires_at is not None and time.time() >= caller.expires_at:
            return False
        now = time.monotonic()
        with self._lock:
            hit = self._alive.get(caller.key_id)
        if hit is not None and now - hit[1] < KEY_CACHE_SECONDS:
            return hit[0]
        row = self._ledger.store.get_api_key(caller.key_id)
        valid = (
            row is not None and not row.revoked and (row.expires_at is None or time.time() < row.expires_at)
        )
        with self._lock:
            if len(self._alive) > 10_000:
                self._alive.clear()
            self._alive[caller.key_id] = (valid, now)
        return valid
