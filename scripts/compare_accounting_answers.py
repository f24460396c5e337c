"""Record every accountant's answers over a grid of events, or compare them with a recorded run.

    python scripts/compare_accounting_answers.py record before.json    # on the old checkout
    python scripts/compare_accounting_answers.py compare before.json   # on the new one

For a refactoring of the accountants that must not change a number: the PLD, RDP, basic and
advanced accountants, every event kind, corners down to sigma 0.05, q 1e-6, 1e6 steps, deltas down
to 1e-16, 150 online steps and fixed grids (about 4,400 answers). An answer is the same when equal
to 1e-12 relative, or when both are the same refusal (its exception's name). ``compare`` prints each
difference and exits 1 if there is one.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator
from typing import Any

from gaussdp.accounting import (
    ComposedEvent,
    DiscreteGaussianEvent,
    EpsilonDeltaEvent,
    Event,
    FixedBatchGaussianEvent,
    GaussianEvent,
    LaplaceEvent,
    PLDAccountant,
    PrivacyLossDistributionEvent,
    PrivacyProfileEvent,
    ReplaceOneSubsampledGaussianEvent,
    SelfComposedEvent,
    SubsampledGaussianEvent,
    accountant,
)

DELTAS = (1e-3, 1e-5, 1e-9, 1e-12, 1e-16)
EPSILONS = (0.0, 0.5, 2.0, 8.0)
ACCOUNTANTS = ("pld", "rdp", "basic", "advanced")


def cases() -> Iterator[tuple[str, list[tuple[Event, int]]]]:
    g, s, r = GaussianEvent, SubsampledGaussianEvent, ReplaceOneSubsampledGaussianEvent
    yield "gauss", [(g(1.0), 1)]
    yield "gauss_many", [(g(0.7), 10), (g(3.0), 5)]
    for sigma in (0.05, 0.6, 1.1, 5.0, 100.0):
        for q in (1e-6, 1e-3, 0.01, 0.3, 1.0):
            for n in (1, 2, 100, 10000):
                if sigma < 0.5 and n > 100:
                    continue
                yield f"sub_{sigma}_{q}_{n}", [(s(sigma, q), n)]
    yield "sub_long", [(s(1.0, 1e-3), 10**6)]
    yield "sub_hetero", [(s(1.1, 0.01), 500), (s(2.0, 0.05), 300), (g(5.0), 10)]
    yield "ro_sub", [(r(1.1, 0.01), 1000)]
    yield "ro_sub1", [(r(0.8, 0.2), 1)]
    yield "fixed", [(FixedBatchGaussianEvent(1.0, 64, 10000), 500)]
    yield "epsdelta", [(EpsilonDeltaEvent(1.0, 1e-6), 3)]
    yield "epsdelta0", [(EpsilonDeltaEvent(0.5, 0.0), 10)]
    yield "epsdelta_mix", [(EpsilonDeltaEvent(0.5, 0.0), 2), (s(1.0, 0.01), 1000)]
    yield "epsdelta_mix_tinyq", [(EpsilonDeltaEvent(2.0, 0.0), 1), (s(50.0, 1e-5), 100000)]
    yield "epsdelta_mixd", [(EpsilonDeltaEvent(0.1, 1e-7), 5), (g(2.0), 4)]
    yield "laplace", [(LaplaceEvent(1.0), 10)]
    yield "laplace_mix", [(LaplaceEvent(2.0, 0.5), 3), (s(1.0, 0.02), 100)]
    yield "dgauss", [(DiscreteGaussianEvent(3.0, 2), 20)]
    yield "pld_ev", [(PrivacyLossDistributionEvent((-0.5, 0.2, 1.0), (0.2, 0.5, 0.29)), 7)]
    yield "profile", [(PrivacyProfileEvent((0.5, 1.0, 2.0), (1e-2, 1e-4, 1e-7)), 4)]
    yield "composed", [(ComposedEvent((g(2.0), SelfComposedEvent(s(1.3, 0.02), 50))), 3)]


def _answer(f: Any, x: float) -> float | str:
    try:
        return float(f(x))
    except Exception as exc:  # a refusal is an answer too: the same refusal is the same answer
        return type(exc).__name__


def run() -> dict[str, float | str]:
    out: dict[str, float | str] = {}
    for label, events in cases():
        for name in ACCOUNTANTS:
            acc = accountant(name)
            try:
                for event, count in events:
                    acc.compose(event, count)
            except Exception as exc:
                out[f"{label}|{name}|compose"] = type(exc).__name__
                continue
            for d in DELTAS:
                out[f"{label}|{name}|eps|{d}"] = _answer(acc.epsilon, d)
            for e in EPSILONS:
                out[f"{label}|{name}|delta|{e}"] = _answer(acc.delta, e)
    # online: one step at a time, queried after each (the stepped checkpoint path)
    online = {"online_a": SubsampledGaussianEvent(1.0, 0.01), "online_b": SubsampledGaussianEvent(0.8, 0.05)}
    for label, ev in online.items():
        acc = accountant("pld")
        for i in range(150):
            acc.compose(ev)
            out[f"{label}|{i}|eps"] = _answer(acc.epsilon, 1e-5)
            if i % 10 == 0:
                out[f"{label}|{i}|delta"] = _answer(acc.delta, 1.0)
    for h in (1e-3, 1e-2, 0.05):  # explicit grids
        pld = PLDAccountant(value_discretization_interval=h).compose(SubsampledGaussianEvent(1.0, 0.01), 1000)
        for d in DELTAS:
            out[f"h{h}|eps|{d}"] = _answer(pld.epsilon, d)
    return out


def _same(a: float | str | None, b: float | str | None) -> bool:
    if isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        return a == b
    return a == b or (math.isfinite(a) and abs(a - b) <= 1e-12 * max(abs(a), abs(b)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("record", "compare"))
    parser.add_argument("path", help="the JSON file of a recorded run")
    args = parser.parse_args()
    start = time.perf_counter()
    out = run()
    print(f"{len(out)} answers in {time.perf_counter() - start:.0f} s")
    if args.mode == "record":
        with open(args.path, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=0)
        return 0
    with open(args.path, encoding="utf-8") as f:
        ref = json.load(f)
    bad = [k for k in ref if not _same(ref[k], out.get(k))]
    for k in bad:
        print(f"DIFF {k}: {ref[k]!r} -> {out.get(k)!r}")
    missing = sorted(set(ref) ^ set(out))
    print(f"compared {len(ref)}, differences {len(bad)}, keys in one run only {len(missing)}")
    return 1 if bad or missing else 0


if __name__ == "__main__":
    sys.exit(main())
