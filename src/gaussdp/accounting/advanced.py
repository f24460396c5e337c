"""Advanced composition (Dwork, Rothblum & Vadhan 2010), with the delta split chosen optimally.

For releases that are (eps_i, delta_i)-DP (add/remove), their adaptive composition is
(eps', delta' + sum delta_i)-DP for every delta' > 0 with

    eps' = sqrt(2 ln(1/delta') sum eps_i^2) + sum eps_i (e^eps_i - 1)

(Dwork & Roth 2014, Theorem 3.20 for k equal epsilons: sqrt(2k ln(1/delta')) eps + k eps (e^eps - 1);
the heterogeneous form follows from the same Azuma argument, Kairouz, Oh & Viswanath 2015). For a
Gaussian event eps_i itself depends on its delta_i: the accountant optimises the split of the target
delta between delta' and the per-release deltas, and never reports more than basic composition
(both are theorems, so the smaller is a valid bound).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from gaussdp._lazy import lazy_module
from gaussdp.accounting.base import fixed_leaves
from gaussdp.accounting.basic import _LOG_SHARE_MIN, BasicComposition, leaf_epsilon
from gaussdp.accounting.events import EpsilonDeltaEvent
from gaussdp.errors import InvalidParameter

if TYPE_CHECKING:
    from scipy import optimize
else:
    optimize = lazy_module("scipy.optimize")  # imported on first use: keeps `import gaussdp` cheap

__all__ = ["AdvancedComposition", "advanced_bound"]


def advanced_bound(epsilons: list[tuple[float, int]], delta_prime: float) -> float:
    """eps' of the advanced composition theorem for ``count`` releases at each ``epsilon``.

    >>> round(advanced_bound([(0.1, 100)], 1e-5), 4)   # sqrt(2*100*ln(1e5))*0.1 + 100*0.1*(e^0.1-1)
    5.8502
    """
    if not 0.0 < delta_prime < 1.0:
        raise InvalidParameter(f"delta_prime must be in (0, 1), got delta_prime={delta_prime!r}")
    if any(e > 700.0 for e, _ in epsilons):
        raise InvalidParameter("a per-release epsilon above 700 makes advanced composition meaningless")
    sq = math.fsum(c * e * e for e, c in epsilons)
    lin = math.fsum(c * e * math.expm1(e) for e, c in epsilons)
    return math.sqrt(2.0 * math.log(1.0 / delta_prime) * sq) + lin


class AdvancedComposition(BasicComposition):
    """Advanced composition theorem with the optimal delta split; never looser than basic.

    Args:
        delta_prime_fraction: fix the fraction of the target delta given to delta' (in (0, 1));
            ``None`` (default) optimises it.

    References:
        Dwork, C., Rothblum, G. & Vadhan, S. (2010). Boosting and Differential Privacy. FOCS.
        Dwork, C. & Roth, A. (2014). The Algorithmic Foundations of Differential Privacy, Thm 3.20.
    """

    name = "advanced"

    def __init__(self, *, delta_prime_fraction: float | None = None) -> None:
        super().__init__()
        if delta_prime_fraction is not None:
            f = float(delta_prime_fraction)
            if not 0.0 < f < 1.0:
                raise InvalidParameter(
                    "delta_prime_fraction must be in (0, 1), got "
                    f"delta_prime_fraction={delta_prime_fraction!r}"
                )
        self._fraction = delta_prime_fraction

    def _advanced(self, delta: float, fraction: float) -> float:
        fixed = fixed_leaves(self._counts)
        delta_f = math.fsum(e.delta * c for e, c in fixed)
        mech = [(e, c) for e, c in self._counts.items() if not isinstance(e, EpsilonDeltaEvent)]
        rest = delta - delta_f
        if rest <= 0.0:
            raise InvalidParameter(
                f"delta={delta:g} is not above the total delta {delta_f:g} of the composed "
                "(epsilon, delta) events"
            )
        eps_list: list[tuple[float, int]] = [(e.epsilon, c) for e, c in fixed]
        if mech:
            k = sum(c for _, c in mech)
            d_prime = fraction * rest
            share = (rest - d_prime) / k
            if not (share > 0.0 and d_prime > 0.0):  # underflow at deltas near 5e-324: no such split
                raise InvalidParameter(f"no delta split of {rest!r} with fraction {fraction!r}")
            eps_list += [(leaf_epsilon(e, share), c) for e, c in mech]
        else:
            d_prime = rest
        return advanced_bound(eps_list, d_prime)

    def _epsilon(self, delta: float) -> float:
        basic = super()._epsilon(delta)
        has_mech = any(not isinstance(e, EpsilonDeltaEvent) for e in self._counts)
        if self._fraction is not None or not has_mech:
            try:
                adv = self._advanced(delta, self._fraction if self._fraction is not None else 0.5)
            except InvalidParameter:
                adv = math.inf
            return min(basic, adv)

        # f(logit t) is smooth and unimodal in practice: coarse grid, then bounded Brent around the best.
        def f(z: float) -> float:
            try:
                return self._advanced(delta, 1.0 / (1.0 + math.exp(-z)))
            except InvalidParameter:
                return math.inf

        grid = np.linspace(-10.0, 10.0, 11)
        vals = [f(float(z)) for z in grid]
        i = int(np.argmin(vals))
        lo, hi = float(grid[max(i - 1, 0)]), float(grid[min(i + 1, len(grid) - 1)])
        res = optimize.minimize_scalar(f, bounds=(lo, hi), method="bounded", options={"xatol": 1e-3})
        best = min(vals[i], float(res.fun)) if res.success else vals[i]
        # Whatever split the optimiser picked, the value is the theorem's bound for that split.
        return min(basic, best)

    def _delta(self, epsilon: float) -> float:
        # For a per-release delta share, the theorem's eps' equals ``epsilon`` exactly when
        # ln(1/delta') = (epsilon - L)^2 / (2 S), with S = sum eps_i^2 and L = sum eps_i (e^eps_i - 1);
        # the total delta (fixed deltas + shares + delta') is then minimised over the share.
        basic = super()._delta(epsilon)
        fixed = fixed_leaves(self._counts)
        delta_f = math.fsum(e.delta * c for e, c in fixed)
        mech = [(e, c) for e, c in self._counts.items() if not isinstance(e, EpsilonDeltaEvent)]
        k = sum(c for _, c in mech)

        def total(log_share: float) -> float:
            share = math.exp(log_share) if mech else 0.0
            eps_list = [(e.epsilon, c) for e, c in fixed] + [(leaf_epsilon(e, share), c) for e, c in mech]
            if any(x > 700.0 for x, _ in eps_list):
                return 1.0
            sq = math.fsum(c * x * x for x, c in eps_list)
            lin = math.fsum(c * x * math.expm1(x) for x, c in eps_list)
            if epsilon <= lin:
                return 1.0
            d_prime = math.exp(-((epsilon - lin) ** 2) / (2.0 * sq)) if sq > 0.0 else 0.0
            return delta_f + k * share + d_prime

        if not mech:
            return min(basic, total(0.0), 1.0)
        top = math.log((1.0 - delta_f) / k) - 1e-9
        grid = np.linspace(_LOG_SHARE_MIN, top, 70)
        vals = [total(float(g)) for g in grid]
        i = int(np.argmin(vals))
        lo, hi = float(grid[max(i - 1, 0)]), float(grid[min(i + 1, len(grid) - 1)])
        res = optimize.minimize_scalar(total, bounds=(lo, hi), method="bounded", options={"xatol": 1e-6})
        best = min(vals[i], float(res.fun)) if res.success else vals[i]
        return min(basic, best, 1.0)
