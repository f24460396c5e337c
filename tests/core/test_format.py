"""Printed privacy numbers round the safe way: upper bounds up, lower bounds down, inputs exactly."""

from __future__ import annotations

import math
from decimal import Decimal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gaussdp._format import format_calibrated, format_exact, format_lower, format_upper

finite = st.floats(allow_nan=False, allow_infinity=False)
digits = st.integers(min_value=1, max_value=17)


def _significant(text: str) -> int:
    return len(Decimal(text).normalize().as_tuple().digits)


@settings(max_examples=400, deadline=None)
@given(finite, digits)
def test_upper_is_the_smallest_decimal_of_that_many_digits_at_or_above(x, k):
    text = format_upper(x, k)
    printed, exact = Decimal(text), Decimal(x)
    assert printed >= exact
    assert _significant(text) <= k
    assert float(text) >= x  # and so is what reads back from it
    if printed != exact:  # tight: one unit less in the last place is below the float
        assert printed - Decimal(1).scaleb(printed.adjusted() - k + 1) < exact


@settings(max_examples=400, deadline=None)
@given(finite, digits)
def test_lower_is_the_largest_decimal_of_that_many_digits_at_or_below(x, k):
    text = format_lower(x, k)
    printed, exact = Decimal(text), Decimal(x)
    assert printed <= exact
    assert _significant(text) <= k
    assert float(text) <= x
    if printed != exact:
        assert printed + Decimal(1).scaleb(printed.adjusted() - k + 1) > exact


@settings(max_examples=300, deadline=None)
@given(finite)
def test_exact_reads_back_as_the_same_float(x):
    assert float(format_exact(x)) == x


def test_the_issue_cases_and_the_layout():
    # issue 28: "gaussdp account printed exact 8.895232137 as 8.89523 (below exact)"
    assert f"{8.895232137:.6g}" == "8.89523" and format_upper(8.895232137) == "8.89524"
    assert format_upper(1e-5) == "1.00001e-05"  # the float 1e-5 lies above the decimal 1e-5
    assert format_exact(1e-5) == "1e-05" and format_exact(14063.0) == "14063"
    assert format_upper(123456789.0) == "1.23457e+08" and format_lower(123456789.0) == "1.23456e+08"
    assert format_upper(999999.5) == "1e+06" and format_upper(0.00012345678) == "0.000123457"
    assert format_upper(5e-324) == "4.94066e-324" and format_upper(1.7976931348623157e308, 3) == "1.8e+308"
    assert format_upper(-2.5) == "-2.5"
    assert format_upper(-2.55, 2) == "-2.5" and format_lower(-2.55, 2) == "-2.6"  # toward +inf / -inf
    assert format_upper(0.0) == "0" and format_upper(-0.0) == "0"
    assert format_upper(math.inf) == "inf" and format_lower(-math.inf) == "-inf"
    assert format_upper(np.float32(0.1)) == "0.100001" and format_upper(np.float64(2.0)) == "2"
    assert format_upper(3) == "3"


def test_faults_fail_closed():
    for f in (format_upper, format_lower, format_exact):
        with pytest.raises(FloatingPointError, match="not a number"):
            f(math.nan)
        with pytest.raises(TypeError):
            f(True)
        with pytest.raises(TypeError):
            f("1.0")
    with pytest.raises(ValueError, match="digits"):
        format_upper(1.0, 0)
    with pytest.raises(ValueError, match="digits"):
        format_upper(1.0, 18)


def test_calibrated_noise_is_rounded_up_and_re_checked():
    text, value = format_calibrated(0.6557749, lambda s: True)
    assert (text, value) == ("0.655775", 0.655775)
    # A non-monotone check: the first printed value fails, so the last digit goes up until it holds.
    seen = []

    def meets(s):
        seen.append(s)
        return s >= 0.6557780

    assert format_calibrated(0.6557749, meets) == ("0.655778", 0.655778)
    assert seen == [0.655775, 0.655776, 0.655777, 0.655778]
    assert format_calibrated(9.999991, lambda s: s >= 10.0) == ("10", 10.0)  # carries into a new digit
    with pytest.raises(FloatingPointError, match="does not meet"):
        format_calibrated(1.0, lambda s: False)
    with pytest.raises(FloatingPointError):
        format_calibrated(math.inf, lambda s: True)
    with pytest.raises(FloatingPointError):
        format_calibrated(0.0, lambda s: True)
