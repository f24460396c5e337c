"""The PLD accountant's exact and small-delta paths: one step's exact profile; tilted compositions.

One step of a subsampled Gaussian is answered from its exact profile (Zhu, Dong & Wang 2022, Thm
11), with a relative floating-point allowance on delta (:func:`one_step_delta`).

A delta below the plain FFT's resolution (whose allowance is ``fft_floor`` per delta) is answered
from an exponentially tilted composition (:func:`tilted_epsilon`): ``p_i e^{lam x_i}`` is composed
instead of ``p_i`` (tilting commutes with convolution), which moves the mass that matters for
``delta(epsilon)`` near the peak where the FFT is accurate; the result is untilted, and an FFT
rounding allowance of ``1e-14`` per tilted entry, untilted the same way, is added to delta.

References:
    Zhu, Y., Dong, J. & Wang, Y.-X. (2022). Optimal Accounting of Differential Privacy via
    Characteristic Function. AISTATS.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
from scipy import special

from gaussdp._lazy import lazy_module
from gaussdp.accounting._pld_fft import circular_spectrum, spectrum_power, window, window_pmf
from gaussdp.accounting._pld_grid import Discretisation
from gaussdp.accounting._pld_values import (
    LAMBDAS,
    MAX_FFT,
    BelowFloor,
    Direction,
    delta_profile,
    lambda_rungs,
    solve_between,
)
from gaussdp.accounting._profiles import subsampled_log_delta
from gaussdp.accounting.events import Event, SubsampledGaussianEvent

if TYPE_CHECKING:
    from scipy import fft
else:
    fft = lazy_module("scipy.fft")  # imported on first use: keeps `import gaussdp` cheap

# Relative allowance on the exact one-step delta for floating-point error: against 50-digit mpmath
# (400 random points, sigma in [0.3, 1e3], q in [1e-9, 1], epsilon in [1e-9, 30]) subsampled_log_delta
# was within 3e-8 of the true delta wherever delta > 1e-30 and within 3e-5 below that (cancellation
# between the two terms); tests/accounting check it at DP-SGD settings.
ONE_STEP_REL = 1e-6
ONE_STEP_REL_TINY = 1e-3  # for delta < 1e-30


def one_step_delta(event: SubsampledGaussianEvent, epsilon: float) -> float:
    """The exact delta(epsilon) of one subsampled Gaussian step (max over both directions), rounded up.

    Exact by Zhu, Dong & Wang 2022, Theorem 11 (the pair in :mod:`gaussdp.accounting._profiles`).
    """
    sigma, q = event.noise_multiplier, event.sample_rate
    log_d = max(
        float(subsampled_log_delta(sigma, q, epsilon, "remove")[0]),
        float(subsampled_log_delta(sigma, q, epsilon, "add")[0]),
    )
    rel = ONE_STEP_REL if log_d > -69.0 else ONE_STEP_REL_TINY
    return min(1.0, math.exp(log_d) * (1.0 + rel))


def tilted_epsilon(
    counts: Mapping[Event, int], h: float, tail_mass: float, delta: float, eps_guess: float
) -> float:
    """Epsilon at ``delta`` from the tilted composition of both directions on grid ``h`` (an upper bound).

    Args:
        counts: the composition (leaf event -> count).
        h: the grid spacing.
        tail_mass: the truncation mass, far below ``delta`` (it is added to delta).
        delta: the target delta.
        eps_guess: an epsilon near the answer (another upper bound), or inf: it picks the tilt.

    Raises:
        BelowFloor: the allowances alone exceed ``delta`` or the window is too wide.
    """
    grid = Discretisation(fixed_h=h, tail_mass=tail_mass)
    return max(_tilted_epsilon(grid, counts, d, h, delta, eps_guess) for d in ("remove", "add"))


def _tilted_epsilon(
    grid: Discretisation,
    counts: Mapping[Event, int],
    direction: Direction,
    h: float,
    delta: float,
    eps_guess: float,
) -> float:
    parts = grid.parts(counts, direction, h)
    inf_mass = -math.expm1(math.fsum(c * p.log_finite_mass for p, c in parts))
    lo, hi, tail = window(parts, h, grid.tail_mass)
    extra = inf_mass + tail  # FFT rounding is covered by the untilted per-entry allowance below
    if extra >= delta:
        raise BelowFloor
    # Tilt exponent: the Chernoff-optimal lam for the tail at the guessed epsilon.
    rungs = lambda_rungs(math.fsum(c * p.var for p, c in parts), -math.log(grid.tail_mass))
    total_mgf = np.zeros(len(rungs))
    for p, c in parts:
        total_mgf += c * p.log_mgf(rungs, 1)
    guess = eps_guess if math.isfinite(eps_guess) else hi
    lam = float(LAMBDAS[rungs[int(np.argmin(total_mgf - LAMBDAS[rungs] * guess))]])
    start = math.floor(lo / h)
    n = int(fft.next_fast_len(math.ceil(hi / h) - start + 1, real=True))
    if n > MAX_FFT:
        raise BelowFloor
    spec = np.ones(n // 2 + 1, dtype=np.complex128)
    log_m = 0.0
    for p, c in parts:
        x = (p.start + np.arange(len(p.pmf))) * h
        with np.errstate(divide="ignore"):
            lw = np.log(p.pmf) + lam * x
        lm = float(special.logsumexp(lw))
        ls = circular_spectrum(p.start, np.exp(lw - lm), n)
        spec *= ls if c == 1 else spectrum_power(ls, c)
        log_m += c * lm
    tilted = window_pmf(spec, n, start)
    x_win = (start + np.arange(n)) * h
    # untilt: p_j = exp(log_m - lam x_j) * tilted_j; entries far below epsilon may overflow and
    # are garbage, but the search below runs from the top and never reads past the crossing.
    with np.errstate(over="ignore", invalid="ignore"):
        v = np.exp(np.minimum(log_m - lam * x_win, 700.0)) * (tilted + 1e-14)
    a_suf, g_suf, d = delta_profile(v, h, extra)
    above = np.nonzero(~(d <= delta))[0]  # NaN counts as "above": never trusted
    if len(above) == 0:
        return float(x_win[0])
    j = int(above[-1])
    if j == n - 1:
        raise BelowFloor
    return solve_between(
        float(x_win[j]), float(x_win[j + 1]), extra + float(a_suf[j + 1]), float(g_suf[j + 1]), delta
    )
