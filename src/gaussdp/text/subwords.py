"""Vectors for words outside the vocabulary, from their character n-grams (fastText subwords).

A word that is not in the vocabulary gets the vector fastText gives it (Bojanowski et al. 2017):
the mean of the bucket vectors of its character n-grams. The n-grams are those of ``"<" + word + ">"``
of ``min_n`` to ``max_n`` characters (whole UTF-8 characters; the lone ``"<"`` and ``">"`` excluded),
in the order of Facebook's ``Dictionary::computeSubwords`` (by start, then length); each is hashed
with 32-bit FNV-1a over its UTF-8 bytes, sign-extending each byte as fastText does, and taken
modulo the number of buckets. gensim's ``FastText`` (``ft_ngram_hashes``) computes the same hashes,
so a table trained by gensim (:func:`gaussdp.text.vocabulary.train_word2vec` with ``subwords=True``)
gives gensim's out-of-vocabulary vectors up to the float16 storage of the table.

Exactly reproducible in the browser: the table is stored as float16 (what ships is what Python
uses), the mean is summed in float64 in n-gram order and rounded once to float32, then made safe
for the privacy analysis by two public maps: coordinates clipped to ``[-clip, clip]`` and the vector
scaled into the ball of radius ``max_norm`` (the largest norm of a vocabulary word, in float64).
``gaussdp/text/static/subwords.js`` does the same operations in the same order.

What the guarantee covers: the map word -> vector is public and does not depend on anyone's data,
so a word mechanism's metric-DP statement applies to any two words, known or not, at the distance
between their vectors; every vector lies in the clip box and in the ball of radius ``max_norm``, so
the vocabulary's worst-case distance bound (``2 * max_norm``) still holds for unknown words.
Two unknown words whose n-grams hash alike get the same vector (and cannot be told apart at all).

References:
    Bojanowski, P., Grave, E., Joulin, A. & Mikolov, T. (2017). Enriching Word Vectors with Subword
    Information. TACL 5. Section 3.2 (subword model, hashing into buckets).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from gaussdp.errors import InvalidParameter, UnsafeInput

__all__ = ["SubwordTable", "ngram_hashes"]

_FNV_OFFSET = 2166136261
_FNV_PRIME = 16777619


def _fnv1a_signed(data: bytes) -> int:
    h = _FNV_OFFSET
    for b in data:
        # fastText xors the byte as a *signed* char (sign-extended to 32 bits).
        h ^= b | 0xFFFFFF00 if b >= 0x80 else b
        h = (h * _FNV_PRIME) & 0xFFFFFFFF
    return h


def ngram_hashes(word: str, min_n: int, max_n: int, buckets: int) -> list[int]:
    """Bucket indices of the character n-grams of ``<word>``, in fastText's order (with repeats)."""
    data = ("<" + word + ">").encode("utf-8")
    size = len(data)
    out: list[int] = []
    for i in range(size):
        if data[i] & 0xC0 == 0x80:  # a UTF-8 continuation byte starts no n-gram
            continue
        j, n = i, 1
        while j < size and n <= max_n:
            j += 1
            while j < size and data[j] & 0xC0 == 0x80:
                j += 1
            if n >= min_n and not (n == 1 and (i == 0 or j == size)):
                out.append(_fnv1a_signed(data[i:j]) % buckets)
            n += 1
    return out


class SubwordTable:
    """fastText n-gram bucket vectors (float16) and the public map word -> vector for unknown words.

    Args:
        table: ``buckets x dim`` matrix (stored as float16).
        min_n, max_n: n-gram lengths in characters.
        clip: coordinates are clipped to ``[-clip, clip]``.
        max_norm: vectors longer than this are scaled down to it (the vocabulary's largest norm).
    """

    def __init__(self, table: Any, *, min_n: int, max_n: int, clip: float, max_norm: float) -> None:
        t = np.asarray(table)
        if t.ndim != 2 or t.shape[0] == 0:
            raise InvalidParameter(f"table must be a non-empty (buckets x dim) matrix, got {t.shape}")
        t16 = np.array(t, dtype=np.float16, copy=True)
        if not np.all(np.isfinite(t16)):
            raise UnsafeInput("the n-gram table contains NaN or Inf (or values beyond float16)")
        if not (isinstance(min_n, int) and isinstance(max_n, int) and 1 <= min_n <= max_n <= 32):
            raise InvalidParameter(f"need 1 <= min_n <= max_n <= 32, got min_n={min_n!r}, max_n={max_n!r}")
        if not (clip > 0 and max_norm > 0):
            raise InvalidParameter(f"clip and max_norm must be > 0, got {clip!r}, {max_norm!r}")
        t16.setflags(write=False)
        self.table = t16
        self._table64 = t16.astype(np.float64)
        self.min_n = int(min_n)
        self.max_n = int(max_n)
        self.clip = float(clip)
        self.max_norm = float(max_norm)

    @property
    def buckets(self) -> int:
        return int(self.table.shape[0])

    @property
    def dim(self) -> int:
        return int(self.table.shape[1])

    def vector(self, word: str) -> np.ndarray:
        """The float32 vector of ``word`` (zero if it has no n-gram, e.g. shorter than ``min_n - 2``)."""
        hashes = ngram_hashes(word, self.min_n, self.max_n, self.buckets)
        if not hashes:
            return np.zeros(self.dim, dtype=np.float32)
        # cumsum adds sequentially, in n-gram order: the same float64 sums as the browser's loop.
        total = np.cumsum(self._table64[hashes], axis=0)[-1]
        v = (total / len(hashes)).astype(np.float32)
        np.clip(v, -self.clip, self.clip, out=v)
        v64 = v.astype(np.float64)
        norm = float(np.sqrt(np.cumsum(v64 * v64)[-1]))
        if norm > self.max_norm:
            v = (v64 * (self.max_norm / norm)).astype(np.float32)
        return v

    def vectors(self, words: list[str]) -> np.ndarray:
        """``len(words) x dim`` float32 matrix of :meth:`vector` (one per word; repeats computed once)."""
        out = np.zeros((len(words), self.dim), dtype=np.float32)
        seen: dict[str, np.ndarray] = {}
        for i, w in enumerate(words):
            if w not in seen:
                seen[w] = self.vector(w)
            out[i] = seen[w]
        return out

    def meta(self) -> dict[str, Any]:
        return {"min_n": self.min_n, "max_n": self.max_n, "max_norm": self.max_norm}
