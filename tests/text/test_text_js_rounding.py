"""The text page shows epsilons rounded up, like the CLI: text_core.js's ``upperText`` under Node.

The page's figures come from the service as JSON floats; ``toPrecision`` (what the page used) rounds
to nearest and shows some epsilons below the value it received. ``upperText`` must give, for every
double, the smallest decimal of that many significant digits at or above it: checked here against
Python's exact decimals (gaussdp._format.format_upper gives the same values).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from decimal import Decimal
from pathlib import Path

import numpy as np
import pytest

from gaussdp._format import format_upper

NODE = shutil.which("node")
CORE = Path(__file__).resolve().parents[2] / "src" / "gaussdp" / "text" / "static" / "text_core.js"

pytestmark = pytest.mark.skipif(NODE is None, reason="needs Node.js to run the page's JavaScript")


def _js(values, digits, fn="upperText"):
    script = (
        f"const c = require({json.dumps(str(CORE))}).gaussdpCore;"
        "const data = JSON.parse(require('fs').readFileSync(0, 'utf8'));"
        f"process.stdout.write(JSON.stringify(data.map(([x, k]) => {{"
        f"  try {{ return c.{fn}(x, k); }} catch (e) {{ return 'error'; }} }})));"
    )
    payload = json.dumps([[v, d] for v, d in zip(values, digits, strict=True)])
    out = subprocess.run([NODE, "-e", script], input=payload, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_upper_text_is_the_smallest_decimal_at_or_above_every_double():
    rng = np.random.default_rng(28)
    bits = rng.integers(0, 2**63 - 2**52, 1500, dtype=np.int64)  # finite positive doubles, every exponent
    values = [float(v) for v in bits.view(np.float64)]
    values += [float(v) for v in rng.lognormal(0.0, 3.0, 1500)]  # the epsilons a page shows
    values += [8.895232137, 0.1, 1e-5, 5e-324, 1.7976931348623157e308, 999999.5, 2.0, 3.25, -2.55]
    digits = [int(d) for d in rng.integers(1, 16, len(values))]
    shown = _js(values, digits)
    for x, k, text in zip(values, digits, shown, strict=True):
        printed, exact = Decimal(text), Decimal(x)
        assert printed >= exact, (x, k, text)
        assert printed == Decimal(format_upper(x, k)), (x, k, text, format_upper(x, k))


def test_upper_text_refuses_non_numbers_and_the_old_rounding_was_below():
    assert _js([0.0, 0.5], [4, 4]) == ["0", "0.5000"]  # toPrecision's layout (trailing zeros)
    script = f"const c = require({json.dumps(str(CORE))}).gaussdpCore; console.log(c.upperText(NaN, 4))"
    out = subprocess.run([NODE, "-e", script], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "non-number" in out.stderr
    # toPrecision(4), the page's old formatting, shows 8.895 for 8.895232137: below it
    old = subprocess.run(
        [NODE, "-e", "console.log((8.895232137).toPrecision(4))"], capture_output=True, text=True, timeout=60
    )
    exact = 8.895232137
    assert Decimal(old.stdout.strip()) < Decimal(exact)
    assert _js([8.895232137], [4]) == ["8.896"]
