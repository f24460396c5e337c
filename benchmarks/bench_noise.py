"""Throughput of Gaussian releases: gaussdp's float-safe default and fast paths vs numpy and OpenDP.

Run: ``.venv/bin/python benchmarks/bench_noise.py [--size 10000000] [--repeats 5] [--opendp-size 100000]``

Prints, in one process: values/s (median of ``--repeats`` runs) of ``GaussianMechanism.release`` on
a float32 vector for the default (CSPRNG, floating-point-safe) and ``noise="fast"`` paths, numpy's
raw ``standard_normal`` on the same number of values, and OpenDP's Gaussian measurement (exact
discrete sampling) on ``--opendp-size`` values, with ratios. Goals (issue 2): fast >= 0.9x numpy
raw; default >= 25 M values/s.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np

from gaussdp import GaussianMechanism


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def opendp_rate(size: int, sigma: float) -> float | None:
    try:
        import opendp.prelude as dp
    except ImportError:
        return None
    dp.enable_features("contrib")
    space = dp.vector_domain(dp.atom_domain(T=float, nan=False)), dp.l2_distance(T=float)
    meas = space >> dp.m.then_gaussian(scale=sigma)
    data = [0.0] * size
    start = time.perf_counter()
    meas(data)
    return size / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--opendp-size", type=int, default=100_000)
    args = parser.parse_args()

    n = args.size
    x = (np.random.default_rng(0).standard_normal(n) / np.sqrt(n) * 2.0).astype(np.float32)  # norm ~2
    secure = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0)
    fast = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0, noise="fast")
    rng = np.random.default_rng()

    rows = {
        "release() default (secure, float-safe)": median_seconds(lambda: secure.release(x), args.repeats),
        "release() noise='fast'": median_seconds(lambda: fast.release(x), args.repeats),
        "numpy standard_normal float64 (raw)": median_seconds(lambda: rng.standard_normal(n), args.repeats),
        "numpy standard_normal float32 (raw)": median_seconds(
            lambda: rng.standard_normal(n, dtype=np.float32), args.repeats
        ),
    }
    rates = {name: n / sec / 1e6 for name, sec in rows.items()}
    print(f"values per call: {n:,} float32, sigma={secure.sigma:.4f}; median of {args.repeats} runs")
    for name, rate in rates.items():
        print(f"  {name:<42} {rate:8.2f} M values/s   ({rows[name] * 1e3:8.1f} ms)")
    od = opendp_rate(args.opendp_size, secure.sigma) if args.opendp_size > 0 else None
    if od is not None:
        print(
            f"  {'OpenDP then_gaussian (' + format(args.opendp_size, ',') + ' values, 1 run)':<42} "
            f"{od / 1e6:8.4f} M values/s"
        )
    raw64 = rates["numpy standard_normal float64 (raw)"]
    raw32 = rates["numpy standard_normal float32 (raw)"]
    default = rates["release() default (secure, float-safe)"]
    fast_rate = rates["release() noise='fast'"]
    print("ratios:")
    print(f"  fast / numpy raw float64     = {fast_rate / raw64:.2f}   (goal >= 0.9)")
    print(f"  fast / numpy raw float32     = {fast_rate / raw32:.2f}")
    print(f"  default / numpy raw float64  = {default / raw64:.2f}")
    print(f"  default: {default:.1f} M values/s (goal >= 25)")
    if od is not None:
        print(f"  default / OpenDP             = {default * 1e6 / od:,.0f}x")


if __name__ == "__main__":
    main()
