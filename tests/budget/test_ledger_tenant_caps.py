"""Per-tenant caps (sessions, total epsilon granted) hold under concurrent opens, on every store."""

from __future__ import annotations

import threading

from gaussdp.budget import Budget, Ledger, TenantLimitExceeded


def test_concurrent_opens_never_pass_the_tenant_caps(ledger_url: str) -> None:
    with Ledger(ledger_url) as ledger:
        ledger.open("t/before", Budget(2.0, 1e-5))
        ledger.open("other/x", Budget(50.0, 1e-5))  # another tenant's session is not counted
        ledger.store.set_tenant_limits("t", 6, 7.5)
        assert ledger.store.get_tenant_limits("t").sessions == 1
        ok: list[int] = []
        refused: list[int] = []
        start = threading.Barrier(16)

        def opener(i: int) -> None:
            start.wait()
            try:
                ledger.open(f"t/s{i}", Budget(1.0, 1e-5), tenant="t")
                ok.append(i)
            except TenantLimitExceeded:
                refused.append(i)

        threads = [threading.Thread(target=opener, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # 2 + 5 * 1.0 <= 7.5 < 2 + 6 * 1.0: the epsilon cap binds at 5 new sessions (6 in all)
        assert (len(ok), len(refused)) == (5, 11)
        assert len(ledger.principals("t/")) == 6
        limits = ledger.store.get_tenant_limits("t")
        assert (limits.sessions, limits.epsilon_granted) == (6, 7.0)
        ledger.open(f"t/s{ok[0]}", Budget(1.0, 1e-5), tenant="t")  # reopening: not counted, not refused
        assert ledger.store.get_tenant_limits("t").sessions == 6
