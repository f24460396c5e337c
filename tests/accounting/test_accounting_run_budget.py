"""The source documents' accounting APIs (001, 003, 000), with correct math; and noise_for_epsilon."""

from __future__ import annotations

import logging
import math

import pytest

from gaussdp.accounting import (
    GaussianEvent,
    PrivacyBudget,
    PrivacyParams,
    SubsampledGaussianEvent,
    accountant,
    advanced_composition_epsilon,
    basic_composition_epsilon,
    compute_delta_from_epsilon,
    compute_epsilon_from_delta,
    estimate_noise_scale,
    noise_for_epsilon,
)
from gaussdp.budget import PrivacyBudgetTracker, PrivacyTracker
from gaussdp.calibration import classical_sigma, epsilon_for, sigma_for
from gaussdp.errors import BudgetExhausted, InvalidParameter, PrivacyWarning


# ----- document 001 ----------------------------------------------------------------------------
def test_privacy_params_validated():
    p = PrivacyParams(epsilon=1.0, delta=1e-5, clip_norm=2.0)
    assert (p.epsilon, p.delta, p.clip_norm) == (1.0, 1e-5, 2.0)
    with pytest.raises(InvalidParameter, match="delta"):
        PrivacyParams(epsilon=1.0, delta=1.5)
    with pytest.raises(InvalidParameter, match="clip_norm"):
        PrivacyParams(epsilon=1.0, delta=1e-5, clip_norm=0.0)


@pytest.mark.parametrize("name", ["pld", "rdp", "advanced"])
def test_privacy_budget_total_provably_within_budget(name):
    b = PrivacyBudget(epsilon=2.0, delta=1e-5, num_rounds=20, accountant=name)
    assert b.epsilon_remaining() == 2.0
    for _ in range(20):
        b.use_round()
    # the independent exact value of 20 Gaussian rounds stays within the budget
    exact = epsilon_for(sigma=b.noise_multiplier / math.sqrt(20), delta=1e-5)
    assert exact <= 2.0
    assert b.epsilon_spent() <= 2.0
    assert b.get_status()["rounds_remaining"] == 0
    with pytest.raises(BudgetExhausted):
        b.use_round()
    assert b.rounds_used == 20


def test_privacy_budget_is_tighter_than_the_documents_split():
    # Document 001: eps_round = eps / sqrt(T) with the classical sigma per round.
    eps, delta, rounds = 1.0, 1e-5, 10
    b = PrivacyBudget(epsilon=eps, delta=delta, num_rounds=rounds)
    doc_sigma = classical_sigma(epsilon=eps / math.sqrt(rounds), delta=delta)
    doc_true_eps = accountant("pld").compose(GaussianEvent(doc_sigma), rounds).epsilon(delta)
    # the document's split wastes budget here (true total 0.75 < 1): 30% more noise than needed
    assert doc_true_eps < eps and b.noise_multiplier < 0.8 * doc_sigma
    for _ in range(rounds):
        b.use_round()
    assert eps * (1 - 1e-6) <= b.epsilon_spent() <= eps  # the whole budget, and not more
    status = b.get_status()
    assert status["accountant"] == "pld" and status["neighbouring_relation"] == "add/remove"
    assert 0.0 < status["epsilon_per_round"] < eps


def test_helpers():
    assert compute_epsilon_from_delta(3.7306, 1e-5) == pytest.approx(1.0, abs=1e-4)
    assert compute_delta_from_epsilon(3.7306, 1.0) == pytest.approx(1e-5, rel=1e-3)
    assert estimate_noise_scale(1.0, 1e-5, sensitivity=2.0) == pytest.approx(
        2 * sigma_for(epsilon=1.0, delta=1e-5)
    )
    # several steps: the noise meets the target under the exact composition
    s = estimate_noise_scale(1.0, 1e-5, steps=4)
    assert compute_epsilon_from_delta(s, 1e-5, steps=4) <= 1.0
    assert basic_composition_epsilon(0.1, 100) == pytest.approx(10.0)
    k, e, d = 100, 0.1, 1e-5
    expected = math.sqrt(2 * k * math.log(1 / d)) * e + k * e * math.expm1(e)
    assert advanced_composition_epsilon(e, k, d) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(InvalidParameter):
        advanced_composition_epsilon(0.1, 0, 1e-5)


# ----- document 003 ----------------------------------------------------------------------------
def test_privacy_accountant_basic_as_documented(caplog):
    acc = PrivacyTracker(target_epsilon=5.0)
    assert acc.get_total_privacy() == (0.0, 0.0)
    acc.record_expenditure(epsilon=1.0, delta=1e-5, round_num=1, description="client 0")
    acc.record_expenditure(epsilon=1.0, delta=1e-5, round_num=1, description="client 1")
    acc.record_expenditure(epsilon=1.0, delta=1e-5, round_num=2)
    assert acc.get_total_privacy() == (3.0, pytest.approx(3e-5))
    assert acc.check_budget() and acc.get_remaining_budget() == 2.0
    with caplog.at_level(logging.WARNING, logger="gaussdp.budget.trackers"):
        acc.record_expenditure(epsilon=2.5, delta=1e-5, round_num=3)
    assert "budget exceeded" in caplog.text
    assert not acc.check_budget() and acc.get_remaining_budget() == 0.0
    report = acc.get_report()
    assert report["budget_exceeded"] and report["num_expenditures"] == 4
    assert [len(v) for v in report["expenditures_by_round"].values()] == [2, 1, 1]
    assert report["expenditures_by_round"]["round_1"][0]["description"] == "client 0"


def test_privacy_accountant_tighter_with_events():
    acc = PrivacyTracker()
    sigma = sigma_for(epsilon=1.0, delta=1e-6)
    for r in range(10):
        acc.record_expenditure(1.0, 1e-6, round_num=r, event=GaussianEvent(sigma))
    basic_eps, total_delta = acc.get_total_privacy()
    tight_eps, tight_delta = acc.get_total_privacy(accountant="pld")
    assert basic_eps == 10.0 and tight_delta == total_delta
    exact = epsilon_for(sigma=sigma / math.sqrt(10), delta=total_delta)
    assert tight_eps == pytest.approx(exact, rel=1e-9)
    assert tight_eps < 0.5 * basic_eps


def test_privacy_accountant_validates_before_recording():
    acc = PrivacyTracker()
    with pytest.raises(InvalidParameter):
        acc.record_expenditure(-1.0, 1e-5, 1)
    with pytest.raises(TypeError):
        acc.record_expenditure(1.0, 1e-5, "1")  # type: ignore[arg-type]
    with pytest.raises(InvalidParameter, match="only"):  # the event does not deliver (0.1, 1e-5)
        acc.record_expenditure(0.1, 1e-5, 1, event=GaussianEvent(1.0))
    assert acc.expenditures == []


# ----- document 000 ----------------------------------------------------------------------------
def test_budget_tracker_advanced_composition_and_refusal():
    t = PrivacyBudgetTracker(max_epsilon=10.0, delta=1e-5)
    states = []
    for _ in range(30):
        ok, state = t.consume(0.5, session_id="a")
        states.append((ok, state))
    accepted = [s for ok, s in states if ok]
    last = accepted[-1]
    k = last.num_queries
    adv = math.sqrt(2 * k * math.log(1e5)) * 0.5 + k * 0.5 * math.expm1(0.5)
    assert last.total_epsilon == pytest.approx(min(adv, 0.5 * k))
    assert last.total_epsilon <= 10.0
    ok, refused = states[-1]
    assert not ok and refused.num_queries == k  # refused: nothing charged
    assert t.state("b").total_epsilon == 0.0  # sessions are independent
    assert t.consume(1.0, session_id="b")[0]


def test_budget_tracker_warn_policy_is_explicit():
    t = PrivacyBudgetTracker(max_epsilon=1.0, policy="warn")
    assert t.consume(1.0)[0]
    with pytest.warns(PrivacyWarning, match="exceeded"):
        ok, state = t.consume(1.0)
    assert not ok and state.num_queries == 2
    with pytest.raises(InvalidParameter):
        PrivacyBudgetTracker(policy="ignore")  # type: ignore[arg-type]


# ----- noise_for_epsilon -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["pld", "rdp", "advanced"])
def test_noise_for_epsilon_meets_the_target_tightly(name):
    q, steps = 0.01, 300
    sigma = noise_for_epsilon(target_epsilon=2.0, delta=1e-5, sample_rate=q, steps=steps, accountant=name)
    eps = accountant(name).compose(SubsampledGaussianEvent(sigma, q), steps).epsilon(1e-5)
    assert eps <= 2.0
    looser = accountant(name).compose(SubsampledGaussianEvent(sigma * 0.99, q), steps).epsilon(1e-5)
    assert looser > 2.0  # not much more noise than needed


def test_noise_for_epsilon_closed_form_and_errors():
    assert noise_for_epsilon(target_epsilon=1.0, delta=1e-5, steps=16) == pytest.approx(
        4 * sigma_for(epsilon=1.0, delta=1e-5), rel=1e-9
    )
    with pytest.raises(InvalidParameter, match="target_epsilon"):
        noise_for_epsilon(target_epsilon=0.0, delta=1e-5)
    with pytest.raises(InvalidParameter, match="sample_rate"):
        noise_for_epsilon(target_epsilon=1.0, delta=1e-5, sample_rate=0.0)
    with pytest.raises(InvalidParameter, match="unknown accountant"):
        noise_for_epsilon(target_epsilon=1.0, delta=1e-5, accountant="moments")
