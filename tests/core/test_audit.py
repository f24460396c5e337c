"""Audit: the default release stays under its claim; a broken mechanism is caught.

Outputs of one scalar release on neighbouring inputs x=1 and x'=0 (sensitivity 1), claim
(epsilon, delta) = (1, 1e-5). Clopper-Pearson at alpha=1e-6: the default mechanism's lower bound
exceeds the claim with probability at most 1e-6 if the claim is true. The broken mechanisms are
seeded, so their detection is deterministic.
"""

from __future__ import annotations

import numpy as np
import pytest

from gaussdp import GaussianMechanism, InvalidParameter, NotPrivateWarning, UnsafeInput
from gaussdp.audit import clopper_pearson, epsilon_lower_bound

EPSILON, DELTA, ALPHA = 1.0, 1e-5, 1e-6
N = 400_000  # outputs per side


def _pair(mech):
    # Each row is one independent scalar release (release_rows clips and noises row by row).
    return (
        mech.release_rows(np.ones((N, 1), np.float32))[:, 0],
        mech.release_rows(np.zeros((N, 1), np.float32))[:, 0],
    )


def test_default_release_stays_below_its_claim():
    mech = GaussianMechanism(epsilon=EPSILON, delta=DELTA)
    a, b = _pair(mech)
    result = epsilon_lower_bound(a, b, delta=DELTA, alpha=ALPHA)
    assert result.epsilon_lower_bound <= EPSILON, result


def test_detects_sigma_halved():
    sigma = GaussianMechanism(epsilon=EPSILON, delta=DELTA).sigma / 2
    with pytest.warns(NotPrivateWarning):
        broken = GaussianMechanism(sigma=sigma, seed=1)
    a, b = _pair(broken)
    result = epsilon_lower_bound(a, b, delta=DELTA, alpha=ALPHA)
    assert result.epsilon_lower_bound > EPSILON, result


def test_detects_naive_float_path():
    # The textbook x + sigma * Z in float32: its low-order bits give the input away (Mironov 2012).
    sigma = np.float32(GaussianMechanism(epsilon=EPSILON, delta=DELTA).sigma)
    rng = np.random.default_rng(2)
    a = np.float32(1.0) + sigma * rng.standard_normal(N, dtype=np.float32)
    b = np.float32(0.0) + sigma * rng.standard_normal(N, dtype=np.float32)
    result = epsilon_lower_bound(a, b, delta=DELTA, alpha=ALPHA)
    assert result.epsilon_lower_bound > EPSILON, result
    assert "2**" in result.event  # caught by a low-order-bit event


def test_fast_path_is_not_float_safe_and_says_so():
    mech = GaussianMechanism(epsilon=EPSILON, delta=DELTA, noise="fast")
    assert not mech.float_safe
    a, b = _pair(mech)
    assert epsilon_lower_bound(a, b, delta=DELTA, alpha=ALPHA).epsilon_lower_bound > EPSILON


def test_clopper_pearson_edges():
    assert clopper_pearson(0, 10, 0.05)[0] == 0.0
    assert clopper_pearson(10, 10, 0.05)[1] == 1.0
    lo, hi = clopper_pearson(50, 100, 0.05)
    assert lo < 0.5 < hi


def test_bad_input():
    ok = np.zeros(10)
    with pytest.raises(UnsafeInput, match="NaN"):
        epsilon_lower_bound(np.array([np.nan] * 10), ok)
    with pytest.raises(UnsafeInput, match="at least"):
        epsilon_lower_bound(np.zeros(2), ok)
    with pytest.raises(TypeError, match="real"):
        epsilon_lower_bound(np.array([1j] * 10), ok)
    with pytest.raises(InvalidParameter, match="delta"):
        epsilon_lower_bound(ok, ok, delta=1.5)
    with pytest.raises(InvalidParameter, match="alpha"):
        epsilon_lower_bound(ok, ok, alpha=0.0)
