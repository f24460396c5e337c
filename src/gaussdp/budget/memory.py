"""In-process ledger store (``memory://``): a dict behind one lock. Nothing survives the process."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from gaussdp.budget.store import (
    ApiKeyRow,
    Decide,
    PrincipalRow,
    StoredCharge,
    TenantLimitExceeded,
    TenantLimits,
    UnknownPrincipal,
    cap_message,
    replayed_charge,
)

__all__ = ["MemoryStore"]


class MemoryStore:
    """Thread-safe, not durable: for tests, notebooks and single-process experiments."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._principals: dict[str, PrincipalRow] = {}
        self._groups: dict[str, dict[str, int]] = {}
        self._charges: dict[str, list[StoredCharge]] = {}
        self._by_key: dict[tuple[str, str], StoredCharge] = {}
        self._keys: dict[str, ApiKeyRow] = {}
        self._tenants: dict[str, TenantLimits] = {}
        self._next_id = 1

    def open_principal(self, principal: str, epsilon: float, delta: float, accountant: str) -> PrincipalRow:
        with self._lock:
            return self._open_locked(principal, epsilon, delta, accountant)

    def _open_locked(self, principal: str, epsilon: float, delta: float, accountant: str) -> PrincipalRow:
        row = self._principals.get(principal)
        if row is None:
            row = PrincipalRow(principal, epsilon, delta, accountant, time.time())
            self._principals[principal] = row
            self._groups[principal] = {}
            self._charges[principal] = []
        return row

    def get_principal(self, principal: str) -> PrincipalRow | None:
        with self._lock:
            return self._principals.get(principal)

    def list_principals(self, prefix: str = "") -> list[str]:
        with self._lock:
            return sorted(p for p in self._principals if p.startswith(prefix))

    def groups(self, principal: str) -> dict[str, int]:
        with self._lock:
            if principal not in self._principals:
                raise UnknownPrincipal(f"principal {principal!r} was never opened on this ledger")
            return dict(self._groups[principal])

    def charge(
        self,
        principal: str,
        event_key: str,
        idempotency_key: str | None,
        decide: Decide,
        key_id: str | None = None,
    ) -> StoredCharge:
        with self._lock:
            row = self._principals.get(principal)
            if row is None:
                raise UnknownPrincipal(f"principal {principal!r} was never opened on this ledger")
            if idempotency_key is not None:
                earlier = self._by_key.get((principal, idempotency_key))
                if earlier is not None:
                    return replayed_charge(earlier, event_key)
            groups = self._groups[principal]
            within = decide(row, groups)  # may raise: nothing below runs, nothing is recorded
            charge = StoredCharge(
                self._next_id, principal, event_key, idempotency_key, time.time(), within, key_id=key_id
            )
            self._next_id += 1
            groups[event_key] = groups.get(event_key, 0) + 1
            self._charges[principal].append(charge)
            if idempotency_key is not None:
                self._by_key[(principal, idempotency_key)] = charge
            return charge

    def history(self, principal: str, limit: int | None = None) -> list[StoredCharge]:
        with self._lock:
            if principal not in self._principals:
                raise UnknownPrincipal(f"principal {principal!r} was never opened on this ledger")
            charges = self._charges[principal]
            return list(charges if limit is None else charges[-limit:])

    def charges_after(
        self, prefix: str, after_id: int, limit: int, *, exact: bool = False
    ) -> list[StoredCharge]:
        with self._lock:
            if exact:
                found = [c for c in self._charges.get(prefix, []) if c.charge_id > after_id]
            else:
                found = [
                    c
                    for p, cs in self._charges.items()
                    if p.startswith(prefix)
                    for c in cs
                    if c.charge_id > after_id
                ]
            return sorted(found, key=lambda c: c.charge_id)[:limit]

    def put_api_key(self, row: ApiKeyRow) -> None:
        with self._lock:
            self._keys[row.key_id] = row

    def get_api_key(self, key_id: str) -> ApiKeyRow | None:
        with self._lock:
            return self._keys.get(key_id)

    def list_api_keys(self) -> list[ApiKeyRow]:
        with self._lock:
            return sorted(self._keys.values(), key=lambda r: (r.tenant, r.created_at))

    def revoke_api_key(self, key_id: str) -> bool:
        with self._lock:
            row = self._keys.get(key_id)
            if row is None:
                return False
            self._keys[key_id] = replace(row, revoked=True)
            return True

    def expire_api_key(self, key_id: str, expires_at: float) -> bool:
        with self._lock:
            row = self._keys.get(key_id)
            if row is None:
                return False
            at = expires_at if row.expires_at is None else min(row.expires_at, expires_at)
            self._keys[key_id] = replace(row, expires_at=at)
            return True

    def open_principal_within(
        self, principal: str, epsilon: float, delta: float, accountant: str, tenant: str
    ) -> PrincipalRow:
        with self._lock:  # the check and the open under one lock: concurrent opens count once
            caps = self._tenants.get(tenant)
            if principal not in self._principals and caps is not None:
                if (caps.max_sessions is not None and caps.sessions + 1 > caps.max_sessions) or (
                    caps.max_epsilon is not None and caps.epsilon_granted + epsilon > caps.max_epsilon
                ):
                    raise TenantLimitExceeded(cap_message(tenant, epsilon))
                self._tenants[tenant] = replace(
                    caps, sessions=caps.sessions + 1, epsilon_granted=caps.epsilon_granted + epsilon
                )
            return self._open_locked(principal, epsilon, delta, accountant)

    def set_tenant_limits(self, tenant: str, max_sessions: int | None, max_epsilon: float | None) -> None:
        with self._lock:
            mine = [r for p, r in self._principals.items() if p.startswith(tenant + "/")]
            self._tenants[tenant] = TenantLimits(
                tenant, max_sessions, max_epsilon, len(mine), sum(r.epsilon for r in mine)
            )

    def get_tenant_limits(self, tenant: str) -> TenantLimits | None:
        with self._lock:
            return self._tenants.get(tenant)

    def ping(self) -> None:
        """Always reachable (it is this process)."""

    def close(self) -> None:
        pass
