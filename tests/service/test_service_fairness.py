"""Fair shares (gaussdp.service.fairness): slots per tenant under a global cap, and a model lock that
serves tenants in turn."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")

from gaussdp.service.errors import Refusal
from gaussdp.service.fairness import FairLock, TenantSlots


def test_slots_per_tenant_under_a_global_cap() -> None:
    slots = TenantSlots(total=5, per_tenant=2)
    for _ in range(2):
        slots.acquire("b")
    with pytest.raises(Refusal) as exc:
        slots.acquire("b")  # b holds its share
    assert exc.value.code == "too_many_generations" and "max_streams_per_tenant=2" in exc.value.detail
    slots.acquire("a")
    slots.acquire("a")
    slots.acquire("c")
    with pytest.raises(Refusal, match="max_streams"):
        slots.acquire("d")  # every slot taken
    slots.release("b")
    slots.acquire("d")
    assert (slots.held("a"), slots.held("b"), slots.held()) == (2, 1, 5)
    for tenant in ("a", "a", "b", "c", "d"):
        slots.release(tenant)
    assert slots.held() == 0
    with pytest.raises(ValueError, match="per_tenant"):
        TenantSlots(total=4, per_tenant=-1)


def test_the_fair_lock_serves_tenants_in_turn() -> None:
    """Tenant b queues 6 sections before a asks: a's section comes second, not seventh."""
    lock = FairLock()
    order: list[str] = []
    ready = threading.Event()

    def section(tenant: str) -> None:
        with lock.turn(tenant):
            order.append(tenant)
            time.sleep(0.02)

    with lock.turn("holder"):
        threads = [threading.Thread(target=section, args=("b",)) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.2)  # all of b's waiters queued
        threads.append(threading.Thread(target=section, args=("a",)))
        threads[-1].start()
        time.sleep(0.1)
        ready.set()
    for t in threads:
        t.join(timeout=10)
    assert sorted(order) == ["a"] + ["b"] * 6
    assert order.index("a") <= 1, order  # at most one of b's sections before it


def test_the_fair_lock_is_a_mutex() -> None:
    lock = FairLock()
    inside, most = [0], [0]

    def work(tenant: str) -> None:
        for _ in range(50):
            with lock.turn(tenant):
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                inside[0] -= 1

    threads = [threading.Thread(target=work, args=(t,)) for t in "abcabc"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert most[0] == 1
