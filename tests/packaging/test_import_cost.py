"""``import gaussdp`` stays cheap: the heavy modules load on first use, and every public name works."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Modules that `import gaussdp` must not pull in (each costs as much as numpy or more, or is an extra).
HEAVY = ("scipy.optimize", "scipy.fft", "scipy.stats", "scipy.linalg", "torch", "typer", "rich", "fastapi")


def _modules_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nimport json\nprint(json.dumps(sorted(sys.modules)))"
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
    return set(json.loads(out.stdout.splitlines()[-1]))


def test_import_gaussdp_does_not_load_heavy_modules() -> None:
    loaded = _modules_after("import gaussdp")
    assert "gaussdp.accounting.pld" in loaded  # the test sees the real import, not a stub
    assert not [m for m in HEAVY if m in loaded]


def test_heavy_modules_load_on_first_use_and_results_are_unchanged() -> None:
    code = (
        "import sys, gaussdp\n"
        "assert 'scipy.optimize' not in sys.modules\n"
        "s = gaussdp.noise_for_epsilon(target_epsilon=1.0, delta=1e-5, sample_rate=0.01, steps=100)\n"
        "assert 'scipy.optimize' in sys.modules\n"
        "acc = gaussdp.accountant('pld').compose(gaussdp.SubsampledGaussianEvent(s, 0.01), count=100)\n"
        "assert 'scipy.fft' in sys.modules\n"
        "print(acc.epsilon(1e-5))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    eps = float(out.stdout.strip())
    assert 0.9 < eps <= 1.0 + 1e-6  # the noise found for epsilon 1 delivers (about) epsilon 1


def test_every_public_name_is_importable() -> None:
    import gaussdp

    for name in gaussdp.__all__:
        assert getattr(gaussdp, name) is not None, name


def test_lazy_module_imports_on_first_attribute() -> None:
    from gaussdp._lazy import LazyModule

    lazy = LazyModule("json")
    assert "not yet imported" in repr(lazy)
    assert lazy.dumps([1]) == "[1]"
    assert "loaded" in repr(lazy) and "dumps" in dir(lazy)
    with pytest.raises(ModuleNotFoundError):
        LazyModule("gaussdp_no_such_module").anything  # noqa: B018


def test_import_benchmark_prints_both_times_and_the_ratio() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_import.py"), "--runs", "1", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    r = json.loads(out.stdout)
    assert r["baseline_s"] > 0 and r["gaussdp_s"] > 0
    assert r["ratio"] == pytest.approx(r["gaussdp_s"] / r["baseline_s"])
