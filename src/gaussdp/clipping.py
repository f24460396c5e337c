"""Bound the sensitivity: L2 clipping of vectors, of rows, and of whole parameter trees.

Clipping is what makes the sensitivity of a release a theorem instead of a hope: after
``clip_l2(x, C)`` the contribution of one record has L2 norm at most ``C``, so adding or removing it
moves a sum by at most ``C`` (add/remove neighbouring relation), and replacing it by at most ``2C``.

Guarantees, for every function here:

* the L2 norm of the clipped data, computed in float64 (``numpy.linalg.norm(out.astype(float64))``),
  is never above ``clip_norm``: the scale factor is ``C / norm`` and, when rounding to the array's
  dtype pushed the result one ulp over, it is shrunk again until the float64 norm is at most ``C``;
* clipping never increases any norm: data already inside the ball are returned unchanged (a copy),
  data outside it are multiplied by a factor below 1;
* NaN or Inf anywhere raises :class:`~gaussdp.errors.UnsafeInput` (a NaN norm would silently skip
  the clip); so do empty arrays. bool, complex and object dtypes raise ``TypeError``;
* float16/float32/float64 keep their dtype (integers become float64); norms of float32 data are
  accumulated in float64 chunk by chunk, without a float64 copy of the whole array.

:func:`clipped_sum` clips every row and returns only the float64 sum (what DP-FedAvg releases): two
passes over the data, no copy of it, and a per-row bound proved in real arithmetic instead of
checked after the fact (see its docstring).

numpy arrays everywhere; torch tensors (any device) in all four functions when torch is installed.
torch is never imported by this module unless a tensor is passed in.

The module is over 600 lines on purpose: each clip has a numpy and a torch path, and the float-safety
argument (float64 accumulation, the shrink-until-the-float64-norm-fits loop) is the same for both, so
they are reviewed and changed side by side.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from gaussdp._validate import check_positive
from gaussdp.errors import UnsafeInput

__all__ = ["clip_l2", "clip_rows", "clip_tree", "clipped_sum", "l2_norm"]

# Elements per chunk when float32 data are accumulated in float64 (bounded temporaries).
_CHUNK = 1 << 16
# float64 sums of squares outside this range may have overflowed or lost precision: rescale.
_SAFE_SQ_MIN = 1e-280
_SAFE_SQ_MAX = 1e280
# Re-scalings tried before giving up and returning zeros (only subnormal data get near it).
_MAX_SHRINKS = 64
# clipped_sum: squares are summed in the data's dtype over column chunks of _SUM_COLS (the rounding
# bound grows with the chunk length), in blocks of about _SUM_ELEMS elements (1 MB of float32, L2
# sized); the weighted sum reads row blocks of about _SUM_BLOCK elements per BLAS call.
_SUM_COLS = 1024
_SUM_ELEMS = 1 << 18
_SUM_BLOCK = 1 << 24
# A float32 estimate whose underflow allowance is above this fraction of it is redone exactly.
_UNDERFLOW_SHARE = 2.0**-30


def shrink_factor(factor: float, clip_norm: float, got: float, eps: float) -> float:
    """A smaller scale factor after ``x * factor`` came out with norm ``got > clip_norm``.

    Shrinks by the overshoot and a few ulps, so that ordinary one-ulp overshoots need one retry and
    subnormal data (whose rounding can overshoot a lot) do not loop for long.
    """
    return factor * min(1.0, clip_norm / got) * (1.0 - 4.0 * eps)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _as_numpy(name: str, x: Any, *, allow_empty: bool = False) -> NDArray[Any]:
    """``x`` as a float ndarray (float16/32/64 kept, integers -> float64), or a clear error."""
    if isinstance(x, np.ndarray):
        arr = x
    else:
        try:
            arr = np.asarray(x)
        except (ValueError, TypeError) as exc:  # ragged nested lists
            raise UnsafeInput(f"{name} is not a rectangular numeric array: {exc}") from None
    kind = arr.dtype.kind
    if kind == "b":
        raise TypeError(f"{name} must be a real-valued array, got dtype bool")
    if kind == "c":
        raise TypeError(f"{name} must be a real-valued array, got complex dtype {arr.dtype}")
    if kind in "iu":
        arr = arr.astype(np.float64)
    elif kind != "f":
        raise TypeError(f"{name} must be a real-valued numeric array, got dtype {arr.dtype}")
    if arr.size == 0 and not allow_empty:
        raise UnsafeInput(f"{name} is empty (shape {arr.shape}); nothing to clip")
    return arr


def _sumsq64(flat: NDArray[Any]) -> float:
    """Sum of squares of a 1-D float array, accumulated in float64.

    Overflow is expected for huge entries and is handled by the caller (rescaling), so numpy's
    overflow warning is silenced here.
    """
    with np.errstate(over="ignore"):
        if flat.dtype == np.float64:
            return float(np.dot(flat, flat))
        total = 0.0
        for start in range(0, flat.size, _CHUNK):
            chunk = flat[start : start + _CHUNK].astype(np.float64)
            total += float(np.dot(chunk, chunk))
        return total


def _norm64(name: str, arr: NDArray[Any]) -> float:
    """float64 L2 norm of all elements of ``arr``; UnsafeInput on NaN/Inf."""
    flat = arr.reshape(-1)
    sq = _sumsq64(flat)
    if _SAFE_SQ_MIN <= sq <= _SAFE_SQ_MAX:
        return math.sqrt(sq)
    if not math.isfinite(sq) and not bool(np.isfinite(flat).all()):
        raise UnsafeInput(f"{name} contains NaN or Inf; refusing to clip (nothing released)")
    if sq == 0.0 and not bool(np.any(flat)):
        return 0.0
    # Overflow or underflow of the squares: rescale by the largest magnitude first.
    m = float(np.max(np.abs(flat)))
    scaled = flat.astype(np.float64) / m
    return m * math.sqrt(float(np.dot(scaled, scaled)))


def l2_norm(name: str, x: Any) -> float:
    """float64 L2 norm of all elements of a real array (no float64 copy of float32 data).

    Raises UnsafeInput on NaN/Inf (naming ``name``) or an empty array, TypeError on bool/complex.
    """
    arr = _as_numpy(name, x)
    return _norm64(name, arr)


def _scale_numpy(name: str, arr: NDArray[Any], norm: float, clip_norm: float) -> NDArray[Any]:
    """``arr * (C / norm)`` in arr's dtype, shrunk until its float64 norm is at most C."""
    factor = clip_norm / norm
    info = np.finfo(arr.dtype)
    eps = float(info.eps)
    for _ in range(_MAX_SHRINKS):
        if factor < float(info.tiny):
            # C / norm is subnormal or zero in arr's dtype: first scale by the power of two of the
            # norm (exact), then by C / mantissa, which is representable
            k = math.frexp(norm)[1]
            second = arr.dtype.type(
                factor * math.ldexp(1.0, k) if factor > 0 else clip_norm / math.ldexp(norm, -k)
            )
            out: NDArray[Any] = (np.ldexp(arr, -k) * second).astype(arr.dtype, copy=False)
        else:
            out = (arr * arr.dtype.type(factor)).astype(arr.dtype, copy=False)
        got = _norm64(name, out)
        if got <= clip_norm:
            return out
        factor = shrink_factor(factor, clip_norm, got, eps)
    return np.zeros_like(arr)  # subnormal rounding kept overshooting: the zero vector is inside


def clip_l2(x: Any, clip_norm: float) -> tuple[Any, float]:
    """Scale ``x`` (any shape) so that its L2 norm over all elements is at most ``clip_norm``.

    Args:
        x: array-like of real numbers (numpy array, nested list, scalar) or a torch tensor.
        clip_norm: the bound C, > 0.

    Returns:
        ``(clipped, norm)``: the clipped data (same shape; same dtype for floats, float64 for
        integers; a tensor for a tensor) and the float64 L2 norm of ``x`` before clipping.

    Raises:
        UnsafeInput: NaN/Inf in ``x``, or ``x`` is empty.
        TypeError: bool, complex or non-numeric data.
        InvalidParameter: ``clip_norm`` is not a finite number > 0.

    >>> import numpy as np
    >>> clipped, norm = clip_l2(np.array([3.0, 4.0]), 1.0)
    >>> clipped, norm
    (array([0.6, 0.8]), 5.0)
    """
    c = check_positive("clip_norm", clip_norm)
    if _is_torch(x):
        return _clip_torch_leaves([x], c, "x")
    arr = _as_numpy("x", x)
    norm = _norm64("x", arr)
    if norm <= c:
        return arr.copy(), norm
    return _scale_numpy("x", arr, norm, c), norm


def clip_rows(X: Any, clip_norm: float) -> tuple[Any, NDArray[np.float64]]:
    """Clip every row of a 2-D array to L2 norm at most ``clip_norm`` (one record per row).

    Args:
        X: 2-D array-like (n_rows, dim) of real numbers, or a 2-D torch tensor.
        clip_norm: the bound C, > 0.

    Returns:
        ``(clipped, norms)``: the clipped rows (same dtype for floats) and a float64 array of each
        row's L2 norm before clipping.

    Raises:
        UnsafeInput: NaN/Inf (the message names the first bad row), not 2-D, or no rows/columns.
        TypeError: bool, complex or non-numeric data.
        InvalidParameter: ``clip_norm`` is not a finite number > 0.

    >>> import numpy as np
    >>> clipped, norms = clip_rows(np.array([[3.0, 4.0], [0.3, 0.4]]), 1.0)
    >>> clipped.round(12).tolist(), norms.tolist()
    ([[0.6, 0.8], [0.3, 0.4]], [5.0, 0.5])
    """
    c = check_positive("clip_norm", clip_norm)
    if _is_torch(X):
        return _clip_rows_torch(X, c)
    arr = _as_numpy("X", X)
    if arr.ndim != 2:
        raise UnsafeInput(f"X must be a 2-D array (rows, dim), got shape {arr.shape}")
    norms = _row_norms64(arr)
    return _scale_rows(arr, norms, c), norms


def _scale_rows(arr: NDArray[Any], norms: NDArray[np.float64], c: float) -> NDArray[Any]:
    """A copy of ``arr`` whose rows of norm above ``c`` are scaled until their float64 norm is <= c."""
    out = arr.copy()
    big = np.flatnonzero(norms > c)
    if big.size:
        eps = float(np.finfo(arr.dtype).eps)
        factors = c / norms[big]
        todo = big
        for _ in range(_MAX_SHRINKS):
            out[todo] = (arr[todo] * factors[:, None]).astype(arr.dtype, copy=False)
            after = _row_norms64(out[todo])
            over = after > c
            todo, factors = todo[over], factors[over] * (c / after[over]) * (1.0 - 4.0 * eps)
            if not todo.size:
                break
        else:
            out[todo] = 0.0
    return out


def _row_norms64(arr: NDArray[Any]) -> NDArray[np.float64]:
    """float64 L2 norm of each row, in row blocks; UnsafeInput naming the first non-finite row."""
    n, d = arr.shape
    sq = np.empty(n, dtype=np.float64)
    rows = max(1, _CHUNK // max(d, 1))
    for start in range(0, n, rows):
        block = arr[start : start + rows].astype(np.float64, copy=False)
        sq[start : start + rows] = np.einsum("ij,ij->i", block, block)
    norms = np.sqrt(sq)
    suspect = np.flatnonzero(~((sq >= _SAFE_SQ_MIN) & (sq <= _SAFE_SQ_MAX)))
    if suspect.size:  # zero rows are fine; overflow, underflow and NaN/Inf rows are redone
        exact_zero = sq[suspect] == 0.0
        exact_zero[exact_zero] = ~np.any(arr[suspect[exact_zero]], axis=1)
        suspect = suspect[~exact_zero]
    for i in suspect:
        norms[i] = _norm64(f"X[{i}]", arr[i])
    return norms


def clipped_sum(X: Any, clip_norm: float) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Sum of the rows of ``X``, each clipped to L2 norm at most ``clip_norm``, without a clipped copy.

    What a clipped-sum release (DP-FedAvg's aggregate) needs: every row ``x_i`` contributes
    ``w_i x_i`` with a factor ``w_i`` in [0, 1] computed from that row alone and
    ``||w_i x_i|| <= clip_norm``, so adding or removing one row (one record, one client) moves the
    sum by at most ``clip_norm`` (add/remove neighbouring relation), by ``2 clip_norm`` when replaced.
    Two passes over the data, no copy of the matrix; float32 and float64 data take the path below,
    other dtypes (float16) are clipped row block by row block as below, torch tensors by
    :func:`clip_rows`, and summed in float64.

    Why the bound holds (``u`` is the unit roundoff of the dtype, 2^-24 for float32, 2^-53 for
    float64; ``tiny`` its smallest normal number):

    1. *An upper bound on each squared norm.* The squares are summed in the dtype over column chunks
       of ``k <= 1024`` entries (a BLAS/SIMD dot product: fast, and never copied to float64), the
       chunk totals added in float64. In whatever order and with or without FMA, the computed sum
       of ``k`` non-negative products is at least ``(1 - gamma_k) s - eta``, ``s`` the exact sum,
       ``gamma_k = k u / (1 - k u)``, ``eta = 4 k tiny`` the absolute error of underflow (gradual or
       flushed to zero). With ``T`` the float64 total of ``n_c`` chunks (error ``gamma_{n_c}`` at
       2^-53), ``U = (T / (1 - gamma_{n_c}) + n_c eta) / (1 - gamma_k)``, rounded up, is at least
       the exact squared norm, and ``R = sqrt(U)`` rounded up bounds the norm.
    2. *Weights.* ``w_i = 1`` when ``R_i <= C``, else ``w_i = C / R_i * (1 - 16 u)``. Rounding
       ``w_i`` to the dtype and each product ``w_i x_ij`` (relative error ``u`` each, absolute
       ``u tiny`` for a subnormal product) gives ``||w_i x_i|| <= C (1 - 16 u)(1 + u)^3 +
       sqrt(dim) u tiny < C`` for ``C >= sqrt(dim) tiny``: the clipped row, even rounded to the
       dtype, lies in the ball.
    3. *The sum*: ``w_block @ X_block`` (BLAS matrix-vector product in the dtype) per block of rows,
       accumulated in float64, as a plain sum of clipped rows would be.

    Rows whose estimate is not finite (NaN/Inf, or squares beyond the dtype's range) or is dominated
    by the underflow term ``eta``, and rows whose weight would leave the normal range, are clipped
    as :func:`clip_rows` does (float64 norm, re-checked after scaling) to ``C (1 - 2^-20 - dim
    2^-50)``, which absorbs the rounding of a float64 norm; so is everything when
    ``C < sqrt(dim) tiny`` or the dtype is not float32/float64. A row within ``gamma_k / 2`` (3e-5
    for float32) of ``C`` may be scaled by a factor a hair below 1: the bound is rigorous, not tight.

    Args:
        X: 2-D array-like (n_rows, dim) of real numbers, or a 2-D torch tensor. Zero rows are
            allowed (the sum is then the zero vector).
        clip_norm: the bound C, > 0.

    Returns:
        ``(total, norms)``: the float64 sum of the clipped rows (length ``dim``) and a float64 array
        of each row's L2 norm before clipping. For float32/float64 data a norm is the estimate
        ``sqrt(T)``, within a relative ``gamma_k / 2`` of the exact one (exact for the rows redone
        exactly); fine for reporting and for adaptive clipping, never used as the clip bound.

    Raises:
        UnsafeInput: NaN/Inf (the message names the first bad row), not 2-D, or no columns.
        TypeError: bool, complex or non-numeric data.
        InvalidParameter: ``clip_norm`` is not a finite number > 0.

    References:
        Higham 2002, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., Lemma 3.1 and
        Eq. (3.5) (``gamma_n`` bound of a dot product, any order of summation).

    >>> import numpy as np
    >>> total, norms = clipped_sum(np.array([[3.0, 4.0], [0.3, 0.4]], dtype=np.float32), 1.0)
    >>> total.round(5).tolist(), norms.round(5).tolist()
    ([0.9, 1.2], [5.0, 0.5])
    """
    c = check_positive("clip_norm", clip_norm)
    if _is_torch(X):
        return _clipped_sum_torch(X, c)
    arr = _as_numpy("X", X, allow_empty=True)
    if arr.ndim != 2:
        raise UnsafeInput(f"X must be a 2-D array (rows, dim), got shape {arr.shape}")
    n, d = arr.shape
    if d == 0:
        raise UnsafeInput(f"X has no columns (shape {arr.shape}); nothing to clip")
    if n == 0:
        return np.zeros(d, dtype=np.float64), np.zeros(0, dtype=np.float64)
    if arr.dtype not in (np.float32, np.float64) or c < math.sqrt(d) * float(np.finfo(arr.dtype).tiny):
        return _clipped_sum_by_rows(arr, c)
    return _clipped_sum_weighted(arr, c)


def _clipped_sum_by_rows(arr: NDArray[Any], c: float) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """clip_rows block by block (bounded memory), the clipped rows summed in float64."""
    n, d = arr.shape
    norms = _row_norms64(arr)
    total = np.zeros(d, dtype=np.float64)
    step = max(1, _SUM_BLOCK // d)
    for start in range(0, n, step):
        block = _scale_rows(arr[start : start + step], norms[start : start + step], _exact_target(c, d))
        total += np.sum(block, axis=0, dtype=np.float64)
    return total, norms


def _exact_target(c: float, d: int) -> float:
    """The clip norm for rows clipped on their float64 norm, whose relative error is below d 2^-52."""
    return c * (1.0 - 2.0**-20 - d * 2.0**-50)


def _row_sq(block: NDArray[Any]) -> NDArray[Any]:
    """Sum of squares of each row, in the block's dtype (any summation order)."""
    out: NDArray[Any]
    if hasattr(np, "vecdot"):  # numpy >= 2: a dot product per row
        out = np.vecdot(block, block)
    else:
        out = np.einsum("ij,ij->i", block, block)
    return out


def _clipped_sum_weighted(arr: NDArray[Any], c: float) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The two-pass clipped sum of float32/float64 rows (see clipped_sum for the argument)."""
    n, d = arr.shape
    info = np.finfo(arr.dtype)
    u, tiny = float(info.eps) / 2.0, float(info.tiny)
    cols = min(d, _SUM_COLS)
    chunks = -(-d // cols)
    rows = max(1, _SUM_ELEMS // cols)

    # Pass 1: float64 totals of the per-chunk sums of squares (computed in the dtype).
    sq = np.empty(n, dtype=np.float64)
    with np.errstate(over="ignore"):  # overflowing squares make inf: those rows are redone exactly
        for start in range(0, n, rows):
            block = arr[start : start + rows]
            acc = np.zeros(block.shape[0], dtype=np.float64)
            for col in range(0, d, cols):
                acc += _row_sq(block[:, col : col + cols])
            sq[start : start + rows] = acc

    # U = (T / (1 - gamma_chunks) + chunks eta) / (1 - gamma_k); 1 + 2^-48 covers the float64
    # roundings of this formula and of the sqrt below (a few units of 2^-53 each).
    g_k = cols * u / (1.0 - cols * u)
    g_t = chunks * 2.0**-53 / (1.0 - chunks * 2.0**-53)
    slack = 1.0 + 2.0**-48
    scale = slack / ((1.0 - g_t) * (1.0 - g_k))
    underflow = slack * chunks * 4.0 * cols * tiny / (1.0 - g_k)
    finite = np.isfinite(sq)
    exact = ~finite | (underflow > sq * _UNDERFLOW_SHARE)
    # A bound past the float64 range gives the weight 0 (redone exactly); C / bound overflows only
    # where bound <= C, and that branch is not taken.
    with np.errstate(over="ignore"):
        bound = np.sqrt(np.where(finite, sq, 0.0) * scale + underflow) * slack
        weights = np.where(bound <= c, 1.0, c / bound * (1.0 - 16.0 * u))
    exact |= weights < tiny  # a subnormal weight would not round with relative error u
    weights[exact] = 0.0
    norms = np.sqrt(sq)

    # Rows redone exactly, in order (the first NaN/Inf row is the one named), summed in float64.
    # Their float64 norms carry a relative error below dim 2^-52 (any summation order): clipping them
    # to _exact_target(C) keeps their exact norms <= C, not only the computed ones.
    c_exact = _exact_target(c, d)
    total = np.zeros(d, dtype=np.float64)
    for i in np.flatnonzero(exact).tolist():
        row = arr[i]
        if sq[i] == 0.0 and not row.any():
            norms[i] = 0.0
            continue
        norms[i] = _norm64(f"X[{i}]", row)
        if norms[i] <= c_exact:
            total += row
        else:  # clip_rows' scaling (float64 factor, re-checked), on this row alone
            norm = norms[i : i + 1]
            if not c_exact / norm[0] >= 2.0**-900:  # a subnormal factor, or the norm overflows:
                # scale by powers of two (exact but for negligible underflow) to a norm in (2C, 8C].
                row = np.ldexp(row, -math.frexp(float(np.max(np.abs(row))))[1])
                norm = np.array([_norm64(f"X[{i}]", row)])
                k = math.frexp(norm[0])[1] - math.frexp(c_exact)[1] - 2
                row, norm = np.ldexp(row, -k), np.ldexp(norm, -k)
            total += _scale_rows(row[None, :], norm, c_exact)[0]

    # Pass 2: weighted sums of row blocks in the dtype (BLAS), accumulated in float64.
    w = weights.astype(arr.dtype)
    step = max(1, _SUM_BLOCK // d)
    for start in range(0, n, step):
        block, wb = arr[start : start + step], w[start : start + step]
        part = wb @ block
        if not np.isfinite(part).all():  # only for a C near the dtype's largest numbers
            part = wb.astype(np.float64) @ block.astype(np.float64)
        total += part
    return total, norms


def _clipped_sum_torch(X: Any, c: float) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    import torch

    if X.dim() == 2 and X.shape[0] == 0 and X.shape[1] > 0 and X.is_floating_point():
        return np.zeros(X.shape[1], dtype=np.float64), np.zeros(0, dtype=np.float64)
    clipped, norms = _clip_rows_torch(X, c)
    total = torch.sum(clipped, dim=0, dtype=torch.float64).cpu().numpy()
    return total, norms


def clip_tree(tree: Any, clip_norm: float) -> tuple[Any, float]:
    """Clip a dict or list of arrays/tensors by their global L2 norm (all leaves together).

    This is the per-example (or per-client update) clipping of DP-SGD and DP-FedAvg: the whole
    gradient or update, across all parameters, is scaled by one factor ``min(1, C / norm)``.
    Nested dicts and lists are allowed; every leaf must be a non-empty real array or tensor.

    Args:
        tree: a non-empty ``dict`` (or Mapping) or ``list``/``tuple`` of numpy arrays, array-likes or
            torch tensors, possibly nested.
        clip_norm: the bound C, > 0.

    Returns:
        ``(clipped_tree, global_norm)``: same structure and leaf types (floats keep their dtype),
        and the float64 global norm before clipping.

    Raises:
        UnsafeInput: NaN/Inf in a leaf (named by its path), an empty tree or leaf, a ragged leaf.
        TypeError: a leaf that is not real numeric data; a tree that is not a dict/list/tuple.
        InvalidParameter: ``clip_norm`` is not a finite number > 0.

    >>> import numpy as np
    >>> clipped, norm = clip_tree({"w": np.array([3.0]), "b": np.array([4.0])}, 1.0)
    >>> norm, clipped["w"].round(12).tolist(), clipped["b"].round(12).tolist()
    (5.0, [0.6], [0.8])
    """
    c = check_positive("clip_norm", clip_norm)
    if not isinstance(tree, Mapping | list | tuple):
        raise TypeError(f"tree must be a dict, list or tuple of arrays, got {type(tree).__name__}")
    paths: list[str] = []
    leaves: list[Any] = []
    _flatten(tree, "tree", paths, leaves)
    if not leaves:
        raise UnsafeInput("tree has no leaves; nothing to clip")
    arrays: list[Any] = []
    sq = 0.0
    for path, leaf in zip(paths, leaves, strict=True):
        if _is_torch(leaf):
            n = _torch_norm64(path, leaf)
            arrays.append(leaf)
        else:
            arr = _as_numpy(path, leaf)
            n = _norm64(path, arr)
            arrays.append(arr)
        sq += n * n
    norm = math.sqrt(sq)
    if not math.isfinite(norm):
        raise UnsafeInput(f"the global norm of tree overflows float64 (norm={norm})")
    factor = 1.0
    if norm > c:
        factor = c / norm
    for attempt in range(_MAX_SHRINKS + 1):
        if attempt == _MAX_SHRINKS:
            factor = 0.0
        clipped = [_scale_leaf(a, factor) for a in arrays]
        total = math.sqrt(sum(_leaf_norm_sq(p, a) for p, a in zip(paths, clipped, strict=True)))
        if total <= c or norm <= c:
            break
        factor = shrink_factor(factor, c, total, 2.0**-22)
    it = iter(clipped)
    return _unflatten(tree, it), norm


def _flatten(node: Any, path: str, paths: list[str], leaves: list[Any]) -> None:
    if isinstance(node, Mapping):
        if not node:
            raise UnsafeInput(f"{path} is an empty dict")
        for key, value in node.items():
            _flatten(value, f"{path}[{key!r}]", paths, leaves)
    elif isinstance(node, list | tuple) and (not node or _is_subtree(node)):
        if not node:
            raise UnsafeInput(f"{path} is an empty list")
        for i, value in enumerate(node):
            _flatten(value, f"{path}[{i}]", paths, leaves)
    else:
        paths.append(path)
        leaves.append(node)


def _is_subtree(node: Sequence[Any]) -> bool:
    """A list/tuple holding arrays, tensors or dicts is a tree; a plain nested list is one leaf."""
    return any(not _is_plain(v) for v in node)


def _is_plain(v: Any) -> bool:
    """A (nested) list of numbers: a leaf, not a subtree."""
    if isinstance(v, list | tuple):
        return all(_is_plain(e) for e in v)
    return not (isinstance(v, np.ndarray | Mapping) or _is_torch(v))


def _unflatten(node: Any, it: Any) -> Any:
    if isinstance(node, Mapping):
        return type(node)((k, _unflatten(v, it)) for k, v in node.items())  # type: ignore[call-arg]
    if isinstance(node, list | tuple) and _is_subtree(node):
        items = [_unflatten(v, it) for v in node]
        return type(node)(items) if isinstance(node, list) else tuple(items)
    return next(it)


def _scale_leaf(a: Any, factor: float) -> Any:
    if _is_torch(a):
        out = a.detach().clone() if factor == 1.0 else a.detach() * factor
        return out.to(a.dtype)
    if factor == 1.0:
        return a.copy()
    return (a * a.dtype.type(factor)).astype(a.dtype, copy=False)


def _leaf_norm_sq(path: str, a: Any) -> float:
    n = _torch_norm64(path, a) if _is_torch(a) else _norm64(path, a)
    return n * n


# --- torch back end (imported only when a tensor is passed) ---------------------------------------


def _check_torch_dtype(name: str, t: Any) -> None:
    import torch

    if t.dtype == torch.bool:
        raise TypeError(f"{name} must be a real-valued tensor, got dtype torch.bool")
    if t.is_complex():
        raise TypeError(f"{name} must be a real-valued tensor, got complex dtype {t.dtype}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if t.numel() == 0:
        raise UnsafeInput(f"{name} is empty (shape {tuple(t.shape)}); nothing to clip")


def _torch_norm64(name: str, t: Any) -> float:
    """float64 L2 norm of a tensor, in chunks (no float64 copy of a large tensor)."""
    import torch

    _check_torch_dtype(name, t)
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.float64:
        n = float(torch.linalg.vector_norm(flat))
    else:
        sq = 0.0
        for start in range(0, flat.numel(), _CHUNK * 16):
            chunk = flat[start : start + _CHUNK * 16].to(torch.float64)
            sq += float(torch.dot(chunk, chunk))
        n = math.sqrt(sq)
    if not math.isfinite(n):
        if not bool(torch.isfinite(flat).all()):
            raise UnsafeInput(f"{name} contains NaN or Inf; refusing to clip (nothing released)")
        raise UnsafeInput(f"the norm of {name} overflows float64")
    return n


def _clip_torch_leaves(leaves: list[Any], c: float, name: str) -> tuple[Any, float]:
    t = leaves[0]
    norm = _torch_norm64(name, t)
    if norm <= c:
        return t.detach().clone(), norm
    factor = c / norm
    for _ in range(_MAX_SHRINKS):
        out = (t.detach() * factor).to(t.dtype)
        got = _torch_norm64(name, out)
        if got <= c:
            return out, norm
        factor = shrink_factor(factor, c, got, 2.0**-22)
    return t.detach() * 0.0, norm


def _clip_rows_torch(X: Any, c: float) -> tuple[Any, NDArray[np.float64]]:
    import torch

    _check_torch_dtype("X", X)
    if X.dim() != 2:
        raise UnsafeInput(f"X must be a 2-D tensor (rows, dim), got shape {tuple(X.shape)}")
    Xd = X.detach()
    norms_t = torch.linalg.vector_norm(Xd, dim=1, dtype=torch.float64)
    if not bool(torch.isfinite(norms_t).all()):
        bad = int(torch.nonzero(~torch.isfinite(norms_t))[0, 0])
        raise UnsafeInput(f"X[{bad}] contains NaN or Inf (or its norm overflows); nothing clipped")
    factors = torch.clamp(c / norms_t.clamp_min(1e-300), max=1.0)
    out = (Xd * factors[:, None]).to(X.dtype)
    for attempt in range(_MAX_SHRINKS + 1):
        after = torch.linalg.vector_norm(out, dim=1, dtype=torch.float64)
        over = after > c
        if not bool(over.any()):
            break
        shrunk = factors * (c / after.clamp_min(1e-300)) * (1.0 - 2.0**-22)
        factors = torch.where(over, shrunk if attempt < _MAX_SHRINKS else 0.0 * factors, factors)
        out = (Xd * factors[:, None]).to(X.dtype)
    return out, norms_t.cpu().numpy()
