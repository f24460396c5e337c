"""Clipping invariants (hypothesis), dtypes, torch, and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from gaussdp import InvalidParameter, UnsafeInput, clip_l2, clip_rows, clip_tree, clipped_sum


def _norm64(a) -> float:
    """float64 L2 norm, rescaled when the plain sum of squares would overflow or underflow."""
    flat = np.asarray(a, dtype=np.float64).reshape(-1)
    m = float(np.max(np.abs(flat))) if flat.size else 0.0
    if m == 0.0 or (1e-150 < m < 1e150):
        return float(np.linalg.norm(flat))
    return m * float(np.linalg.norm(flat / m))


finite32 = st.floats(-(2.0**100), 2.0**100, width=32, allow_nan=False, allow_infinity=False)
finite64 = st.floats(-1e300, 1e300, allow_nan=False, allow_infinity=False)
clip_norms = st.floats(1e-30, 1e30, allow_nan=False, allow_infinity=False).filter(lambda c: c > 0)


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(
        hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=20), elements=finite32),
        hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=3, max_side=20), elements=finite64),
    ),
    clip_norms,
)
def test_clip_l2_never_exceeds_and_never_increases(x, c):
    out, norm = clip_l2(x, c)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert _norm64(out) <= c  # computed in float64, the last ulp included
    assert _norm64(out) <= _norm64(x)  # clipping never increases a norm
    assert norm == pytest.approx(_norm64(x), rel=1e-12)
    if norm <= c:
        np.testing.assert_array_equal(out, x)
    else:
        # Direction kept: out is a non-negative multiple of x.
        assert np.all(np.abs(out) <= np.abs(x))


@settings(max_examples=100, deadline=None)
@given(
    hnp.arrays(np.float32, st.tuples(st.integers(1, 30), st.integers(1, 12)), elements=finite32),
    clip_norms,
)
def test_clip_rows_every_row(X, c):
    out, norms = clip_rows(X, c)
    assert out.dtype == np.float32 and norms.dtype == np.float64
    row_norms = np.linalg.norm(out.astype(np.float64), axis=1)
    assert np.all(row_norms <= c)
    assert np.all(row_norms <= np.linalg.norm(X.astype(np.float64), axis=1))


@settings(max_examples=100, deadline=None)
@given(
    st.lists(hnp.arrays(np.float32, st.integers(1, 8), elements=finite32), min_size=1, max_size=4),
    clip_norms,
)
def test_clip_tree_global_norm(leaves, c):
    tree = {f"p{i}": a for i, a in enumerate(leaves)}
    out, norm = clip_tree(tree, c)
    assert set(out) == set(tree)
    total = math.sqrt(sum(_norm64(v) ** 2 for v in out.values()))
    assert total <= c
    assert all(out[k].dtype == np.float32 for k in out)
    assert norm == pytest.approx(math.sqrt(sum(_norm64(v) ** 2 for v in leaves)), rel=1e-9)


def test_last_ulp_float32():
    # Vectors whose scaled float32 rounding lands just above C in float64 get shrunk again.
    rng = np.random.default_rng(0)
    for _ in range(2000):
        x = rng.standard_normal(int(rng.integers(1, 64))).astype(np.float32) * 10
        c = float(rng.uniform(0.1, 3.0))
        out, _ = clip_l2(x, c)
        assert _norm64(out) <= c


def test_extreme_magnitudes():
    out, norm = clip_l2(np.array([1e300, 1e300]), 1.0)
    assert norm == pytest.approx(math.sqrt(2) * 1e300) and _norm64(out) <= 1.0
    out, norm = clip_l2(np.array([3e-200, 4e-200]), 1e-200)
    assert norm == pytest.approx(5e-200) and _norm64(out) <= 1e-200
    out, norm = clip_l2(np.zeros(5, np.float32), 1.0)
    assert norm == 0.0 and not out.any()


def test_scalars_integers_and_lists():
    out, norm = clip_l2(-3.0, 1.0)
    assert float(out) == -1.0 and norm == 3.0
    out, norm = clip_l2([3, 4], 1.0)
    assert out.dtype == np.float64 and norm == 5.0
    out, norms = clip_rows([[3, 4], [0, 0]], 1.0)
    np.testing.assert_allclose(out, [[0.6, 0.8], [0.0, 0.0]], rtol=1e-15)
    assert norms.tolist() == [5.0, 0.0]


def test_clip_tree_structures():
    tree = [np.ones(2, np.float32), {"a": np.ones(2), "b": (np.ones(1),)}]
    out, norm = clip_tree(tree, 1.0)
    assert isinstance(out, list) and isinstance(out[1]["b"], tuple)
    assert norm == pytest.approx(math.sqrt(5))
    assert out[0].dtype == np.float32


def test_torch_tensors():
    torch = pytest.importorskip("torch")
    t = torch.full((4, 3), 2.0, dtype=torch.float32, requires_grad=True)
    out, norm = clip_l2(t, 1.0)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and not out.requires_grad
    assert float(torch.linalg.vector_norm(out.double())) <= 1.0 and norm == pytest.approx(4 * math.sqrt(3))
    rows, norms = clip_rows(torch.randn(50, 7, dtype=torch.float64) * 5, 1.0)
    assert rows.dtype == torch.float64 and norms.shape == (50,)
    assert float(torch.linalg.vector_norm(rows, dim=1).max()) <= 1.0
    tree, gnorm = clip_tree({"w": torch.ones(3), "b": np.ones(1, np.float32)}, 1.0)
    assert isinstance(tree["w"], torch.Tensor) and isinstance(tree["b"], np.ndarray)
    assert gnorm == pytest.approx(2.0)
    with pytest.raises(UnsafeInput, match="NaN"):
        clip_tree({"w": torch.tensor([1.0, float("nan")])}, 1.0)
    with pytest.raises(TypeError, match="bool"):
        clip_l2(torch.tensor([True]), 1.0)
    with pytest.raises(UnsafeInput, match=r"X\[1\]"):
        clip_rows(torch.tensor([[1.0, 0.0], [float("inf"), 0.0]]), 1.0)


@pytest.mark.parametrize("func", [clip_l2, clip_rows, clip_tree, clipped_sum])
@pytest.mark.parametrize("c", [0.0, -1.0, math.nan, math.inf])
def test_bad_clip_norm(func, c):
    x = {"a": np.ones(2)} if func is clip_tree else np.ones((2, 2))
    with pytest.raises(InvalidParameter, match="clip_norm"):
        func(x, c)


def test_bad_clip_norm_type():
    with pytest.raises(TypeError, match="clip_norm"):
        clip_l2(np.ones(2), True)


@pytest.mark.parametrize(
    ("x", "exc", "word"),
    [
        (np.array([1.0, np.nan]), UnsafeInput, "NaN"),
        (np.array([np.inf, 1.0], dtype=np.float32), UnsafeInput, "NaN or Inf"),
        (np.array([]), UnsafeInput, "empty"),
        (np.array([True, False]), TypeError, "bool"),
        (np.array([1 + 2j]), TypeError, "complex"),
        (np.array(["a"]), TypeError, "dtype"),
        ([[1.0, 2.0], [3.0]], UnsafeInput, "rectangular"),
    ],
)
def test_clip_l2_bad_input(x, exc, word):
    with pytest.raises(exc, match=word):
        clip_l2(x, 1.0)


@pytest.mark.parametrize(
    ("X", "exc", "word"),
    [
        (np.ones(3), UnsafeInput, "2-D"),
        (np.ones((0, 3)), UnsafeInput, "empty"),
        (np.ones((3, 0)), UnsafeInput, "empty"),
        (np.array([[1.0, 0.0], [np.nan, 0.0]]), UnsafeInput, r"X\[1\]"),
        (np.array([[True]]), TypeError, "bool"),
    ],
)
def test_clip_rows_bad_input(X, exc, word):
    with pytest.raises(exc, match=word):
        clip_rows(X, 1.0)


@pytest.mark.parametrize(
    ("tree", "exc", "word"),
    [
        ({}, UnsafeInput, "empty dict"),
        ([], UnsafeInput, "empty list"),
        ({"a": {}}, UnsafeInput, "empty dict"),
        ({"a": [[1.0, 2.0], [3.0]]}, UnsafeInput, "rectangular"),
        ({"a": np.ones(2), "b": np.array([np.nan])}, UnsafeInput, r"tree\['b'\]"),
        ({"a": np.array([], dtype=np.float32)}, UnsafeInput, "empty"),
        ({"a": np.array([True])}, TypeError, "bool"),
        ({"a": np.array([1j])}, TypeError, "complex"),
        (np.ones(3), TypeError, "dict, list or tuple"),
        ("abc", TypeError, "dict, list or tuple"),
    ],
)
def test_clip_tree_bad_input(tree, exc, word):
    with pytest.raises(exc, match=word):
        clip_tree(tree, 1.0)


def test_no_large_float64_copy_for_float32():
    # The float64 norm of a float32 array is accumulated chunk by chunk.
    tracemalloc = pytest.importorskip("tracemalloc")
    x = np.ones(4_000_000, dtype=np.float32)  # 16 MB; a float64 copy would be 32 MB
    tracemalloc.start()
    _, norm = clip_l2(x, 1.0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert norm == pytest.approx(2000.0)
    assert peak < 2.2 * x.nbytes  # the output (16 MB) plus small chunks


# --- clipped_sum: the sum of the clipped rows, without the clipped copy ------------------------------


def _clipped_rows64(X, c):
    """Each row times min(1, c / norm), in float64 (rescaled: no overflow, no subnormal factor)."""
    rows = []
    for x in np.asarray(X, dtype=np.float64):
        y = x / float(np.max(np.abs(x))) if x.any() else x
        rows.append(x if _norm64(x) <= c else y * (c / _norm64(y)))  # _norm64(x) may overflow
    return np.array(rows)


def _check_clipped_sum(X, c, rel=2e-4):
    """clipped_sum agrees with the float64 sum of the clipped rows; every contribution is in the ball."""
    total, norms = clipped_sum(X, c)
    assert total.dtype == np.float64 and total.shape == (X.shape[1],)
    assert norms.dtype == np.float64 and norms.shape == (X.shape[0],)
    np.testing.assert_allclose(norms, clip_rows(X, c)[1], rtol=1e-4)
    # Each row is scaled by at most gamma_k / 2 + 2^-20 (relative) more than needed.
    clipped = _clipped_rows64(X, c)
    budget = rel * sum(_norm64(r) for r in clipped) + 1e-300
    assert _norm64(total - clipped.sum(axis=0)) <= budget
    parts = np.zeros_like(total)
    for i in range(X.shape[0]):
        part, _ = clipped_sum(X[i : i + 1], c)  # the row's contribution, computed in float64
        assert _norm64(part) <= c  # in the ball, the last ulp included
        assert np.all(np.abs(part) <= np.abs(X[i].astype(np.float64)))  # a factor in [0, 1]
        parts += part
    # The weight of a row depends on that row alone: the sum is the sum of the contributions.
    assert _norm64(total - parts) <= 1e-5 * sum(_norm64(r) for r in clipped) + 1e-300
    return total, norms


@settings(max_examples=100, deadline=None)
@given(
    st.one_of(
        hnp.arrays(np.float32, st.tuples(st.integers(1, 20), st.integers(1, 12)), elements=finite32),
        hnp.arrays(np.float64, st.tuples(st.integers(1, 20), st.integers(1, 12)), elements=finite64),
    ),
    clip_norms,
)
def test_clipped_sum_matches_clip_rows(X, c):
    _check_clipped_sum(X, c)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_clipped_sum_many_chunks_and_rows_at_the_bound(dtype):
    # 5 column chunks; rows placed just inside, on and just outside the ball, where the rigorous
    # bound (not the estimate) decides.
    rng = np.random.default_rng(3)
    X = rng.standard_normal((40, 5000))
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    X *= np.array([1 - 1e-3, 1 - 1e-6, 1.0, 1 + 1e-6, 1 + 1e-3, 0.1, 10.0, 1e4] * 5)[:, None]
    X = X.astype(dtype)
    _, norms = _check_clipped_sum(X, 1.0)
    np.testing.assert_allclose(norms, np.linalg.norm(X.astype(np.float64), axis=1), rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("c", [1e-30, 1.0, 1e30])
def test_clipped_sum_huge_tiny_and_zero_rows(dtype, c):
    big = np.finfo(dtype).max / 4
    X = np.zeros((6, 300), dtype=dtype)
    X[0] = big  # squares overflow the dtype: the exact path
    X[1, ::7] = 1e-30 if dtype == np.float32 else 1e-300  # squares underflow
    X[2, ::3] = np.finfo(dtype).smallest_subnormal * 3  # subnormal entries
    X[3] = 0.5  # an ordinary row
    X[5, :2] = [-big, big]
    _, norms = _check_clipped_sum(X, c)
    assert norms[4] == 0.0
    np.testing.assert_allclose(norms, [_norm64(r) for r in X], rtol=1e-6)


def test_clipped_sum_clip_norm_below_the_normal_range():
    # C < sqrt(dim) * tiny: products could be subnormal, so every row takes the exact path.
    X = np.full((3, 100), 1e-36, dtype=np.float32)
    X[1] *= 1e30
    _check_clipped_sum(X, 1e-37)


def test_clipped_sum_names_the_first_nan_or_inf_row():
    X = np.ones((10, 3000), dtype=np.float32)
    X[2] = 3e38  # finite, but its squares overflow: redone exactly, no error
    X[6, 2999] = np.inf
    X[8, 0] = np.nan
    with pytest.raises(UnsafeInput, match=r"X\[6\] contains NaN or Inf"):
        clipped_sum(X, 1.0)
    with pytest.raises(UnsafeInput, match=r"X\[1\]"):
        clipped_sum(np.array([[1.0, 0.0], [np.nan, 0.0]]), 1.0)


def test_clipped_sum_shapes_and_dtypes():
    total, norms = clipped_sum(np.zeros((0, 7), dtype=np.float32), 1.0)  # nobody: the zero sum
    assert total.tolist() == [0.0] * 7 and norms.shape == (0,)
    for X, exc, word in [
        (np.ones(3), UnsafeInput, "2-D"),
        (np.ones((3, 0)), UnsafeInput, "no columns"),
        (np.array([[True]]), TypeError, "bool"),
        ([[1.0, 2.0], [3.0]], UnsafeInput, "rectangular"),
    ]:
        with pytest.raises(exc, match=word):
            clipped_sum(X, 1.0)
    total, norms = clipped_sum([[3, 4], [0, 0]], 1.0)  # integers: float64
    np.testing.assert_allclose(total, [0.6, 0.8], rtol=1e-12)
    assert norms.tolist() == [5.0, 0.0]
    half = np.array([[3.0, 4.0], [0.3, 0.4]], dtype=np.float16)  # other dtypes: via clip_rows
    total, norms = clipped_sum(half, 1.0)
    np.testing.assert_allclose(total, clip_rows(half, 1.0)[0].astype(np.float64).sum(axis=0))


def test_clipped_sum_torch():
    torch = pytest.importorskip("torch")
    X = torch.randn(30, 9, dtype=torch.float32) * 3
    total, norms = clipped_sum(X, 1.0)
    rows, ref_norms = clip_rows(X, 1.0)
    np.testing.assert_allclose(total, rows.double().sum(0).numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(norms, ref_norms)
    total, norms = clipped_sum(torch.zeros(0, 4), 1.0)
    assert total.tolist() == [0.0] * 4 and norms.shape == (0,)
    with pytest.raises(UnsafeInput, match=r"X\[1\]"):
        clipped_sum(torch.tensor([[1.0, 0.0], [float("nan"), 0.0]]), 1.0)


def test_clipped_sum_makes_no_copy_of_the_matrix():
    tracemalloc = pytest.importorskip("tracemalloc")
    X = np.full((4000, 1000), 0.1, dtype=np.float32)  # 16 MB, every row clipped
    tracemalloc.start()
    total, _ = clipped_sum(X, 1.0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert _norm64(total) == pytest.approx(4000.0, rel=1e-4)
    assert peak < 0.25 * X.nbytes  # row norms, weights and 1 MB blocks only


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_clip_l2_factor_below_the_dtype_normal_range_keeps_the_direction(dtype):
    """C / norm below the smallest number of the dtype: the row is scaled (by the norm's power of
    two, then by C over the mantissa), not zeroed, and its norm is at most C."""
    big = 1e30 if dtype == np.float32 else 1e300
    c = 1e-20 if dtype == np.float32 else 1e-30  # C / norm = 1e-50 and 1e-330: zero in the dtype
    x = np.array([big, -big / 2, 0.0], dtype=dtype)
    out, norm = clip_l2(x, c)
    assert out.dtype == dtype and norm > 0
    got = float(np.linalg.norm(out.astype(np.float64)))
    assert 0.99 * c <= got <= c
    assert np.allclose(out.astype(np.float64) / got, x.astype(np.float64) / norm, rtol=1e-5)
