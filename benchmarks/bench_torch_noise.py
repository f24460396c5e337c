"""DP-SGD gradient noise: the torch engine's keystream source vs ``torch.randn``, in one process.

Run: ``.venv/bin/python benchmarks/bench_torch_noise.py [--size 670346] [--reps 51]``

Adds ``std * N(0, 1)`` in place to a float32 (and a float64) gradient of ``--size`` values (default:
the parameter count of the MLP 784-512-512-10 of ``bench_dpsgd.py`` case (a)), three ways:

* ``keystream``: ``KeystreamNormal.add_`` (AES-128-CTR from OpenSSL + the compiled Box-Muller kernel
  ``gaussdp._gauss``), what ``PrivacyEngine()`` uses;
* ``torch.randn``: a draw from an OS-seeded ``torch.Generator`` (Mersenne Twister), then ``add_``:
  what the engine falls back to without the kernel, and what Opacus does by default;
* ``torch.normal_``: the same generator filling a reused buffer (no allocation), then ``add_``.

Prints the median CPU time (``thread_time``, one torch thread) of interleaved repetitions and the
ratio of each to the keystream. The noise draw is about a quarter of a plain step of case (a).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from gaussdp.torch._random import KeystreamNormal, keystream_normal_available, torch_generator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10)
    ap.add_argument("--reps", type=int, default=51)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not keystream_normal_available():
        raise SystemExit("gaussdp._gauss or cryptography is missing: nothing to compare")
    source, gen = KeystreamNormal(), torch_generator(None, "bench")
    print(f"torch {torch.__version__}, threads 1, {args.size} values, median of {args.reps} reps")
    print(f"{'dtype':<9}{'method':<16}{'ms':>8}{'M values/s':>12}{'ratio':>8}")
    for dtype in (torch.float32, torch.float64):
        grad = torch.zeros(args.size, dtype=dtype)
        buf = torch.empty(args.size, dtype=dtype)
        methods: dict[str, Callable[[], object]] = {
            "keystream": lambda g=grad: source.add_(g, 0.01),
            "torch.randn": lambda g=grad, d=dtype: g.add_(
                torch.randn(args.size, generator=gen, dtype=d), alpha=0.01
            ),
            "torch.normal_": lambda g=grad, b=buf: g.add_(b.normal_(generator=gen), alpha=0.01),
        }
        times: dict[str, list[float]] = {m: [] for m in methods}
        for fn in methods.values():
            fn()  # warm-up
        for _ in range(args.reps):
            for m, fn in methods.items():  # interleaved: a busy machine slows all alike
                t0 = time.thread_time()
                fn()
                times[m].append(time.thread_time() - t0)
        base = statistics.median(times["keystream"])
        for m, ts in times.items():
            med = statistics.median(ts)
            name = str(dtype).removeprefix("torch.")
            print(f"{name:<9}{m:<16}{med * 1e3:>8.3f}{args.size / med / 1e6:>12.1f}{med / base:>7.2f}x")


if __name__ == "__main__":
    main()
