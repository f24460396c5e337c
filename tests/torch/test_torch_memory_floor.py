"""The one-pass memory floor that ``benchmarks/bench_dpsgd.py`` prints under its CNN rows.

It is a lower bound for exact one-pass methods that keep per-sample gradients or (input, output
gradient) per layer; gaussdp is one, so its measured peak can never be below it, and it must lie
above plain training's peak (something has to be kept while the first layer's gradient is pending).
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        yield importlib.import_module("bench_dpsgd")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def test_the_floor_lies_between_plain_and_gaussdp_on_the_mnist_cnn(bench) -> None:  # type: ignore[no-untyped-def]
    plain = bench.peak_bytes("plain", "d")
    ours = bench.peak_bytes("gaussdp", "d")
    floor = bench.one_pass_floor("d")
    # the second convolution's input and output gradient (64 x (16 x 13 x 13 + 32 x 5 x 5) floats)
    # must be held through the first max-pool's backward, where plain training peaks
    held = 64 * (16 * 13 * 13 + 32 * 5 * 5) * 4
    assert floor >= plain + held // 2
    assert floor <= ours
    assert ours - floor <= 0.03 * plain, (plain, floor, ours)  # gaussdp sits at the floor
