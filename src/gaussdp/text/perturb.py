"""Perturb a whole text word by word, and measure what the perturbation costs and keeps.

Policy for words outside the vocabulary (``unknown=``), documented because a silent pass-through
would release the word unprotected:

* ``"perturb"`` (default): the word gets a public vector and is perturbed by the same mechanism:
  its fastText subword vector when the vocabulary has an n-gram table (the mean of its character
  n-gram bucket vectors, clipped into the box and the ball of the largest word norm; see
  :mod:`gaussdp.text.subwords`), else the zero vector (the centre of the clip box). The map
  word -> vector is public and data-independent, so the per-word metric-DP statement holds between
  any two words, known or not, at the distance between their vectors, and every vector lies within
  the vocabulary's diameter bound, so the worst-case guarantee covers unknown words too.
* ``"sample"``: replaced by a vocabulary word drawn uniformly at random (reveals nothing about *which*
  unknown word it was, but a known word and an unknown word at the same position are not protected
  from each other: the reported guarantees then only compare texts with the same unknown positions).
* ``"drop"``: removed from the output (reveals that an unknown word was there, through the count;
  the same restriction on the reported guarantees applies).
* ``"error"``: refuse the whole text with :class:`UnsafeInput` (nothing is released).

Punctuation is dropped and words are lower-cased (:mod:`gaussdp.text.tokenize`). Line breaks are kept.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gaussdp.errors import InvalidParameter, UnsafeInput
from gaussdp.text.mechanisms import Guarantee, WordMechanism
from gaussdp.text.tokenize import lines_of_words

__all__ = [
    "UNKNOWN_POLICIES",
    "PerturbedText",
    "cosine_similarity",
    "perturb_text",
    "plausible_deniability",
]

UNKNOWN_POLICIES = ("perturb", "sample", "drop", "error")


@dataclass
class PerturbedText:
    """The perturbed text and what it cost.

    ``guarantee_worst`` composes every released word at the vocabulary's diameter bound: the local
    DP guarantee for the whole text against any other text with the same number of words (with
    ``unknown="sample"`` or ``"drop"``: with the same unknown-word positions; only the default
    ``"perturb"`` covers every text of that length).
    ``guarantee_neighbour`` composes them at the typical nearest-neighbour distance: what it costs to
    hide each word among its close neighbours. ``per_word`` is the single-word guarantee at both.
    """

    text: str
    n_words: int
    n_unknown: int
    n_changed: int
    mechanism: str
    params: dict[str, Any]
    per_word: dict[str, Any] = field(default_factory=dict)
    guarantee_worst: Guarantee | None = None
    guarantee_neighbour: Guarantee | None = None
    private: bool = True
    mean_cosine: float = float("nan")
    #: How unknown words got their input vector: ``"subwords"`` (fastText n-grams) or ``"zero"``.
    unknown_vectors: str = "zero"

    @property
    def fraction_changed(self) -> float:
        """Fraction of the released known words that differ from their input word."""
        known = self.n_words - self.n_unknown
        return self.n_changed / known if known else 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "mechanism": self.mechanism,
            "params": self.params,
            "words": self.n_words,
            "unknown_words": self.n_unknown,
            "unknown_word_vectors": self.unknown_vectors,
            "changed_words": self.n_changed,
            "fraction_changed": self.fraction_changed,
            "mean_cosine_to_original": self.mean_cosine,
            # every epsilon says what it is about: one word, or the whole text, at which distance
            "per_word": {
                k: {**g, "what": _WHAT[k]} if isinstance(g, dict) else g for k, g in self.per_word.items()
            },
            "document_worst_case": (
                {**self.guarantee_worst.to_dict(), "what": _WHAT["document_worst_case"]}
                if self.guarantee_worst
                else None
            ),
            "document_nearest_neighbour": (
                {**self.guarantee_neighbour.to_dict(), "what": _WHAT["document_nearest_neighbour"]}
                if self.guarantee_neighbour
                else None
            ),
            "private": self.private,
        }


_WHAT = {
    "nearest_neighbour": "one word vs its typical nearest neighbour (per word)",
    "worst_case": "one word vs any word (per word, worst case)",
    "document_nearest_neighbour": "the whole text, every word vs its nearest neighbour (composed)",
    "document_worst_case": "the whole text, every word vs any word (composed, worst case)",
}


def perturb_text(
    text: str,
    mechanism: WordMechanism,
    *,
    unknown: str = "perturb",
    batch_size: int = 8192,
    progress: Callable[[int], None] | None = None,
) -> PerturbedText:
    """Perturb every word of ``text`` with ``mechanism``; return the new text and its guarantee.

    Args:
        text: the input (already decoded; see :func:`gaussdp.text.tokenize.read_text` for files).
        mechanism: a :class:`~gaussdp.text.mechanisms.WordMechanism` bound to a vocabulary.
        unknown: policy for out-of-vocabulary words, see the module docstring.
        batch_size: words perturbed per call of the mechanism (bounds memory).
        progress: called with the number of words done after each batch (for progress bars).

    Raises:
        UnsafeInput: ``unknown="error"`` and an unknown word is present.
        InvalidParameter: an unknown policy name.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    if unknown not in UNKNOWN_POLICIES:
        raise InvalidParameter(f"unknown must be one of {UNKNOWN_POLICIES}, got unknown={unknown!r}")
    vocab = mechanism.vocabulary
    lines = lines_of_words(text)
    flat = [w for line in lines for w in line]
    all_vecs, known_mask = vocab.vectors_for(flat)
    idx = np.array([vocab.get(w) if w in vocab else -1 for w in flat], dtype=np.int64)
    is_unknown = ~known_mask
    n_unknown = int(is_unknown.sum())
    if n_unknown and unknown == "error":
        raise UnsafeInput(
            f"{n_unknown} word(s) are not in the vocabulary and unknown='error'; nothing released"
        )

    # Input vectors: vocabulary vectors; under "perturb", subword (or zero) vectors for unknown words.
    to_mechanism = ~is_unknown if unknown in ("sample", "drop") else np.ones(len(flat), dtype=bool)
    positions = np.nonzero(to_mechanism)[0]
    released = np.full(len(flat), -1, dtype=np.int64)
    done = 0
    for lo in range(0, positions.size, batch_size):
        pos = positions[lo : lo + batch_size]
        released[pos] = mechanism.perturb_vectors(all_vecs[pos])
        done += pos.size
        if progress is not None:
            progress(done)
    if unknown == "sample" and n_unknown:
        released[is_unknown] = mechanism._integers(n_unknown, len(vocab))
    n_released_by_mechanism = int(positions.size)

    out_lines: list[str] = []
    k = 0
    for line in lines:
        out: list[str] = []
        for _ in line:
            if released[k] >= 0:
                out.append(vocab.word(int(released[k])))
            k += 1
        out_lines.append(" ".join(out))
    kept = (idx >= 0) & (released >= 0)
    n_changed = int(np.sum(kept & (released != idx)))
    mean_cos = (
        float(np.mean(cosine_similarity(vocab.vectors[idx[kept]], vocab.vectors[released[kept]])))
        if kept.any()
        else float("nan")
    )

    report = mechanism.report()
    result = PerturbedText(
        text="\n".join(out_lines),
        n_words=len(flat),
        n_unknown=n_unknown,
        n_changed=n_changed,
        mechanism=mechanism.name,
        params=mechanism.params(),
        per_word={
            "nearest_neighbour": report["nearest_neighbour"],
            "worst_case": report["vocabulary_diameter"],
        },
        private=mechanism.private,
        mean_cosine=mean_cos,
        unknown_vectors="subwords" if vocab.subwords is not None else "zero",
    )
    if n_released_by_mechanism:
        d_worst = vocab.diameter_bound
        d_nn = report["nearest_neighbour"]["distance"]
        result.guarantee_worst = mechanism.document_guarantee(np.full(n_released_by_mechanism, d_worst))
        result.guarantee_neighbour = mechanism.document_guarantee(np.full(n_released_by_mechanism, d_nn))
    return result


def plausible_deniability(
    mechanism: WordMechanism, words: Sequence[str], *, samples: int = 1000
) -> dict[str, dict[str, float]]:
    """Plausible-deniability statistics by sampling (Feyisetan et al. 2020, Section 4).

    For each word ``w``: ``N_w`` = estimated ``Pr[M(w) = w]`` (fraction of ``samples`` releases that
    return ``w`` itself) and ``S_w`` = number of distinct words among the ``samples`` releases.
    Also the mean cosine similarity between ``w``'s vector and the released words' vectors.
    """
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise InvalidParameter(f"samples must be a positive int, got samples={samples!r}")
    vocab = mechanism.vocabulary
    out: dict[str, dict[str, float]] = {}
    for w in words:
        i = vocab.index(w)
        rel = mechanism.perturb_indices(np.full(samples, i))
        out[w] = {
            "N_w": float(np.mean(rel == i)),
            "S_w": float(np.unique(rel).size),
            "cosine": float(
                np.mean(cosine_similarity(vocab.vectors[np.full(samples, i)], vocab.vectors[rel]))
            ),
        }
    return out


def cosine_similarity(a: Any, b: Any) -> np.ndarray:
    """Row-wise cosine similarity of two ``n x dim`` arrays (0 where a row is the zero vector)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    num = np.sum(a * b, axis=1)
    den = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where(den > 0, num / np.where(den > 0, den, 1.0), 0.0)
    return cos
