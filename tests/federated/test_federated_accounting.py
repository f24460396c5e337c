"""Client-level accounting of DP-FedAvg: amplification by Poisson sampling, the ledger, resuming."""

from __future__ import annotations

import numpy as np
import pytest

from gaussdp.accounting import GaussianEvent, SubsampledGaussianEvent, accountant
from gaussdp.budget import Ledger
from gaussdp.errors import BudgetExhausted, PrivacyError
from gaussdp.federated import DPFedAvg, RoundLedger, round_report
from gaussdp.noise import GRID_SLACK

pytestmark = pytest.mark.filterwarnings("ignore::gaussdp.errors.NotPrivateWarning")

DELTA = 1e-5


def _server(ledger, **kw) -> DPFedAvg:
    args = dict(
        num_clients=200,
        sample_rate=0.05,
        noise_multiplier=1.1,
        clip_norm=1.0,
        ledger=ledger,
        epsilon=50.0,
        delta=DELTA,
        accountant="rdp",
        noise="fast",
        seed=2,
    )
    args.update(kw)
    return DPFedAvg(**args)


def _rounds(srv: DPFedAvg, n: int, p: int = 6) -> None:
    for _ in range(n):
        srv.run_round(np.zeros(p), lambda g, ids: np.ones((ids.size, p)))


@pytest.mark.parametrize("acc", ["rdp", "pld"])
def test_amplified_epsilon_matches_the_accountants(acc: str) -> None:
    rounds = 8
    # A small budget keeps the ledger's allowance search (one composition per probe) short.
    srv = _server("memory://", accountant=acc, epsilon=3.0)
    _rounds(srv, rounds)
    ours = srv.epsilon()
    # The same composition through the accounting layer directly ...
    direct = accountant(acc).compose(SubsampledGaussianEvent(1.1, 0.05), rounds).epsilon(DELTA)
    assert ours == pytest.approx(direct, rel=1e-9)
    # ... and through Google's dp_accounting, the reference implementation.
    import dp_accounting

    ref_acc = (
        dp_accounting.rdp.RdpAccountant()
        if acc == "rdp"
        else dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    )
    ev = dp_accounting.PoissonSampledDpEvent(0.05, dp_accounting.GaussianDpEvent(1.1))
    ref = ref_acc.compose(dp_accounting.SelfComposedDpEvent(ev, rounds)).get_epsilon(DELTA)
    assert ours == pytest.approx(ref, rel=0.03)
    # Amplification matters: without it (what Flower's wrappers account) epsilon is far larger.
    unamplified = accountant(acc).compose(GaussianEvent(1.1), rounds).epsilon(DELTA)
    assert unamplified > 4 * ours


def test_secure_noise_charges_the_grid_slack() -> None:
    srv = _server("memory://", noise="secure", seed=None)
    assert srv.event == SubsampledGaussianEvent(1.1 / (1 + GRID_SLACK), 0.05)
    assert _server("memory://").event == SubsampledGaussianEvent(1.1, 0.05)


def test_resumed_server_continues_the_same_sqlite_ledger(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'fl.db'}"
    first = _server(url)
    _rounds(first, 3)
    eps3 = first.epsilon()
    first.ledger.ledger.close()
    del first  # the server process "restarts"

    second = _server(Ledger(url))
    assert second.rounds_done == 3 and second.epsilon() == pytest.approx(eps3)
    plan = second.begin_round()
    assert plan.round_num == 4
    second.finish_round(plan, np.ones((plan.clients.size, 6)), plan.clients)
    _rounds(second, 1)
    assert second.rounds_done == 5
    expected = accountant("rdp").compose(SubsampledGaussianEvent(1.1, 0.05), 5).epsilon(DELTA)
    assert second.epsilon() == pytest.approx(expected, rel=1e-9)

    report = round_report(url, ["dp-fedavg"])
    assert list(report["expenditures_by_round"]) == [f"round_{r}" for r in range(1, 6)]
    assert report["num_expenditures"] == 5 and report["total_epsilon"] == pytest.approx(expected)
    assert report["target_epsilon"] == 50.0 and not report["budget_exceeded"]
    assert report["remaining_budget"] == pytest.approx(50.0 - expected)
    # Document 003's PrivacyTracker (the accounting layer's class) rebuilt from the same records.
    doc = second.ledger.report()
    assert list(doc["expenditures_by_round"]) == [f"round_{r}" for r in range(1, 6)]
    assert doc["num_expenditures"] == 5 and doc["total_delta"] == pytest.approx(DELTA)
    assert doc["total_epsilon"] == pytest.approx(expected, rel=1e-6) and not doc["budget_exceeded"]


def test_resume_with_a_different_budget_is_refused(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'fl.db'}"
    _rounds(_server(url), 1)
    with pytest.raises(PrivacyError, match="budget cannot be changed"):
        _server(url, epsilon=100.0)


def test_would_exceed_stops_before_the_round_and_after_a_restart(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'fl.db'}"
    ev = SubsampledGaussianEvent(1.1, 0.05)
    budget = accountant("rdp").compose(ev, 6).epsilon(DELTA) * 1.0001  # exactly 6 rounds fit
    srv = _server(url, epsilon=budget)
    _rounds(srv, 4)
    assert not srv.would_exceed(2) and srv.would_exceed(3)
    srv = _server(url, epsilon=budget)  # restart
    _rounds(srv, 2)
    with pytest.raises(BudgetExhausted, match="stopping before round 7"):
        _rounds(srv, 1)
    assert srv.rounds_done == 6 and srv.epsilon() <= budget


def test_round_ledger_refuses_to_release_a_round_twice() -> None:
    led = RoundLedger("memory://", "run", epsilon=5.0, delta=DELTA, accountant="rdp")
    led.charge_round(1, GaussianEvent(3.0))
    with pytest.raises(PrivacyError, match="already charged"):
        led.charge_round(1, GaussianEvent(3.0))
    assert led.rounds_done == 1
    assert led.epsilon_after(GaussianEvent(3.0), 1) > led.epsilon_spent()
