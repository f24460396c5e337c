"""Word-level local DP mechanisms: perturb a word's vector, release the nearest vocabulary word.

Every mechanism here maps one input word ``w`` (its vector ``phi(w)`` in the vocabulary, clipped to
``[-clip, clip]^dim``) to one output word. What a guarantee protects: the output distributions for
two inputs ``w`` and ``w'`` are close *as a function of their distance* ``d = ||phi(w) - phi(w')||``
(metric, or "d_X", privacy; Chatzikokolakis et al. 2013). Similar words are hard to tell apart;
dissimilar words much less so. A per-word statement therefore always comes with two distances:

* the vocabulary's **typical nearest-neighbour distance** (median distance from a word to its
  closest other word): what protecting a word among its neighbours costs;
* the **worst case**: the vocabulary's diameter bound (at most ``2 * clip * sqrt(dim)``, the
  diagonal of the clip box): what protecting *which word it was at all* costs, i.e. the plain
  local DP guarantee over the whole vocabulary.

Mechanisms (all released words are post-processing of the noisy vector or noisy scores):

* :class:`GaussianWordMechanism` (the text perturbation service): ``phi(w) + N(0, sigma^2 I)``. Metric zCDP:
  ``rho(d) = d^2 / (2 sigma^2)``; for two words at distance ``d`` the exact ``(epsilon, delta)`` is
  that of a Gaussian mechanism with L2 sensitivity ``d`` (:func:`gaussdp.calibration.epsilon_for`).
* :class:`LaplaceWordMechanism` (multivariate Laplace, Feyisetan et al. WSDM 2020): noise density
  ``~ exp(-epsilon ||z||)``; pure metric DP, ``epsilon * d``.
* :class:`MahalanobisWordMechanism` (Xu et al. 2020): elliptical noise shaped by the regularised
  covariance of the vocabulary; ``epsilon * d_RM`` with ``d_RM`` the regularised Mahalanobis
  distance, ``<= d / sqrt(lambda_min)`` in Euclidean terms.
* :class:`TruncatedExponentialWordMechanism` (TEM, Carvalho et al. 2021): exponential mechanism on
  the truncated score ``-min(d, gamma)`` sampled with Gumbel noise, no ``V x V`` matrix; ``epsilon * d``.

Composition over a document of ``n`` words (each word perturbed independently): zCDP adds
(``rho = sum_i d_i^2 / (2 sigma^2)``, and the sum of Gaussian releases is exactly one Gaussian release
with sensitivity ``sqrt(sum d_i^2)``); metric DP epsilons add (``epsilon * sum_i d_i``).

Randomness: from :func:`gaussdp.noise.noise_source`: ``noise="secure"`` (default, a CSPRNG
keystream keyed from the OS) or ``"fast"`` (numpy PCG64 seeded from OS entropy). Normal deviates
come from the source's sampler; Gamma radii (integer shape ``dim``) as ``scale * chi2(2 dim) / 2``
from normals; uniforms (Gumbel noise, uniform word choice) from two 32-bit words (53 bits).
``seed=`` makes outputs reproducible and is marked not private (:class:`NotPrivateWarning`,
``.private == False``). The noisy vectors are never released, only the nearest word, so the
floating-point attacks on released noisy reals do not apply to the output.

References:
    Chatzikokolakis, K. et al. (2013). Broadening the scope of differential privacy using metrics. PETS.
    Feyisetan, O., Balle, B., Drake, T. & Diethe, T. (2020). Privacy- and Utility-Preserving Textual
    Analysis via Calibrated Multivariate Perturbations. WSDM. Section 2.3 (sampling), Theorem 1.
    Xu, Z. et al. (2020). A Differentially Private Text Perturbation Method Using a Regularized
    Mahalanobis Metric. PrivateNLP workshop, EMNLP. Algorithm 1, Theorem 1.
    Carvalho, R. S., Vasiloudis, T., Feyisetan, O. & Wang, K. (2021/2023). TEM: High Utility Metric
    Differential Privacy on Text. arXiv:2107.07928 (SDM 2023). Algorithm 1, Theorem 1.
    Bun, M. & Steinke, T. (2016). Concentrated Differential Privacy. TCC. Lemma 2.3 (composition).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from gaussdp._validate import check_delta, check_epsilon, check_positive, real_number
from gaussdp.calibration import epsilon_for, sigma_for
from gaussdp.errors import InvalidParameter, NotPrivateWarning, UnsafeInput
from gaussdp.noise import NoiseSource, noise_source
from gaussdp.text.vocabulary import Vocabulary

__all__ = [
    "MECHANISMS",
    "GaussianWordMechanism",
    "Guarantee",
    "LaplaceWordMechanism",
    "MahalanobisWordMechanism",
    "TruncatedExponentialWordMechanism",
    "WordMechanism",
    "make_mechanism",
]


@dataclass(frozen=True)
class Guarantee:
    """What one release costs for two inputs at a given distance.

    ``kind`` is ``"metric-zCDP"`` (Gaussian: ``rho`` set, ``(epsilon, delta)`` the exact conversion)
    or ``"metric-DP"`` (pure: ``epsilon``, ``delta == 0``). ``distance`` is the Euclidean distance
    (or, summed over a document, the composed distance) the numbers refer to; ``words`` is how many
    word releases were composed.
    """

    kind: str
    distance: float
    epsilon: float
    delta: float
    rho: float | None = None
    words: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "distance": self.distance,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "rho": self.rho,
            "words": self.words,
        }


class WordMechanism:
    """Base class: perturb vectors of a :class:`Vocabulary` and return indices of released words."""

    name: ClassVar[str] = "base"

    def __init__(
        self, vocabulary: Vocabulary, *, noise: str | NoiseSource = "secure", seed: int | None = None
    ) -> None:
        if not isinstance(vocabulary, Vocabulary):
            raise TypeError(f"vocabulary must be a gaussdp.text.Vocabulary, got {type(vocabulary).__name__}")
        self.vocabulary = vocabulary
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
                raise TypeError(f"seed must be an int or None, got seed={seed!r}")
            warnings.warn(
                f"{type(self).__name__}(seed={seed}) gives reproducible outputs that are NOT private: "
                "anyone who knows the seed can reproduce the noise",
                NotPrivateWarning,
                stacklevel=3,
            )
            with warnings.catch_warnings():  # warned once above, pointing at the caller
                warnings.simplefilter("ignore", NotPrivateWarning)
                self._source = noise_source(seed=int(seed))
        else:
            self._source = noise_source(noise)  # type: ignore[arg-type]
        self.private = bool(self._source.private)
        #: Nearest-word search: ``"exact"`` (default) or ``"faiss-flat"`` / ``"faiss-hnsw"``. With an
        #: approximate search, up to 256 rows per batch are also searched exactly and the agreement
        #: is kept in :attr:`recall` (a function of the noisy vectors only: post-processing).
        self.search = "exact"
        self._recall_hits = 0
        self._recall_rows = 0

    # -- randomness, all from the noise source
    def _normal(self, shape: tuple[int, ...]) -> np.ndarray:
        return self._source.standard_normal(int(np.prod(shape))).reshape(shape)

    def _uniform(self, n: int) -> np.ndarray:
        """``n`` uniforms in (0, 1) with 53 random bits each."""
        w = self._source.words(2 * n).astype(np.uint64)
        k = ((w[:n] >> np.uint64(5)) << np.uint64(26)) | (w[n:] >> np.uint64(6))
        return (k.astype(np.float64) + 0.5) * 2.0**-53

    def _gumbel(self, n: int, scale: float) -> np.ndarray:
        return -scale * np.log(-np.log(self._uniform(n)))

    def _integers(self, n: int, high: int) -> np.ndarray:
        """Uniform integers in [0, high) (bias below high * 2**-53)."""
        return np.minimum((self._uniform(n) * high).astype(np.int64), high - 1)

    def _gamma_radius(self, n: int, dim: int, scale: float) -> np.ndarray:
        """Gamma(dim, scale) radii, shape (n, 1): for integer shape, ``scale * chi2(2 dim) / 2``."""
        z = self._normal((n, 2 * dim))
        return scale * 0.5 * np.einsum("ij,ij->i", z, z)[:, None]

    def _directions(self, n: int, dim: int) -> np.ndarray:
        """``n`` unit vectors uniform on the sphere (normalised standard normals)."""
        g = self._normal((n, dim))
        norms = np.linalg.norm(g, axis=1, keepdims=True)
        while np.any(norms == 0.0):  # probability ~0; resample degenerate rows
            bad = norms[:, 0] == 0.0
            g[bad] = self._normal((int(bad.sum()), dim))
            norms = np.linalg.norm(g, axis=1, keepdims=True)
        return g / norms

    # -- to implement
    def _noisy(self, vectors: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def word_guarantee(self, distance: float) -> Guarantee:  # pragma: no cover - abstract
        raise NotImplementedError

    def document_guarantee(self, distances: Any) -> Guarantee:  # pragma: no cover - abstract
        raise NotImplementedError

    def params(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- shared
    def perturb_vectors(self, vectors: Any) -> np.ndarray:
        """Indices of the released words for input vectors (``n x dim``, inside the clip box)."""
        v = np.asarray(vectors, dtype=np.float32)
        if v.ndim != 2 or v.shape[1] != self.vocabulary.dim:
            raise InvalidParameter(f"vectors must have shape (n, {self.vocabulary.dim}), got {v.shape}")
        if not np.all(np.isfinite(v)):
            raise UnsafeInput("vectors contains NaN or Inf")
        if v.size and float(np.max(np.abs(v))) > self.vocabulary.clip:
            # The distance bounds (and so every epsilon printed) assume the clip box.
            raise UnsafeInput(
                f"input vectors must lie in [-{self.vocabulary.clip:g}, {self.vocabulary.clip:g}]^dim"
            )
        if v.shape[0] == 0:
            return np.empty(0, dtype=np.int64)
        return self._release(v)

    def _release(self, v: np.ndarray) -> np.ndarray:
        noisy = self._noisy(v)
        out = np.asarray(self.vocabulary.nearest(noisy, method=self.search), dtype=np.int64)
        if self.search != "exact":
            k = min(256, noisy.shape[0])
            self._recall_hits += int(np.sum(self.vocabulary.nearest(noisy[:k]) == out[:k]))
            self._recall_rows += k
        return out

    @property
    def recall(self) -> float | None:
        """Agreement of the approximate search with the exact one so far (None for exact search)."""
        if self.search == "exact" or self._recall_rows == 0:
            return None
        return self._recall_hits / self._recall_rows

    def perturb_indices(self, indices: Any) -> np.ndarray:
        """Indices of released words for vocabulary word indices."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self.vocabulary)):
            raise InvalidParameter(
                f"indices must be in [0, {len(self.vocabulary)}), got {idx.min()}..{idx.max()}"
            )
        return self.perturb_vectors(self.vocabulary.vectors[idx])

    def perturb_words(self, words: list[str]) -> list[str]:
        """Released words for known words (KeyError for a word outside the vocabulary)."""
        idx = [self.vocabulary.index(w) for w in words]
        return self.vocabulary.lookup(self.perturb_indices(idx))

    def report(self) -> dict[str, Any]:
        """The per-word guarantee at the typical nearest-neighbour distance and in the worst case."""
        vocab = self.vocabulary
        d_nn = vocab.nearest_neighbour_distance() if len(vocab) > 1 else 0.0
        return {
            "mechanism": self.name,
            "params": self.params(),
            "private": self.private,
            "nearest_neighbour": self.word_guarantee(d_nn).to_dict(),
            "vocabulary_diameter": self.word_guarantee(vocab.diameter_bound).to_dict(),
            "box_diameter": self.word_guarantee(vocab.box_diameter).to_dict(),
        }


def _distances(distances: Any) -> np.ndarray:
    d = np.asarray(distances, dtype=np.float64).reshape(-1)
    if d.size == 0:
        raise InvalidParameter("distances must hold at least one word's distance")
    if not np.all(np.isfinite(d)) or np.any(d < 0):
        raise InvalidParameter("distances must be finite and >= 0")
    return d


class GaussianWordMechanism(WordMechanism):
    """The text perturbation service's mechanism: ``phi(w) + N(0, sigma^2 I)``, then the nearest word.

    Guarantee (metric zCDP, Bun & Steinke 2016): for two words at distance ``d``, the output
    distributions satisfy ``rho(d) = d^2 / (2 sigma^2)``-zCDP, and exactly the ``(epsilon, delta)``
    profile of a Gaussian mechanism with L2 sensitivity ``d`` (Balle & Wang 2018, via
    :func:`gaussdp.calibration.epsilon_for`). Local DP over the whole vocabulary is the case
    ``d = diameter``. The text perturbation service claims epsilon ~96.9 for sigma=0.1 with "sensitivity 2":
    the exact epsilon at sensitivity 2 is about 284, and the true worst case is ``2 sqrt(50) ~ 14.1``.

    Construct with ``sigma=`` or with ``epsilon=, delta=`` at a reference ``distance=`` (default: the
    vocabulary's diameter bound, i.e. true local DP between any two words).
    """

    name = "gaussian"

    def __init__(
        self,
        vocabulary: Vocabulary,
        *,
        sigma: float | None = None,
        epsilon: float | None = None,
        delta: float = 1e-5,
        distance: float | None = None,
        noise: str | NoiseSource = "secure",
        seed: int | None = None,
    ) -> None:
        super().__init__(vocabulary, noise=noise, seed=seed)
        self.delta = check_delta(delta)
        if (sigma is None) == (epsilon is None):
            raise InvalidParameter("give exactly one of sigma= or epsilon= (with delta=, distance=)")
        if sigma is not None:
            self.sigma = check_positive("sigma", sigma)
        else:
            ref = vocabulary.diameter_bound if distance is None else check_positive("distance", distance)
            self.sigma = sigma_for(epsilon=check_epsilon(epsilon), delta=self.delta, sensitivity=ref)

    def _noisy(self, v: np.ndarray) -> np.ndarray:
        noise = self._normal(v.shape) * self.sigma
        return (v + noise).astype(np.float32)

    def rho(self, distance: float) -> float:
        """zCDP parameter for two words at ``distance``: ``d^2 / (2 sigma^2)``."""
        d = real_number("distance", distance)
        return d * d / (2.0 * self.sigma**2)

    def word_guarantee(self, distance: float) -> Guarantee:
        d = real_number("distance", distance)
        if d < 0:
            raise InvalidParameter(f"distance must be >= 0, got distance={distance!r}")
        eps = epsilon_for(sigma=self.sigma, delta=self.delta, sensitivity=d) if d > 0 else 0.0
        return Guarantee("metric-zCDP", d, eps, self.delta, rho=self.rho(d))

    def document_guarantee(self, distances: Any) -> Guarantee:
        """Composition over words at the given distances: rho adds; the (epsilon, delta) is exact,
        because independent Gaussian releases with sensitivities ``d_i`` are one Gaussian release
        with sensitivity ``sqrt(sum d_i^2)``."""
        d = _distances(distances)
        total = float(math.sqrt(np.sum(d * d)))
        eps = epsilon_for(sigma=self.sigma, delta=self.delta, sensitivity=total) if total > 0 else 0.0
        return Guarantee("metric-zCDP", total, eps, self.delta, rho=self.rho(total), words=int(d.size))

    def params(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "delta": self.delta}


class _MetricDPWordMechanism(WordMechanism):
    """A mechanism that is metric DP: two words at distance d are (epsilon_per_distance * d, 0)-DP,
    and the words of a document compose by adding their epsilons."""

    epsilon: float

    @property
    def epsilon_per_distance(self) -> float:
        return self.epsilon

    def word_guarantee(self, distance: float) -> Guarantee:
        d = real_number("distance", distance)
        if d < 0:
            raise InvalidParameter(f"distance must be >= 0, got distance={distance!r}")
        return Guarantee("metric-DP", d, self.epsilon_per_distance * d, 0.0)

    def document_guarantee(self, distances: Any) -> Guarantee:
        d = _distances(distances)
        total = float(np.sum(d))
        return Guarantee("metric-DP", total, self.epsilon_per_distance * total, 0.0, words=int(d.size))


class LaplaceWordMechanism(_MetricDPWordMechanism):
    """Multivariate Laplace (Feyisetan et al. WSDM 2020): noise density ``~ exp(-epsilon ||z||)``.

    Sampled as a direction uniform on the unit sphere times a radius ``~ Gamma(dim, scale=1/epsilon)``
    (Section 2.3). Guarantee: ``epsilon``-metric DP in the Euclidean distance (Theorem 1): for two
    words at distance ``d`` the output probabilities differ by at most ``exp(epsilon * d)``. Over a
    document, epsilons add: ``epsilon * sum_i d_i``.
    """

    name = "laplace"

    def __init__(
        self,
        vocabulary: Vocabulary,
        *,
        epsilon: float,
        noise: str | NoiseSource = "secure",
        seed: int | None = None,
    ) -> None:
        super().__init__(vocabulary, noise=noise, seed=seed)
        self.epsilon = check_epsilon(epsilon)

    def _noisy(self, v: np.ndarray) -> np.ndarray:
        n, dim = v.shape
        radius = self._gamma_radius(n, dim, 1.0 / self.epsilon)
        return (v + radius * self._directions(n, dim)).astype(np.float32)

    def params(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon}


class MahalanobisWordMechanism(_MetricDPWordMechanism):
    """Regularised Mahalanobis mechanism (Xu et al. 2020, Algorithm 1).

    Noise ``Z = R * Sigma_p^{1/2} u`` with ``u`` uniform on the unit sphere, ``R ~ Gamma(dim, 1/epsilon)``
    and ``Sigma_p = lam * Sigma + (1 - lam) * I``, ``Sigma`` the covariance of the vocabulary vectors
    scaled to trace ``dim`` (our normalisation, so that ``lam`` trades shape against the Euclidean
    metric at equal overall scale). Guarantee (Theorem 1): ``epsilon``-metric DP in
    ``d_RM(x, y) = sqrt((x - y)^T Sigma_p^{-1} (x - y))``; in Euclidean terms
    ``d_RM <= d / sqrt(lambda_min(Sigma_p))``, which is what the reported epsilons use (an upper bound).
    """

    name = "mahalanobis"

    def __init__(
        self,
        vocabulary: Vocabulary,
        *,
        epsilon: float,
        lam: float = 0.2,
        noise: str | NoiseSource = "secure",
        seed: int | None = None,
    ) -> None:
        super().__init__(vocabulary, noise=noise, seed=seed)
        self.epsilon = check_epsilon(epsilon)
        lam = real_number("lam", lam)
        if not 0.0 <= lam <= 1.0:
            raise InvalidParameter(f"lam must be in [0, 1], got lam={lam!r}")
        self.lam = lam
        x = vocabulary.vectors.astype(np.float64)
        dim = vocabulary.dim
        cov = np.cov(x, rowvar=False) if len(vocabulary) > 1 else np.eye(dim)
        cov = np.atleast_2d(cov)
        trace = float(np.trace(cov))
        cov = cov * (dim / trace) if trace > 0 else np.eye(dim)
        sigma_p = lam * cov + (1.0 - lam) * np.eye(dim)
        evals, evecs = np.linalg.eigh(sigma_p)
        evals = np.maximum(evals, 0.0)
        self._sqrt = (evecs * np.sqrt(evals)) @ evecs.T
        self.lambda_min = float(evals.min())
        if self.lambda_min <= 1e-12:
            raise InvalidParameter("the regularised covariance is singular; use lam < 1")

    def _noisy(self, v: np.ndarray) -> np.ndarray:
        n, dim = v.shape
        radius = self._gamma_radius(n, dim, 1.0 / self.epsilon)
        z = (radius * self._directions(n, dim)) @ self._sqrt.T
        return (v + z).astype(np.float32)

    @property
    def epsilon_per_distance(self) -> float:
        return self.epsilon / math.sqrt(self.lambda_min)

    def params(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon, "lam": self.lam, "lambda_min": self.lambda_min}


class TruncatedExponentialWordMechanism(_MetricDPWordMechanism):
    """Truncated exponential mechanism (TEM, Carvalho et al. 2021), sampled with Gumbel noise.

    The output is drawn from ``Pr[o] ~ exp(-epsilon * min(d(w, o), gamma) / 2)`` over the whole
    vocabulary. Words within ``gamma`` of the input get their own Gumbel(0, 2/epsilon) score; all
    other words share one score ``-gamma + (2/epsilon) ln |outside|`` (the max of that many Gumbels)
    and, if it wins, one of them is drawn uniformly. This samples exactly the distribution above
    without a ``V x V`` matrix: distances come block by block from the same GEMM as the search.
    Guarantee (Theorem 1): the score ``-min(d, gamma)`` is 1-Lipschitz in the input, so the
    exponential mechanism gives ``epsilon``-metric DP: ``epsilon * d`` for words at distance ``d``.
    ``gamma`` defaults to the paper's ``(2/epsilon) ln((1 - beta)(V - 1)/beta)``.
    """

    name = "tem"

    def __init__(
        self,
        vocabulary: Vocabulary,
        *,
        epsilon: float,
        beta: float = 0.001,
        gamma: float | None = None,
        noise: str | NoiseSource = "secure",
        seed: int | None = None,
    ) -> None:
        super().__init__(vocabulary, noise=noise, seed=seed)
        self.epsilon = check_epsilon(epsilon)
        beta = real_number("beta", beta)
        if not 0.0 < beta < 1.0:
            raise InvalidParameter(f"beta must be in (0, 1), got beta={beta!r}")
        self.beta = beta
        n = len(vocabulary)
        if gamma is None:
            gamma = (2.0 / self.epsilon) * math.log(max((1.0 - beta) * (n - 1) / beta, 1.0))
        self.gamma = max(real_number("gamma", gamma), 0.0)

    def _release(self, v: np.ndarray) -> np.ndarray:
        vocab = self.vocabulary
        n_vocab = len(vocab)
        vecs = vocab.vectors
        sq = np.einsum("ij,ij->i", vecs, vecs)
        scale = 2.0 / self.epsilon
        out = np.empty(v.shape[0], dtype=np.int64)
        block = 256
        vblock = 8192
        for lo in range(0, v.shape[0], block):
            q = v[lo : lo + block]
            m = q.shape[0]
            qsq = np.einsum("ij,ij->i", q, q)
            best = np.full(m, -np.inf)
            best_idx = np.full(m, -1, dtype=np.int64)
            inside = np.zeros(m, dtype=np.int64)
            for vlo in range(0, n_vocab, vblock):
                w = vecs[vlo : vlo + vblock]
                d2 = qsq[:, None] - 2.0 * (q @ w.T) + sq[None, vlo : vlo + vblock]
                d = np.sqrt(np.maximum(d2, 0.0, dtype=np.float64))
                rows, cols = np.nonzero(d <= self.gamma)
                inside += np.bincount(rows, minlength=m)
                if rows.size == 0:
                    continue
                score = -d[rows, cols] + self._gumbel(rows.size, scale)
                # Row-wise max of the scattered scores: sort by (row, score) and take each row's last.
                order = np.lexsort((score, rows))
                last = np.r_[np.nonzero(np.diff(rows[order]))[0], order.size - 1]
                r, s, c = rows[order][last], score[order][last], cols[order][last] + vlo
                better = s > best[r]
                best[r[better]] = s[better]
                best_idx[r[better]] = c[better]
            outside = n_vocab - inside
            with np.errstate(divide="ignore"):
                bottom = -self.gamma + scale * np.log(outside) + self._gumbel(m, scale)
            bottom[outside == 0] = -np.inf
            for i in np.nonzero(bottom > best)[0]:
                best_idx[i] = self._uniform_outside(q[i])
            out[lo : lo + m] = best_idx
        return out

    def _uniform_outside(self, x: np.ndarray) -> int:
        """A word drawn uniformly among those farther than gamma from ``x`` (rejection sampling)."""
        vecs = self.vocabulary.vectors
        for _ in range(64):
            cand = self._integers(64, len(vecs))
            d = np.linalg.norm(vecs[cand].astype(np.float64) - x, axis=1)
            ok = cand[d > self.gamma]
            if ok.size:
                return int(ok[0])
        d = np.linalg.norm(vecs.astype(np.float64) - x, axis=1)
        outside = np.nonzero(d > self.gamma)[0]
        return int(outside[self._integers(1, outside.size)[0]])

    def params(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon, "beta": self.beta, "gamma": self.gamma}


MECHANISMS: dict[str, type[WordMechanism]] = {
    "gaussian": GaussianWordMechanism,
    "laplace": LaplaceWordMechanism,
    "mahalanobis": MahalanobisWordMechanism,
    "tem": TruncatedExponentialWordMechanism,
}


def make_mechanism(name: str, vocabulary: Vocabulary, **kwargs: Any) -> WordMechanism:
    """Build a mechanism by name (``gaussian``, ``laplace``, ``mahalanobis``, ``tem``)."""
    try:
        cls = MECHANISMS[name]
    except KeyError:
        raise InvalidParameter(
            f"mechanism must be one of {sorted(MECHANISMS)}, got mechanism={name!r}"
        ) from None
    return cls(vocabulary, **kwargs)
