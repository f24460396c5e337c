"""Exact nearest-word search (gaussdp.text.search): same answers as exact arithmetic, tie rule included."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from gaussdp.text import Vocabulary
from gaussdp.text.search import ExactSearch, reference_nearest


def _exact_sq(a, b) -> Fraction:
    return sum(
        ((Fraction(float(x)) - Fraction(float(y))) ** 2 for x, y in zip(a, b, strict=True)), Fraction(0)
    )


@pytest.mark.parametrize(
    ("n_vocab", "dim", "sigma"),
    [(3000, 50, 0.1), (3000, 50, 1.0), (2000, 50, 4.0), (1500, 20, 0.3), (700, 8, 0.05)],
)
def test_search_matches_exact_reference(n_vocab, dim, sigma):
    rng = np.random.default_rng(n_vocab + dim)  # test data, not noise for a release
    w = rng.uniform(-1, 1, (n_vocab, dim)).astype(np.float32)
    q = (w[rng.integers(0, n_vocab, 600)] + sigma * rng.standard_normal((600, dim))).astype(np.float32)
    got = ExactSearch(w).nearest(q)
    np.testing.assert_array_equal(got, reference_nearest(w, q))


def test_search_fallback_to_full_dimension_gives_the_same_answers():
    rng = np.random.default_rng(7)
    w = rng.uniform(-1, 1, (2500, 50)).astype(np.float32)
    q = (w[:600] + 0.8 * rng.standard_normal((600, 50))).astype(np.float32)
    tight = ExactSearch(w, candidate_limit=1)  # almost every row goes to the full-dimension stage
    np.testing.assert_array_equal(tight.nearest(q), reference_nearest(w, q))
    np.testing.assert_array_equal(tight.nearest(q, threads=1), ExactSearch(w).nearest(q, threads=2))


def test_search_ties_go_to_the_lowest_index():
    rng = np.random.default_rng(3)
    w = rng.uniform(-1, 1, (1200, 50)).astype(np.float32)
    w[900] = w[5]  # identical vectors: an exact tie for every query
    w[1100] = -w[7]
    q = np.stack([w[900], w[5] + 0.01, np.zeros(50, np.float32) + 0 * w[7]]).astype(np.float32)
    got = ExactSearch(w).nearest(q)
    assert got[0] == 5 and got[1] == 5
    np.testing.assert_array_equal(got, reference_nearest(w, q))


def test_search_is_exact_where_float32_scores_cannot_tell():
    """Two words whose squared distances to the query differ by ~1e-9 relative: float32 GEMM scores
    (as faiss computes them) cannot order them; the exact search must return the closer one."""
    rng = np.random.default_rng(11)
    dim = 50
    w = rng.uniform(-1, 1, (800, dim)).astype(np.float32)
    q = rng.uniform(-0.2, 0.2, dim).astype(np.float32)
    far = w[3].copy()
    near = far.copy()
    # Nudge one coordinate by one float32 ulp towards the query: a tiny but real improvement.
    k = int(np.argmax(np.abs(far - q)))
    near[k] = np.nextafter(far[k], q[k], dtype=np.float32)
    w[3], w[700] = far, near  # the closer word has the higher index
    assert _exact_sq(near, q) < _exact_sq(far, q)
    w[:3] += 3  # keep every other word farther than these two
    w[4:700] += 3
    w[701:] += 3
    w = np.clip(w, -4, 4).astype(np.float32)
    assert ExactSearch(w).nearest(q[None, :])[0] == 700


def test_vocabulary_nearest_uses_the_exact_search():
    rng = np.random.default_rng(5)
    w = rng.uniform(-1, 1, (1000, 50)).astype(np.float32)
    vocab = Vocabulary([f"w{i}" for i in range(1000)], w)
    q = (w[:300] + 0.3 * rng.standard_normal((300, 50))).astype(np.float32)
    np.testing.assert_array_equal(vocab.nearest(q), reference_nearest(w, q))
    assert vocab.nearest(q[0]) == reference_nearest(w, q[:1])[0]


def _kernel_built() -> bool:
    try:
        import gaussdp._search  # noqa: F401
    except ImportError:
        return False
    return True


needs_kernel = pytest.mark.skipif(not _kernel_built(), reason="C kernel gaussdp._search not built")


@needs_kernel
@pytest.mark.parametrize(
    ("n_vocab", "dim", "sigma", "limit"),
    # vocabulary sizes that are not multiples of 16 or of the kernel's 512-word blocks; dim <= 24 runs
    # the kernel on the full-dimension stage; limit=1 hands most rows back to the numpy path.
    [
        (3001, 50, 0.1, 256),
        (2777, 50, 1.0, 256),
        (1999, 50, 4.0, 256),
        (1503, 20, 0.3, 256),
        (701, 8, 0.05, 256),
        (2500, 50, 0.8, 1),
        (17, 50, 0.5, 256),
        (1, 100, 0.5, 256),
        (1, 50, 0.5, 256),
    ],
)
def test_kernel_gives_the_numpy_paths_indices(n_vocab, dim, sigma, limit):
    rng = np.random.default_rng(n_vocab * 7 + dim)  # test data, not noise for a release
    w = rng.uniform(-1, 1, (n_vocab, dim)).astype(np.float32)
    q = (w[rng.integers(0, n_vocab, 700)] + sigma * rng.standard_normal((700, dim))).astype(np.float32)
    fused = ExactSearch(w, candidate_limit=limit, kernel=True)
    plain = ExactSearch(w, candidate_limit=limit, kernel=False)
    assert fused._kernel is not None and plain._kernel is None
    got = fused.nearest(q, threads=2)
    np.testing.assert_array_equal(got, plain.nearest(q, threads=1))
    np.testing.assert_array_equal(got, reference_nearest(w, q))


@needs_kernel
def test_kernel_hands_ties_and_float32_inseparable_rows_to_exact_arithmetic():
    rng = np.random.default_rng(13)
    w = rng.uniform(-1, 1, (1300, 50)).astype(np.float32)
    w[1200] = w[5]  # an exact tie: the lower index must win
    k = 3
    w[1250] = w[9]
    w[1250, k] = np.nextafter(w[9, k], np.float32(0.0), dtype=np.float32)  # one ulp nearer to q[2]
    q = np.stack([w[1200], w[5] + 0.001, np.zeros(50, np.float32) + w[9] * 0.999]).astype(np.float32)
    q[2, k] = 0.0
    fused = ExactSearch(w, kernel=True)
    handed_back: list[int] = []
    stage = fused._stage
    fused._stage = lambda rows, st, limit: (handed_back.append(len(rows)), stage(rows, st, limit))[1]  # type: ignore[method-assign]
    got = fused.nearest(q)
    assert handed_back == [2]  # the two exact ties are decided by the numpy path's rational check
    np.testing.assert_array_equal(got, reference_nearest(w, q))
    assert got[0] == 5 and got[1] == 5 and got[2] == 1250
    np.testing.assert_array_equal(got, ExactSearch(w, kernel=False).nearest(q))


def test_kernel_is_optional():
    rng = np.random.default_rng(17)
    w = rng.uniform(-1, 1, (600, 50)).astype(np.float32)
    q = (w[:50] + 0.1 * rng.standard_normal((50, 50))).astype(np.float32)
    plain = ExactSearch(w, kernel=False)  # the numpy path, as where the kernel is not built
    np.testing.assert_array_equal(plain.nearest(q), reference_nearest(w, q))
    # float64 queries and non-contiguous vocabularies also take the numpy path
    np.testing.assert_array_equal(ExactSearch(w).nearest(q.astype(np.float64)), reference_nearest(w, q))
    wf = np.asfortranarray(w)
    assert ExactSearch(wf)._kernel is None
