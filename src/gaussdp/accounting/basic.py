"""Basic composition: epsilons add up and deltas add up (Dwork & Roth 2014, Theorem 3.16).

The loosest accountant, kept because the source documents use it and because it holds for any
mix of mechanisms. A Gaussian or subsampled Gaussian event is charged its *exact* single-release
epsilon at an equal share of the delta left after the (epsilon, delta) events' own deltas.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

from gaussdp._lazy import lazy_module
from gaussdp.accounting._mechanisms import PROFILE_LEAVES, leaf_log_delta
from gaussdp.accounting._profiles import gaussian_epsilon, subsampled_epsilon
from gaussdp.accounting.base import Accountant, fixed_leaves, invert_delta
from gaussdp.accounting.events import EpsilonDeltaEvent, Event, GaussianEvent, SubsampledGaussianEvent
from gaussdp.errors import InvalidParameter

if TYPE_CHECKING:
    from scipy import optimize
else:
    optimize = lazy_module("scipy.optimize")  # imported on first use: keeps `import gaussdp` cheap

__all__ = ["BasicComposition", "leaf_epsilon"]

# The smallest per-release delta share searched: the log of the smallest subnormal float (5e-324),
# so that every delta the API accepts (all of (0, 1)) can be answered, not only those above e^-690.
_LOG_SHARE_MIN = -744.0


@functools.lru_cache(maxsize=4096)
def leaf_epsilon(leaf: Event, delta: float) -> float:
    """Exact epsilon of one release of a Gaussian or subsampled Gaussian leaf at ``delta``."""
    if isinstance(leaf, GaussianEvent):
        return gaussian_epsilon(leaf.noise_multiplier, delta)
    if isinstance(leaf, SubsampledGaussianEvent):
        return subsampled_epsilon(leaf.noise_multiplier, leaf.sample_rate, delta)
    if isinstance(leaf, PROFILE_LEAVES):
        return invert_delta(lambda e: math.exp(float(leaf_log_delta(leaf, e)[0])), delta)
    raise InvalidParameter(f"no single-release profile for {leaf!r}")


class BasicComposition(Accountant):
    """(sum eps_i, sum delta_i)-DP for the composition of (eps_i, delta_i)-DP releases (add/remove).

    Accepted domain: every event with an exact one-release profile and every (epsilon, delta) event;
    every delta in (0, 1) (per-release shares down to the smallest float, 5e-324). A delta not above
    the (epsilon, delta) events' own total is refused.

    References:
        Dwork, C. & Roth, A. (2014). The Algorithmic Foundations of Differential Privacy,
        Theorem 3.16 (basic composition).
    """

    name = "basic"

    def _supports_leaf(self, leaf: Event) -> bool:
        return isinstance(leaf, (GaussianEvent, SubsampledGaussianEvent, EpsilonDeltaEvent, *PROFILE_LEAVES))

    def _split(self) -> tuple[float, float, list[tuple[Event, int]], int]:
        fixed = fixed_leaves(self._counts)
        eps_f = math.fsum(e.epsilon * c for e, c in fixed)
        delta_f = math.fsum(e.delta * c for e, c in fixed)
        mech = [(e, c) for e, c in self._counts.items() if not isinstance(e, EpsilonDeltaEvent)]
        return eps_f, delta_f, mech, sum(c for _, c in mech)

    def _epsilon(self, delta: float) -> float:
        eps_f, delta_f, mech, k = self._split()
        if delta_f > delta or (mech and delta_f >= delta):
            raise InvalidParameter(
                f"delta={delta:g} is not above the total delta {delta_f:g} of the composed "
                "(epsilon, delta) events"
            )
        if not mech:
            return eps_f
        share = (delta - delta_f) / k
        return eps_f + math.fsum(c * leaf_epsilon(e, share) for e, c in mech)

    def _delta(self, epsilon: float) -> float:
        eps_f, delta_f, mech, k = self._split()
        if epsilon < eps_f:
            return 1.0
        if not mech:
            return delta_f
        budget = epsilon - eps_f

        def excess(log_share: float) -> float:
            share = math.exp(log_share)
            return math.fsum(c * leaf_epsilon(e, share) for e, c in mech) - budget

        hi = math.log((1.0 - delta_f) / k) - 1e-12
        if hi <= _LOG_SHARE_MIN or excess(hi) > 0.0:
            return 1.0
        lo = _LOG_SHARE_MIN
        if excess(lo) <= 0.0:
            return min(1.0, delta_f + k * math.exp(lo))
        # The smallest share whose releases fit the budget (excess is non-increasing in the share and
        # can be flat at 0 over an interval, e.g. at epsilon = 0: bisect, never a root search).
        while hi - lo > 1e-12 * max(1.0, abs(lo)):
            mid = 0.5 * (lo + hi)
            if excess(mid) <= 0.0:
                hi = mid
            else:
                lo = mid
        return min(1.0, delta_f + k * math.exp(hi))  # excess(hi) <= 0 holds at every step
