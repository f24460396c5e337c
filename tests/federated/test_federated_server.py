"""DP-FedAvg aggregation math against a hand computation; dropouts; fail-closed inputs.

Statistical checks use fixed seeds and 5-standard-error bounds (false-alarm rate below 1e-6 each).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from gaussdp.errors import BudgetExhausted, InvalidParameter, NotPrivateWarning, PrivacyError, UnsafeInput
from gaussdp.federated import DPFedAvg

pytestmark = pytest.mark.filterwarnings("ignore::gaussdp.errors.NotPrivateWarning")

P = 20_000  # parameters: enough coordinates to estimate the noise stddev to 0.5%


def _server(**kw) -> DPFedAvg:
    args = dict(
        num_clients=4,
        sample_rate=1.0,
        noise_multiplier=0.5,
        clip_norm=1.0,
        ledger="memory://",
        epsilon=1e3,
        delta=1e-5,
        accountant="rdp",
        noise="fast",
        seed=11,
    )
    args.update(kw)
    return DPFedAvg(**args)


def _unit(seed: int = 0) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=P)
    return v / np.linalg.norm(v)


def _check_gaussian(residual: np.ndarray, sigma: float) -> None:
    n = residual.size
    assert abs(residual.mean()) < 5 * sigma / math.sqrt(n)
    # The sample stddev has relative standard error ~ 1/sqrt(2n).
    assert abs(residual.std() / sigma - 1) < 5 / math.sqrt(2 * n)


def test_fedavg_matches_hand_computation() -> None:
    # Four clients, everyone sampled (q = 1): deltas a_i * v with norms 0.5, 2, 4, 1 and C = 1.
    # By hand: clipped norms 0.5, 1, 1, 1 -> sum 3.5 v -> divided by qN = 4 -> 0.875 v,
    # plus N(0, (z C / qN)^2) = N(0, 0.125^2) per coordinate.
    v = _unit()
    deltas = np.outer([0.5, 2.0, 4.0, 1.0], v)
    srv = _server()
    plan = srv.begin_round()
    assert plan.clients.tolist() == [0, 1, 2, 3]
    res = srv.finish_round(plan, deltas, plan.clients)
    assert res.clipped == 2 and res.answered == 4 and res.noise_stddev == pytest.approx(0.5)
    residual = res.update - 0.875 * v
    _check_gaussian(residual, 0.5 * 1.0 / 4)
    assert abs(float(res.update @ v) - 0.875) < 5 * 0.125


def test_fixed_denominator_with_poisson_sampling_and_float32() -> None:
    srv = _server(num_clients=40, sample_rate=0.25, noise_multiplier=0.8, clip_norm=2.0)
    plan = srv.begin_round()
    k = plan.clients.size
    rng = np.random.default_rng(5)
    deltas = rng.normal(size=(k, P)).astype(np.float32)
    res = srv.finish_round(plan, deltas, plan.clients)
    assert res.update.dtype == np.float32
    from gaussdp.clipping import clip_rows

    expected = clip_rows(deltas, 2.0)[0].sum(axis=0, dtype=np.float64) / (0.25 * 40)  # qN = 10, not k
    _check_gaussian(res.update - expected, 0.8 * 2.0 / 10)


def test_dropouts_contribute_zero_keep_the_denominator_and_count() -> None:
    v = _unit(1)
    srv = _server(num_clients=4, noise_multiplier=0.5)
    plan = srv.begin_round()
    # Clients 1 and 3 drop out: the sum is over clients 0 and 2 only, still divided by qN = 4.
    deltas = np.outer([0.5, 4.0], v)
    res = srv.finish_round(plan, deltas, [0, 2])
    assert (res.sampled, res.answered) == (4, 2)
    _check_gaussian(res.update - (1.5 / 4) * v, 0.5 / 4)
    eps_one = srv.epsilon()
    # Everyone drops: the round is still released (pure noise), charged and counted.
    plan = srv.begin_round()
    res = srv.finish_round(plan, None, [])
    assert res.round_num == 2 and srv.rounds_done == 2 and res.answered == 0
    _check_gaussian(res.update, 0.5 / 4)
    assert srv.epsilon() > eps_one


def test_run_round_with_simulated_dropout() -> None:
    srv = _server(num_clients=10, sample_rate=1.0)
    srv.num_params = 8
    seen: list[np.ndarray] = []

    def clients(g: np.ndarray, ids: np.ndarray) -> np.ndarray:
        seen.append(ids)
        return np.ones((ids.size, 8))

    res = srv.run_round(np.zeros(8), clients, dropout=lambda ids: ids % 2 == 0)
    assert seen[0].tolist() == [0, 2, 4, 6, 8] and res.answered == 5 and res.sampled == 10


def test_refuses_unsampled_duplicate_and_non_finite_updates_before_charging() -> None:
    srv = _server(num_clients=10, sample_rate=0.3)
    plan = srv.begin_round()
    outsider = int(np.setdiff1d(np.arange(10), plan.clients)[0])
    with pytest.raises(UnsafeInput, match="without being sampled"):
        srv.finish_round(plan, np.ones((1, 5)), [outsider])
    if plan.clients.size:
        bad = np.ones((1, 5))
        bad[0, 2] = np.nan
        with pytest.raises(UnsafeInput):
            srv.finish_round(plan, bad, plan.clients[:1])
        with pytest.raises(UnsafeInput, match="twice"):
            srv.finish_round(plan, np.ones((2, 5)), [plan.clients[0]] * 2)
    assert srv.rounds_done == 0 and srv.epsilon() == 0.0  # nothing was charged
    with pytest.raises(UnsafeInput, match="matrix"):
        srv.finish_round(plan, np.ones(5), plan.clients[:1])


def test_a_round_is_released_once() -> None:
    srv = _server()
    plan = srv.begin_round()
    srv.finish_round(plan, np.ones((4, 3)), plan.clients)
    with pytest.raises(PrivacyError, match="not the next round"):
        srv.finish_round(plan, np.ones((4, 3)), plan.clients)


def test_parameters_are_validated_by_name() -> None:
    with pytest.raises(InvalidParameter, match="sample_rate"):
        _server(sample_rate=1.5)
    with pytest.raises(InvalidParameter, match="noise_multiplier"):
        _server(noise_multiplier=0.0)
    with pytest.raises(InvalidParameter, match="clip_norm"):
        _server(clip_norm=None)
    with pytest.raises(InvalidParameter, match="num_clients"):
        _server(num_clients=0)
    with pytest.raises(InvalidParameter, match="noise"):
        _server(noise="weak")


def test_seed_warns_not_private() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", NotPrivateWarning)
        with pytest.raises(NotPrivateWarning):
            _server(seed=3)
        _server(seed=None)  # OS entropy: no warning


def test_budget_stop_is_clear_and_charges_nothing() -> None:
    from gaussdp.accounting import GaussianEvent, accountant

    # The budget fits exactly k rounds: compute k with the same accountant, then run past it.
    z, budget = 2.0, 3.0
    k = max(n for n in range(1, 50) if accountant("rdp").compose(GaussianEvent(z), n).epsilon(1e-5) <= budget)
    srv = _server(noise_multiplier=z, epsilon=budget)
    for _ in range(k):
        assert not srv.would_exceed()
        srv.run_round(np.zeros(3), lambda g, ids: np.ones((ids.size, 3)))
    assert srv.would_exceed()
    with pytest.raises(BudgetExhausted, match=rf"stopping before round {k + 1}.*nothing was sampled"):
        srv.begin_round()
    assert srv.rounds_done == k and len(srv.ledger.ledger.history(srv.ledger.principal)) == k
