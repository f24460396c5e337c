"""Import time of ``import gaussdp`` beside ``import numpy, scipy.special``, in one run.

Each figure is the median wall time of fresh interpreter subprocesses (``python -c``), measured inside
the child with ``time.perf_counter`` around the import only, so interpreter start-up is not counted.
The two statements are interleaved run by run so that machine load falls on both alike. The target
(issue 22) is a ratio of at most 1.5.

    python benchmarks/bench_import.py [--runs 11] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

BASELINE = "import numpy, scipy.special"
TARGET = "import gaussdp"
LIMIT = 1.5


def time_import(statement: str) -> float:
    """Seconds taken by ``statement`` in a fresh interpreter (imports only, not start-up)."""
    code = f"import time\nt = time.perf_counter()\n{statement}\nprint(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def measure(runs: int) -> dict[str, float]:
    base: list[float] = []
    ours: list[float] = []
    time_import(TARGET)  # warm the file-system cache and .pyc files; not counted
    for _ in range(runs):
        base.append(time_import(BASELINE))
        ours.append(time_import(TARGET))
    b, g = statistics.median(base), statistics.median(ours)
    return {"runs": runs, "baseline_s": b, "gaussdp_s": g, "ratio": g / b, "limit": LIMIT}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=11, help="subprocesses per statement (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be >= 1, got --runs={args.runs}")
    r = measure(args.runs)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"{BASELINE:<30} {r['baseline_s'] * 1e3:8.1f} ms  (median of {r['runs']} fresh processes)")
        print(f"{TARGET:<30} {r['gaussdp_s'] * 1e3:8.1f} ms")
        print(f"ratio                          {r['ratio']:8.2f}   (target <= {LIMIT})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
