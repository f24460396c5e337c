"""Check that T steps never cost less than one step, over small noise multipliers (issue 28).

    python scripts/check_small_noise_grid.py            # the whole grid (a few minutes on 2 cores)
    python scripts/check_small_noise_grid.py --quick    # a corner of it (seconds)

For every noise multiplier in 1e-3..0.2, sample rate in 1e-3..1 and step count in 1..1000, with the
PLD and RDP accountants, ``epsilon(T steps) >= epsilon(1 step)`` at delta 1e-5 must hold for every
answer given; an answer may instead be a refusal (epsilon above 1e6 or a numerical fault, an
:class:`~gaussdp.errors.InvalidParameter`), never a smaller number, never another exception. It
prints the counts, the smallest ratio T-step / one-step, and exits 1 on a violation. Noise 1e-4 (the
smallest multiplier accepted) is checked the same way; below it the event itself is refused.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

from gaussdp.accounting import SubsampledGaussianEvent, accountant
from gaussdp.errors import InvalidParameter

DELTA = 1e-5


def _epsilon(name: str, event: SubsampledGaussianEvent, steps: int) -> float | None:
    try:
        return accountant(name).compose(event, count=steps).epsilon(DELTA)
    except InvalidParameter:
        return None  # refused: epsilon above 1e6, or no certified bound (fails closed)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2 x 2 x 3 corner of the grid")
    args = parser.parse_args()
    noises = [1e-4, 1e-3, 3e-3, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2]
    rates = [1e-3, 0.01, 0.04, 0.1, 0.5, 1.0]
    steps = [2, 10, 25, 100, 1000]
    if args.quick:
        noises, rates, steps = [1e-3, 0.03], [0.04, 1.0], [2, 25, 100]
    try:
        SubsampledGaussianEvent(noise_multiplier=5e-5, sample_rate=0.5)
    except InvalidParameter as exc:
        print(f"noise 5e-5: refused ({exc})")
    else:
        print("noise 5e-5 was accepted: below the certified domain")
        return 1
    start = time.perf_counter()
    answered = refused = violations = 0
    worst = float("inf")
    for name, z, q in itertools.product(("pld", "rdp"), noises, rates):
        event = SubsampledGaussianEvent(noise_multiplier=z, sample_rate=q)
        one = _epsilon(name, event, 1)
        for t in steps:
            many = _epsilon(name, event, t)
            if many is None:
                refused += 1
                continue
            answered += 1
            if one is None:
                # one step refused as too large: T steps must not be answered below that bound
                print(f"VIOLATION {name} noise={z} q={q} T={t}: {many} answered where one step is refused")
                violations += 1
                continue
            worst = min(worst, many / one)
            if many < one:
                print(f"VIOLATION {name} noise={z} q={q} T={t}: {many} < one step {one}")
                violations += 1
    print(
        f"{answered} answers, {refused} refused (epsilon > 1e6 or no certified bound), {violations} below "
        f"one step; smallest T-step / one-step ratio {worst:.6f}; {time.perf_counter() - start:.0f} s"
    )
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
