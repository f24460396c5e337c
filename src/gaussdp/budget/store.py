"""The storage interface every ledger store implements, and the URL -> store factory.

A store knows nothing about privacy: it keeps principals with their budgets, the events charged to
each principal *grouped* as ``(event_key, count)`` (so that composing a whole history costs
O(number of distinct events), not O(number of charges)), the log of individual charges (with their
idempotency keys) (:class:`LedgerStore`), and the service's hashed API keys and tenant caps
(:class:`KeyStore`); every store is both (:class:`Store`). The one privacy-relevant duty of a store
is :meth:`LedgerStore.charge`: the decision callback runs while the principal is locked (serialisable per
principal), and the new charge is written in the same transaction, or not at all. The callback only
compares counts (the ledger runs the accountant before taking the lock); when the history it is
shown needs a new decision it raises, the store rolls back, and the ledger decides again outside.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from gaussdp.errors import InvalidParameter, PrivacyError

__all__ = [
    "ApiKeyRow",
    "IdempotencyKeyUsed",
    "KeyStore",
    "LedgerContention",
    "LedgerStore",
    "PrincipalConflict",
    "PrincipalRow",
    "Store",
    "StoreUnavailable",
    "StoredCharge",
    "TenantLimitExceeded",
    "TenantLimits",
    "UnknownPrincipal",
    "open_store",
    "replayed_charge",
]

_MAX_PRINCIPAL_LEN = 256
_MAX_KEY_LEN = 256
# Principals and idempotency keys are opaque strings; control characters are refused so that logs and
# exported ledgers stay readable.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class PrincipalConflict(InvalidParameter):
    """The principal is already open with a different budget or accountant (budgets never change)."""


class LedgerContention(PrivacyError):
    """A charge was retried too often because concurrent charges kept changing the principal's
    history under it; nothing was charged, and retrying later is safe."""


class IdempotencyKeyUsed(PrivacyError):
    """An idempotency key was already charged, and what was released under that charge was already
    answered: nothing new is charged or released (a second noisy value would not be covered by the
    one charge). Raised by :meth:`Ledger.release` and by ``Ledger.charge(..., fresh=True)``.

    Attributes:
        receipt: the earlier charge's receipt (``replayed=True``).
    """

    def __init__(self, message: str, receipt: Any) -> None:
        super().__init__(message)
        self.receipt = receipt


class StoreUnavailable(RuntimeError):
    """The ledger's database cannot be reached (or the connection broke mid-request).

    Fail closed: whatever was being released is not released. A charge whose connection broke after
    its write was sent may or may not be on record (budget lost at worst, never privacy).
    """


class UnknownPrincipal(KeyError):
    """No principal of that name was opened on this ledger."""

    def __str__(self) -> str:  # KeyError would print the repr of its argument
        return str(self.args[0]) if self.args else "unknown principal"


@dataclass(frozen=True)
class PrincipalRow:
    principal: str
    epsilon: float
    delta: float
    accountant: str
    created_at: float


@dataclass(frozen=True)
class StoredCharge:
    charge_id: int
    principal: str
    event_key: str
    idempotency_key: str | None
    created_at: float
    within_budget: bool
    replayed: bool = False
    key_id: str | None = None  # the API key that made the charge (service), if any


@dataclass(frozen=True)
class ApiKeyRow:
    key_id: str
    tenant: str
    key_hash: str
    created_at: float
    revoked: bool
    scopes: str = "release"  # space-separated: read, release, admin
    expires_at: float | None = None  # unix time; None: never


@dataclass(frozen=True)
class TenantLimits:
    """Caps on what a tenant may grant its sessions, and the counters checked against them."""

    tenant: str
    max_sessions: int | None
    max_epsilon: float | None
    sessions: int = 0
    epsilon_granted: float = 0.0


class TenantLimitExceeded(PrivacyError):
    """Opening the session would pass its tenant's cap on sessions or on total epsilon granted."""


def cap_message(tenant: str, epsilon: float) -> str:
    return (
        f"tenant {tenant!r}: opening this session (epsilon={epsilon!r}) would pass the tenant's cap on "
        "sessions or on total epsilon granted; nothing was opened"
    )


# decide(principal_row, groups) -> within_budget; raises (e.g. BudgetExhausted) to record nothing.
Decide = Callable[[PrincipalRow, Mapping[str, int]], bool]


class LedgerStore(Protocol):
    """What :class:`gaussdp.budget.Ledger` needs from a database: principals and their charges."""

    def open_principal(self, principal: str, epsilon: float, delta: float, accountant: str) -> PrincipalRow:
        """Create the principal if missing; return the stored row (which may predate this call)."""

    def get_principal(self, principal: str) -> PrincipalRow | None: ...

    def list_principals(self, prefix: str = "") -> list[str]: ...

    def groups(self, principal: str) -> dict[str, int]:
        """A snapshot of ``event_key -> count`` (no lock; for cache warming and reports)."""

    def charge(
        self,
        principal: str,
        event_key: str,
        idempotency_key: str | None,
        decide: Decide,
        key_id: str | None = None,
    ) -> StoredCharge:
        """Atomically: lock the principal, replay an existing idempotency key, or call ``decide`` and
        record the charge (with the API key id that made it). Raises :class:`UnknownPrincipal` when
        the principal was never opened."""

    def history(self, principal: str, limit: int | None = None) -> list[StoredCharge]: ...

    def charges_after(
        self, prefix: str, after_id: int, limit: int, *, exact: bool = False
    ) -> list[StoredCharge]:
        """At most ``limit`` charges with id > ``after_id``, by id, of the principal ``prefix``
        (``exact``) or of every principal starting with ``prefix``: one page of a history or export."""

    def open_principal_within(
        self, principal: str, epsilon: float, delta: float, accountant: str, tenant: str
    ) -> PrincipalRow:
        """:meth:`open_principal`, counted against ``tenant``'s caps atomically (raises
        :class:`TenantLimitExceeded`); reopening an existing principal counts nothing."""

    def ping(self) -> None:
        """Reach the database with a trivial query; raise :class:`StoreUnavailable` when it cannot."""

    def close(self) -> None: ...


class KeyStore(Protocol):
    """What the service's API keys and tenant caps need from the same database."""

    def put_api_key(self, row: ApiKeyRow) -> None: ...

    def get_api_key(self, key_id: str) -> ApiKeyRow | None: ...

    def list_api_keys(self) -> list[ApiKeyRow]: ...

    def revoke_api_key(self, key_id: str) -> bool: ...

    def expire_api_key(self, key_id: str, expires_at: float) -> bool:
        """Set the key's expiry (to the earlier of the stored one and ``expires_at``)."""

    def set_tenant_limits(self, tenant: str, max_sessions: int | None, max_epsilon: float | None) -> None:
        """Set the caps (counting the sessions ``tenant/...`` already open)."""

    def get_tenant_limits(self, tenant: str) -> TenantLimits | None: ...


class Store(LedgerStore, KeyStore, Protocol):
    """Every store (memory, SQLite, PostgreSQL) is both: one database holds the ledger's rows and
    the keys and caps of the tenants that spend from it."""


def check_principal(principal: object) -> str:
    """A non-empty string without control characters, at most 256 characters."""
    if not isinstance(principal, str):
        raise TypeError(f"principal must be a str, got principal={principal!r} ({type(principal).__name__})")
    if not principal or len(principal) > _MAX_PRINCIPAL_LEN or _CONTROL.search(principal):
        raise InvalidParameter(
            f"principal must be 1 to {_MAX_PRINCIPAL_LEN} printable characters, got principal={principal!r}"
        )
    return principal


def check_idempotency_key(key: object) -> str | None:
    """``None`` or a non-empty string without control characters, at most 256 characters."""
    if key is None:
        return None
    if not isinstance(key, str):
        raise TypeError(f"idempotency_key must be a str or None, got idempotency_key={key!r}")
    if not key or len(key) > _MAX_KEY_LEN or _CONTROL.search(key):
        raise InvalidParameter(
            f"idempotency_key must be 1 to {_MAX_KEY_LEN} printable characters, got idempotency_key={key!r}"
        )
    return key


def open_store(url: str, *, read_only: bool = False) -> Store:
    """The store for ``url``: ``memory://``, ``sqlite:///relative/or/absolute.db``, ``postgresql://...``.

    SQLite URLs follow SQLAlchemy's spelling: three slashes then a relative path
    (``sqlite:///ledger.db``), four for an absolute one (``sqlite:////var/lib/gaussdp.db``); query
    options ``synchronous=full|normal`` (default ``full``) and ``busy_timeout_ms``.
    PostgreSQL URLs are libpq URIs; the extra query option ``schema=NAME`` keeps the ledger's tables
    in that schema (created when missing), and ``pool_size=N`` sizes the connection pool.

    ``read_only=True`` (SQLite): open an existing ledger without creating or changing anything; a
    missing file or one that is not a ledger raises :class:`InvalidParameter`.
    """
    if not isinstance(url, str):
        raise TypeError(f"url must be a str, got url={url!r}")
    if url == "memory://" or url.startswith("memory://"):
        from gaussdp.budget.memory import MemoryStore

        return MemoryStore()
    if url.startswith("sqlite://"):
        from gaussdp.budget.sqlite import SQLiteStore

        return SQLiteStore.from_url(url, read_only=read_only)
    if url.startswith(("postgresql://", "postgres://")):
        from gaussdp.budget.postgres import PostgresStore

        return PostgresStore.from_url(url)
    raise InvalidParameter(
        "url must start with memory://, sqlite:/// or postgresql://, got url="
        + repr(url.split("@")[-1] if "@" in url else url)
    )


def replayed_charge(earlier: StoredCharge, event_key: str) -> StoredCharge:
    """The earlier charge of a retried idempotency key; a different event under the same key is refused."""
    if earlier.event_key != event_key:
        raise InvalidParameter(
            f"idempotency_key={earlier.idempotency_key!r} was already used for a different event "
            f"({earlier.event_key}); use a new key for a new charge"
        )
    return StoredCharge(
        earlier.charge_id,
        earlier.principal,
        earlier.event_key,
        earlier.idempotency_key,
        earlier.created_at,
        earlier.within_budget,
        replayed=True,
        key_id=earlier.key_id,
    )
