"""One contract every accountant satisfies (add/remove neighbours, upper bounds, O(1) composition)."""

from __future__ import annotations

import functools
import math

import pytest

import gaussdp.accounting
from gaussdp.accounting import (
    ComposedEvent,
    EpsilonDeltaEvent,
    GaussianEvent,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    UnsupportedEvent,
    available_accountants,
)
from gaussdp.accounting._profiles import subsampled_epsilon
from gaussdp.calibration import epsilon_for_mu
from gaussdp.errors import InvalidParameter

NAMES = available_accountants()
# The contract covers every accountant, the labelled approximation too (asked for by name).
accountant = functools.partial(gaussdp.accounting.accountant, allow_approximate=True)
SUB = SubsampledGaussianEvent(1.0, 0.01)


def test_factory_names_and_default():
    assert set(NAMES) == {"basic", "advanced", "rdp", "pld", "gdp"}
    assert accountant().name == "pld"
    assert accountant("gdp").approximate and not accountant("pld").approximate
    with pytest.raises(InvalidParameter, match="unknown accountant"):
        accountant("moments")


@pytest.mark.parametrize("name", NAMES)
class TestAccountantContract:
    def test_no_events_is_zero(self, name):
        acc = accountant(name)
        assert acc.epsilon(1e-5) == 0.0
        assert acc.delta(0.5) == 0.0
        assert acc.steps == 0

    def test_compose_returns_self_and_chains(self, name):
        acc = accountant(name)
        assert acc.compose(GaussianEvent(2.0)) is acc
        assert acc.compose(GaussianEvent(2.0), count=3).compose(SUB, 5) is acc
        assert acc.steps == 9
        assert acc.history == ((GaussianEvent(2.0), 4), (SUB, 5))

    def test_monotone_in_count(self, name):
        eps = [accountant(name).compose(SUB, count=k).epsilon(1e-5) for k in (1, 10, 100)]
        assert 0.0 < eps[0] <= eps[1] <= eps[2]

    def test_count_equals_repeated_compose(self, name):
        a = accountant(name).compose(SUB, count=20)
        b = accountant(name)
        for _ in range(20):
            b.compose(SUB)
        assert a.epsilon(1e-5) == pytest.approx(b.epsilon(1e-5), rel=1e-9)
        assert a.history == b.history

    def test_heterogeneous_events(self, name):
        other = SubsampledGaussianEvent(2.0, 0.05)
        both = accountant(name).compose(SUB, 50).compose(GaussianEvent(4.0), 2).compose(other, 20)
        e = both.epsilon(1e-5)
        assert math.isfinite(e)
        assert e >= accountant(name).compose(SUB, 50).epsilon(1e-5)
        assert e >= accountant(name).compose(other, 20).epsilon(1e-5)
        # order does not matter: composition is commutative
        rev = accountant(name).compose(other, 20).compose(GaussianEvent(4.0), 2).compose(SUB, 50)
        assert rev.epsilon(1e-5) == pytest.approx(e, rel=1e-9)

    @pytest.mark.parametrize("sigmas", [(1.0,), (0.5, 2.0, 2.0), (5.0,) * 30])
    def test_never_below_exact_for_plain_gaussians(self, name, sigmas):
        acc = accountant(name)
        for s in sigmas:
            acc.compose(GaussianEvent(s))
        mu = math.sqrt(sum(1 / s**2 for s in sigmas))
        for delta in (1e-3, 1e-5, 1e-10):
            exact = epsilon_for_mu(mu=mu, delta=delta)
            got = acc.epsilon(delta)
            assert got >= exact * (1 - 1e-12)
            if name in ("pld", "rdp", "gdp"):  # the exact closed form
                assert got == pytest.approx(exact, rel=1e-9)

    def test_never_below_exact_single_subsampled_step(self, name):
        if accountant(name).approximate:
            pytest.skip("gdp is a CLT approximation, not an upper bound")
        for ev in (SubsampledGaussianEvent(1.0, 0.01), SubsampledGaussianEvent(0.7, 0.3)):
            exact = subsampled_epsilon(ev.noise_multiplier, ev.sample_rate, 1e-5)
            assert accountant(name).compose(ev).epsilon(1e-5) >= exact * (1 - 1e-9)

    def test_epsilon_delta_round_trip(self, name):
        acc = accountant(name).compose(SUB, 200)
        eps = acc.epsilon(1e-5)
        assert acc.delta(eps) <= 1e-5 * (1 + 1e-6)
        assert acc.delta(eps * 0.9) > 1e-5 * (1 - 1e-6)

    def test_validation_happens_before_any_state_change(self, name):
        acc = accountant(name).compose(SUB, 3)
        before = (acc.counts, acc.history, acc.epsilon(1e-5))
        for bad_count in (0, -1):
            with pytest.raises(InvalidParameter):
                acc.compose(SUB, count=bad_count)
        for bad_count in (1.5, True, "2"):
            with pytest.raises(TypeError):
                acc.compose(SUB, count=bad_count)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            acc.compose("gaussian")  # type: ignore[arg-type]
        if name in ("rdp", "gdp"):
            mixed = ComposedEvent((GaussianEvent(1.0), EpsilonDeltaEvent(1.0, 1e-6)))
            assert not acc.supports(mixed)
            with pytest.raises(UnsupportedEvent):
                acc.compose(SelfComposedEvent(mixed, 4))
        assert (acc.counts, acc.history, acc.epsilon(1e-5)) == before

    @pytest.mark.parametrize("delta", [0.0, 1.0, -1e-5, math.nan, math.inf])
    def test_bad_delta(self, name, delta):
        with pytest.raises(InvalidParameter, match="delta"):
            accountant(name).compose(SUB).epsilon(delta)

    def test_bad_epsilon(self, name):
        with pytest.raises(InvalidParameter, match="epsilon"):
            accountant(name).compose(SUB).delta(-1.0)
        with pytest.raises(TypeError):
            accountant(name).compose(SUB).delta("1")  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        ("event", "count"),
        [(SubsampledGaussianEvent(0.3, 0.5), 200), (GaussianEvent(0.01), 1000), (SUB, 10)],
    )
    def test_extreme_values_answer_or_raise_clearly(self, name, event, count):
        acc = accountant(name).compose(event, count)
        for delta in (1e-20, 1e-12, 0.5):
            try:
                e = acc.epsilon(delta)
            except InvalidParameter as exc:
                assert "epsilon" in str(exc) or "delta" in str(exc)
            else:
                assert math.isfinite(e) and e >= 0.0
        for eps in (0.0, 1.0, 1000.0):
            d = acc.delta(eps)
            assert 0.0 <= d <= 1.0
