"""Fair shares between tenants: generation slots per tenant under a global cap, and a model lock
that serves tenants in turn.

A generation (a WebSocket stream, or one ``POST .../generate``) holds one slot from the moment its
caller is authenticated until it ends, whatever it costs in privacy: a stream with
``noise_multiplier=1e9`` spends about nothing, and still holds its slot. A tenant holds at most
``per_tenant`` slots, all tenants together at most ``total``; past either, the request is refused
with 429 ``too_many_generations`` (WebSocket close 4429). With the defaults (8 of 32) a tenant
that holds its whole share leaves 24 slots to the others.

Forward passes of one model take turns (the privatizer's hook sits on the shared module for one
pass). :class:`FairLock` hands the turn to the tenants waiting for it in rotation, one pass each,
so that a tenant running many streams delays another tenant's token by at most one of its passes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from contextlib import AbstractContextManager
from typing import Any

from gaussdp.service.errors import Refusal

__all__ = ["DEFAULT_MAX_STREAMS", "DEFAULT_MAX_STREAMS_PER_TENANT", "FairLock", "TenantSlots"]

DEFAULT_MAX_STREAMS = 32
DEFAULT_MAX_STREAMS_PER_TENANT = 8


class TenantSlots:
    """At most ``per_tenant`` slots for each tenant, ``total`` for all of them (one worker process).

    >>> slots = TenantSlots(total=2, per_tenant=1)
    >>> slots.acquire("a"); slots.acquire("b")
    >>> slots.held("a"), slots.held()
    (1, 2)
    >>> slots.release("a")
    """

    def __init__(self, total: int = DEFAULT_MAX_STREAMS, per_tenant: int = DEFAULT_MAX_STREAMS_PER_TENANT):
        for name, value in (("total", total), ("per_tenant", per_tenant)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {name}={value!r}")
        self.total = total
        self.per_tenant = per_tenant
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, tenant: str) -> None:
        """Take a slot for ``tenant``.

        Raises:
            Refusal: ``too_many_generations`` when the tenant holds its share, or all are taken.
        """
        with self._lock:
            mine = self._held.get(tenant, 0)
            if mine >= self.per_tenant:
                raise Refusal(
                    "too_many_generations",
                    f"this tenant runs {mine} generations already, its share of this worker "
                    f"(max_streams_per_tenant={self.per_tenant}); end one or retry later",
                )
            if sum(self._held.values()) >= self.total:
                raise Refusal(
                    "too_many_generations",
                    f"this worker runs {self.total} generations already (max_streams); retry later",
                )
            self._held[tenant] = mine + 1

    def release(self, tenant: str) -> None:
        with self._lock:
            left = self._held.get(tenant, 0) - 1
            if left > 0:
                self._held[tenant] = left
            else:
                self._held.pop(tenant, None)

    def held(self, tenant: str | None = None) -> int:
        """Slots held by ``tenant`` (every tenant's when ``None``)."""
        with self._lock:
            return sum(self._held.values()) if tenant is None else self._held.get(tenant, 0)


class FairLock:
    """A mutex whose waiters are served tenant by tenant in rotation (FIFO within a tenant).

    ``lock.turn(tenant)`` is a context manager holding the lock for one tenant's critical section.
    Waiting is bounded by the waiters ahead in the rotation: with ``k`` other tenants waiting, a
    tenant's turn comes after at most ``k`` sections, however many each of them queued.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._held = False
        self._queues: OrderedDict[str, deque[object]] = OrderedDict()  # tenants in rotation order
        self._granted: object | None = None

    def acquire(self, tenant: str) -> None:
        with self._cond:
            if not self._held and not self._queues:
                self._held = True
                return
            ticket = object()
            self._queues.setdefault(tenant, deque()).append(ticket)
            while self._granted is not ticket:
                self._cond.wait()
            self._granted = None

    def release(self) -> None:
        with self._cond:
            if not self._queues:
                self._held = False
                return
            tenant, queue = next(iter(self._queues.items()))
            self._granted = queue.popleft()
            del self._queues[tenant]
            if queue:  # this tenant's next waiter goes to the back of the rotation
                self._queues[tenant] = queue
            self._cond.notify_all()  # the lock stays held: it passes to the granted waiter

    def turn(self, tenant: str) -> AbstractContextManager[Any]:
        return _Turn(self, tenant)


class _Turn(AbstractContextManager[Any]):
    def __init__(self, lock: FairLock, tenant: str) -> None:
        self._lock, self._tenant = lock, tenant

    def __enter__(self) -> _Turn:
        self._lock.acquire(self._tenant)
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
