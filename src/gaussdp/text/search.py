"""Exact nearest-word search: a projected lower bound in float32, then an exact re-check in float64.

The privacy analysis of every word mechanism assumes the released word is *the* nearest vocabulary
word to the noisy vector, so this search must be exact, not "exact up to float32 rounding".

Algorithm (one block of queries at a time, no ``n x V`` matrix is ever held):

1. **Lower bound.** ``P`` holds the ``k`` leading principal directions of the vocabulary (orthonormal
   columns, float64; ``k = 16`` for ``dim > 24``, else no projection and ``k = dim``). For every word
   ``||P^T (q - w)||^2 <= ||q - w||^2``. One float32 GEMM per block of ``k + 1`` columns against
   ``[-2 P^T w | ||P^T w||^2]`` gives ``s_w ~ ||P^T(q - w)||^2 - ||P^T q||^2`` for all words: a third
   of the arithmetic of a full-dimension GEMM at ``dim = 50``. Per block of words the minimum and
   its argument are kept.
2. **Upper bound.** ``U = ||q - w_0||^2`` in float64 for ``w_0``, the word with the smallest bound.
3. **Candidates.** Every word whose bound ``s_w`` is ``<= U - ||P^T q||^2 + eps_q`` (only blocks whose
   minimum passes are recomputed). ``eps_q`` bounds all float32 errors (rounding of the projected
   vectors to float32, ``<= 2^-24`` relative per coordinate, and of the GEMM, ``gamma_{k+1}`` times the
   sum of absolute products, Higham 2002, Theorem 3.5), so the true nearest word is always a candidate:
   ``s_{w*} <= ||P^T(q - w*)||^2 + err <= ||q - w*||^2 + err <= U + err``.
4. **Exact re-check.** The squared distances of the candidates in float64 (from the float32 inputs:
   relative error below ``(dim + 1) 2^-53``). A row whose best two candidates are within ``1e-13``
   relative of each other is decided in exact rational arithmetic (:class:`fractions.Fraction`).

**Fused kernel.** Where the optional C extension ``gaussdp._search`` is built (``setup.py``; it is
used for C-contiguous float32 vocabularies and float32 queries, ``ExactSearch(..., kernel=False)``
forces the numpy path), steps 1-4 run in C per query block without materialising any block of
scores: tiles of 8 queries x 16 words are computed in vector registers against the same operand, and
only the minimum bound of each 512-word block is kept; per query, the word with the smallest bound
gives ``U`` (float64, the same ``(1 + 1e-12)`` margin), the threshold ``U - ||P^T q||^2 + eps_q``
(``eps_q`` computed here in numpy, as above) is rounded *up* to float32, and the blocks whose
minimum passes are recomputed, every word under the threshold being re-checked in float64. The proof
is unchanged: Higham's bound holds for any order of summation and with fused multiply-adds, and
rounding the threshold up only adds candidates. The kernel hands a row back to the numpy path's
full-dimension stage (as for a row over the limit above) when its runner-up is within ``1e-13``
relative of its best float64 distance (a possible tie: exact rational check), when it has more than
``candidate_limit`` candidates, or when it has none; a row over the limit is first searched again by
the kernel with ``P = I`` (no limit), and only its near-ties go on to numpy. This matters for large
noise: at sigma 1.0 (100k x 50) the numpy path collects every projected candidate before it gives up
on a row (about 150 words/s at one thread); the kernel stops counting at the limit, and gives up on a
row before recomputing anything when more than ``candidate_limit`` blocks pass the threshold (each
such block almost always holds a candidate, and handing a row back is always safe). The kernel
releases the GIL, so the query blocks of ``nearest`` run in parallel threads.
Profile at one thread (100k x 50 vocabulary, sigma 0.1, 5120 queries): the numpy path spends 58% of
its time in the float32 GEMM (OpenBLAS), 19% in the per-block argmin and gather over the GEMM's
output, and 23% in thresholds, hot-block recomputation, the float64 re-check and Python per block;
the kernel's whole run takes about as long as the numpy path's GEMM alone (about 1.8x faster).

Tie rule: the smallest exact distance; among words at exactly the same distance, the lowest index.
A row with more than ``candidate_limit`` candidates (noise so large that the projected bound does
not separate words) is searched again with ``P = I`` (the full-dimension float32 GEMM), whose
candidate set is only the words within float32 rounding of the best; the result is the same.

References:
    Higham, N. J. (2002). Accuracy and Stability of Numerical Algorithms, 2nd ed. SIAM. Section 3.1,
    Theorem 3.5 (error bound ``gamma_n = n u / (1 - n u)`` of an inner product).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Any

import numpy as np

__all__ = ["ExactSearch", "reference_nearest"]

_U32 = 2.0**-24  # unit roundoff of float32
_QUERY_BLOCK = 256
# 2048 words x 256 queries of float32 scores = 2 MiB per GEMM output block (fits in L2).
_VOCAB_BLOCK = 2048
_PROJECT_ABOVE_DIM = 24
_PROJECTED_DIM = 16
_TIE_BAND = 1e-13


def _gamma(n: int, u: float) -> float:
    return n * u / (1.0 - n * u)


class _Stage:
    """One lower-bound operand: ``P`` (``dim x k``, or None for the identity) and ``[-2 Wk | |Wk|^2]^T``."""

    def __init__(self, vectors: np.ndarray, projection: np.ndarray | None) -> None:
        self.projection = projection
        if projection is None:
            wk = vectors
            # The float32 vectors are used as they are: no rounding between q, w and the bound.
            self.delta_rel = 0.0
        else:
            wk = (vectors.astype(np.float64) @ projection).astype(np.float32)
            # Rounding P^T w (computed in float64) to float32, and P's distance from orthonormality.
            self.delta_rel = (1.0 + 1e-6) * (_U32 + 1e-12)
        self.k = int(wk.shape[1])
        sq = np.einsum("ij,ij->i", wk, wk, dtype=np.float64)
        self.max_sq = float(np.max(sq)) * (1.0 + 4 * _U32)
        self.operand = np.ascontiguousarray(
            np.concatenate([-2.0 * wk, sq.astype(np.float32)[:, None]], axis=1).T
        )
        # For the C kernel: columns padded to a multiple of 16 with bounds of 3e38 (never a candidate;
        # the kernel also stops at the vocabulary's size).
        n_vocab = self.operand.shape[1]
        padded = np.zeros((self.k + 1, -(-n_vocab // 16) * 16), dtype=np.float32)
        padded[:, :n_vocab] = self.operand
        padded[-1, n_vocab:] = 3e38
        self.padded = padded

    def project(self, q64: np.ndarray) -> np.ndarray:
        if self.projection is None:
            return q64.astype(np.float32)
        return (q64 @ self.projection).astype(np.float32)


class ExactSearch:
    """Exact Euclidean nearest neighbour of float32 query rows among float32 vocabulary rows.

    Args:
        vectors: ``V x dim`` float32 matrix (finite; not copied: keep it read-only).
        candidate_limit: candidates per query above which a row is searched with the full dimension.
    """

    def __init__(
        self, vectors: np.ndarray, *, candidate_limit: int = 256, kernel: bool | None = None
    ) -> None:
        self.vectors = vectors
        self._kernel = _load_kernel() if kernel is None or kernel else None
        if kernel and self._kernel is None:
            raise ImportError("kernel=True but the C kernel gaussdp._search is not built")
        if vectors.dtype != np.float32 or not vectors.flags.c_contiguous:
            self._kernel = None  # the kernel reads C-ordered float32 rows only
        self.candidate_limit = int(candidate_limit)
        n_vocab, dim = vectors.shape
        sq = np.einsum("ij,ij->i", vectors, vectors, dtype=np.float64)
        self.max_norm = float(np.sqrt(np.max(sq))) * (1.0 + 1e-12)
        self.full = _Stage(vectors, None)
        if dim > _PROJECT_ABOVE_DIM and n_vocab > 1:
            x = vectors.astype(np.float64)
            x -= x.mean(axis=0)
            # Leading eigenvectors of the covariance: the directions along which words differ most.
            evals, evecs = np.linalg.eigh(x.T @ x)
            top = np.ascontiguousarray(evecs[:, np.argsort(evals)[::-1][:_PROJECTED_DIM]])
            self.projected: _Stage | None = _Stage(vectors, top)
        else:
            self.projected = None

    def nearest(self, queries: np.ndarray, *, threads: int | None = None) -> np.ndarray:
        """Index of the nearest row of ``vectors`` for each query row (float32, finite, ``n x dim``).

        ``threads``: blocks of queries searched in parallel (default: the CPUs this process may use,
        at most 8). Each block runs single-threaded BLAS (many small GEMMs scale better across
        blocks than inside one GEMM, and do not spin-wait when the machine is oversubscribed).
        """
        n = queries.shape[0]
        out = np.empty(n, dtype=np.int64)
        starts = list(range(0, n, _QUERY_BLOCK))
        if threads is None:
            threads = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
        threads = max(1, min(int(threads), len(starts)))

        def run(lo: int) -> None:
            out[lo : lo + _QUERY_BLOCK] = self._block(queries[lo : lo + _QUERY_BLOCK])

        if len(starts) == 1:  # one block: BLAS keeps its own threads
            run(0)
            return out
        with _single_threaded_blas():
            if threads == 1:
                for lo in starts:
                    run(lo)
            else:
                with ThreadPoolExecutor(max_workers=threads) as pool:
                    for _ in pool.map(run, starts):
                        pass
        return out

    def _block(self, q: np.ndarray) -> np.ndarray:
        st = self.projected if self.projected is not None else self.full
        # the kernel keeps a query's k + 1 bound coefficients in a 64-float tile row
        if self._kernel is not None and q.dtype == np.float32 and st.k < 64:
            return self._block_kernel(self._kernel, np.ascontiguousarray(q))
        return self._block_numpy(q)

    def _block_kernel(self, kernel: Any, q: np.ndarray) -> np.ndarray:
        """Steps 1-4 fused in C (gaussdp._search); rows it hands back are decided by the numpy path."""
        if self.projected is None:
            out, handed_back = self._kernel_stage(kernel, q, self.full, np.iinfo(np.int64).max)
        else:
            out, handed_back = self._kernel_stage(kernel, q, self.projected, self.candidate_limit)
            if handed_back.any() and self.full.k < 64:
                # Rows with too many projected candidates: the full-dimension bound, also in C.
                rows = np.nonzero(handed_back)[0]
                out[rows], again = self._kernel_stage(kernel, q[rows], self.full, np.iinfo(np.int64).max)
                handed_back[rows] = again
        if handed_back.any():
            # The numpy full-dimension stage: its candidates are the words within float32 rounding of
            # the best, and a near-tie is decided there in rational arithmetic.
            out[handed_back] = self._stage(q[handed_back], self.full, None)[0]
        return out

    def _kernel_stage(
        self, kernel: Any, q: np.ndarray, st: _Stage, limit: int
    ) -> tuple[np.ndarray, np.ndarray]:
        m = q.shape[0]
        _, qa, qk_sq, eps = self._bound_terms(q, st)
        offset = np.ascontiguousarray(eps - qk_sq, dtype=np.float64)
        out = np.empty(m, dtype=np.int64)
        status = np.empty(m, dtype=np.int8)
        n_vocab, dim = self.vectors.shape
        kernel.search(
            qa,
            st.padded,
            self.vectors,
            np.ascontiguousarray(q),
            offset,
            out,
            status,
            m,
            st.k + 1,
            st.padded.shape[1],
            n_vocab,
            dim,
            limit,
        )
        return out, status != 0

    def _block_numpy(self, q: np.ndarray) -> np.ndarray:
        if self.projected is None:
            return self._stage(q, self.full, None)[0]
        res, unresolved = self._stage(q, self.projected, self.candidate_limit)
        if unresolved.any():
            res[unresolved], _ = self._stage(q[unresolved], self.full, None)
        return res

    # ------------------------------------------------------------------ one stage
    def _bound_terms(self, q: np.ndarray, st: _Stage) -> tuple[np.ndarray, ...]:
        """``q`` in float64, ``[P^T q | 1]`` in float32, ``||P^T q||^2`` and ``eps_q`` (step 3)."""
        m = q.shape[0]
        q64 = q.astype(np.float64)
        qk = st.project(q64)
        qa = np.empty((m, st.k + 1), dtype=np.float32)
        qa[:, :-1] = qk
        qa[:, -1] = 1.0
        qk_sq = np.einsum("ij,ij->i", qk, qk, dtype=np.float64)
        # eps_q: every float32 error between the computed bound and ||P^T(q - w)||^2 - ||P^T q||^2.
        qn = np.sqrt(np.einsum("ij,ij->i", q64, q64))
        reach = qn + self.max_norm
        delta = st.delta_rel * reach  # ||rounding of P^T q|| + ||rounding of P^T w||
        gemm = _gamma(st.k + 2, _U32) * (st.max_sq + 2.0 * np.sqrt(qk_sq) * self.max_norm)
        eps = 2.0 * reach * delta + delta * delta + 2.0 * gemm + 1e-12 * reach * reach
        return q64, qa, qk_sq, eps

    def _stage(self, q: np.ndarray, st: _Stage, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
        m = q.shape[0]
        n_vocab = self.vectors.shape[0]
        q64, qa, qk_sq, eps = self._bound_terms(q, st)
        starts = list(range(0, n_vocab, _VOCAB_BLOCK))
        bmin = np.empty((m, len(starts)), dtype=np.float32)
        barg = np.empty((m, len(starts)), dtype=np.int64)
        rows = np.arange(m)
        scores = np.empty((m, min(n_vocab, _VOCAB_BLOCK)), dtype=np.float32)
        for b, vlo in enumerate(starts):
            w = min(_VOCAB_BLOCK, n_vocab - vlo)
            block = scores[:, :w]
            np.matmul(qa, st.operand[:, vlo : vlo + w], out=block)
            arg = block.argmin(axis=1)
            bmin[:, b] = block[rows, arg]
            barg[:, b] = arg + vlo
        first = barg[rows, bmin.argmin(axis=1)]
        upper = self._sq_dist(q64, rows, first) * (1.0 + 1e-12)
        threshold = upper - qk_sq + eps

        hot = bmin <= threshold[:, None]
        cand_rows: list[np.ndarray] = []
        cand_cols: list[np.ndarray] = []
        for b in np.nonzero(hot.any(axis=0))[0].tolist():
            vlo = starts[b]
            w = min(_VOCAB_BLOCK, n_vocab - vlo)
            r = np.nonzero(hot[:, b])[0]
            block = qa[r] @ st.operand[:, vlo : vlo + w]
            rr, cc = np.nonzero(block <= threshold[r, None])
            cand_rows.append(r[rr])
            cand_cols.append(cc + vlo)
        c_rows = np.concatenate(cand_rows) if cand_rows else np.empty(0, dtype=np.int64)
        c_cols = np.concatenate(cand_cols) if cand_cols else np.empty(0, dtype=np.int64)
        counts = np.bincount(c_rows, minlength=m)
        unresolved = counts == 0
        if limit is not None:
            unresolved |= counts > limit
        elif unresolved.any():  # the bound proves the first candidate is in the set
            raise RuntimeError("exact search found no candidate for a query; refusing to guess")
        keep = ~unresolved[c_rows]
        c_rows, c_cols = c_rows[keep], c_cols[keep]
        out = np.full(m, -1, dtype=np.int64)
        if c_rows.size:
            self._recheck(q, q64, c_rows, c_cols, out)
        return out, unresolved

    def _sq_dist(self, q64: np.ndarray, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        out = np.empty(rows.size, dtype=np.float64)
        step = 32768
        for lo in range(0, rows.size, step):
            d = self.vectors[cols[lo : lo + step]].astype(np.float64) - q64[rows[lo : lo + step]]
            out[lo : lo + step] = np.einsum("ij,ij->i", d, d)
        return out

    def _recheck(
        self, q: np.ndarray, q64: np.ndarray, rows: np.ndarray, cols: np.ndarray, out: np.ndarray
    ) -> None:
        d2 = self._sq_dist(q64, rows, cols)
        order = np.lexsort((cols, d2, rows))
        rows, cols, d2 = rows[order], cols[order], d2[order]
        starts = np.r_[0, np.nonzero(np.diff(rows))[0] + 1]
        out[rows[starts]] = cols[starts]
        # Rows whose runner-up is within float64 rounding of the best: decide in exact arithmetic.
        ends = np.r_[starts[1:], rows.size]
        multi = starts[(ends - starts) > 1]
        close = multi[d2[multi + 1] <= d2[multi] * (1.0 + _TIE_BAND) + 1e-300]
        for s in close:
            r = rows[s]
            e = s
            while e < rows.size and rows[e] == r and d2[e] <= d2[s] * (1.0 + _TIE_BAND) + 1e-300:
                e += 1
            out[r] = _exact_argmin(q[r], self.vectors, cols[s:e])


def _load_kernel() -> Any:
    """The compiled kernel gaussdp._search, or None where it was not built (numpy path)."""
    try:
        return importlib.import_module("gaussdp._search")
    except ImportError:
        return None


_BLAS_LOCK = threading.Lock()
_BLAS_STATE: dict[str, Any] = {"users": 0, "limiter": None}


@contextlib.contextmanager
def _single_threaded_blas() -> Iterator[None]:
    """BLAS limited to one thread while our own threads split the queries (threadpoolctl if present).

    The limit is process-wide: concurrent searches share it (reference count), and the first to
    start sets it, the last to finish restores BLAS's own setting.
    """
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - without it, BLAS keeps its own threads
        yield
        return
    with _BLAS_LOCK:
        if _BLAS_STATE["users"] == 0:
            _BLAS_STATE["limiter"] = threadpool_limits(limits=1, user_api="blas")
        _BLAS_STATE["users"] += 1
    try:
        yield
    finally:
        with _BLAS_LOCK:
            _BLAS_STATE["users"] -= 1
            if _BLAS_STATE["users"] == 0:
                _BLAS_STATE["limiter"].restore_original_limits()
                _BLAS_STATE["limiter"] = None


def _exact_argmin(query: np.ndarray, vectors: np.ndarray, cols: np.ndarray) -> int:
    """The lowest index among the words at the exactly smallest distance (rational arithmetic)."""
    qf = [Fraction(float(x)) for x in query]
    best: tuple[Fraction, int] | None = None
    for c in sorted(int(c) for c in cols):
        d = sum(((Fraction(float(x)) - y) ** 2 for x, y in zip(vectors[c], qf, strict=True)), Fraction(0))
        if best is None or d < best[0]:
            best = (d, c)
    if best is None:
        raise ValueError("no candidate words")
    return best[1]


def reference_nearest(vectors: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Slow reference with the same tie rule: float64 distances, exact arithmetic for near-ties."""
    out = np.empty(queries.shape[0], dtype=np.int64)
    w64 = vectors.astype(np.float64)
    for i, q in enumerate(queries):
        d2 = np.sum((w64 - q.astype(np.float64)) ** 2, axis=1)
        best = float(d2.min())
        near = np.nonzero(d2 <= best * (1.0 + _TIE_BAND) + 1e-300)[0]
        out[i] = int(near[0]) if near.size == 1 else _exact_argmin(q, vectors, near)
    return out
