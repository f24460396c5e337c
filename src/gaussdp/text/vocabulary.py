"""Word vectors and the exact nearest-word search every text mechanism uses.

A :class:`Vocabulary` holds ``V`` words and a ``V x dim`` float32 matrix whose entries lie in
``[-clip, clip]`` (the text perturbation service clips word2vec vectors to ``[-1, 1]``; the privacy statements
of the mechanisms in :mod:`gaussdp.text.mechanisms` rely on that bound, so it is enforced on construction).

Search: :meth:`Vocabulary.nearest` returns, for each row of a batch of vectors, the index of the
vocabulary word at the smallest Euclidean distance. It is exact and batched
(:class:`gaussdp.text.search.ExactSearch`): float32 lower bounds from a GEMM in a 16-dimensional
principal subspace, with proven error margins, select candidates that are re-checked in float64
(and in rational arithmetic on near-ties); ties go to the lowest index. Blocks of queries and of
vocabulary rows bound the memory to a few megabytes whatever the batch size.
faiss is available as an option (``method="faiss-flat"`` exact, ``"faiss-hnsw"`` approximate, its
recall against the exact search reported by :meth:`Vocabulary.search_recall`).

File format (ours, one file): a NumPy ``.npz`` with ``words`` (unicode array), ``vectors`` (float32
``V x dim``) and ``meta`` (a JSON string: format version, clip bound, provenance). Loading never
unpickles objects (``allow_pickle=False``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gaussdp._extras import require_extra
from gaussdp._validate import check_positive
from gaussdp.errors import InvalidParameter, UnsafeInput
from gaussdp.text.search import ExactSearch
from gaussdp.text.subwords import SubwordTable

__all__ = ["FORMAT_VERSION", "Vocabulary", "train_word2vec", "vocabulary_id"]

FORMAT_VERSION = 1

# Query rows per block of the nearest-neighbour-distance statistic.
_QUERY_BLOCK = 512


class Vocabulary:
    """Words and their vectors, clipped to ``[-clip, clip]``, with exact batched nearest-word search.

    Args:
        words: distinct words (str), ``V`` of them.
        vectors: ``V x dim`` real matrix, finite. Converted to float32.
        clip: every coordinate must lie in ``[-clip, clip]`` (default 1.0, as in the text perturbation
            service).
        clip_vectors: when True, coordinates outside the bound are clipped to it (as the text perturbation
            service does after training); when False (default) they are refused with :class:`UnsafeInput`,
            because the worst-case distance bound ``2 * clip * sqrt(dim)`` would not hold.
        meta: free-form provenance stored with the file (JSON-serialisable).
        subword_table: optional fastText n-gram bucket vectors (``buckets x dim``, stored as float16)
            that give words outside the vocabulary a vector (:mod:`gaussdp.text.subwords`).
        subword_n: ``(min_n, max_n)`` n-gram lengths of the table (fastText's default ``(3, 6)``).

    Raises:
        UnsafeInput: NaN/Inf vectors, duplicate or empty words, values outside the clip bound.
        InvalidParameter: shapes that do not match.
    """

    def __init__(
        self,
        words: Sequence[str],
        vectors: Any,
        *,
        clip: float = 1.0,
        clip_vectors: bool = False,
        meta: dict[str, Any] | None = None,
        subword_table: Any = None,
        subword_n: tuple[int, int] = (3, 6),
    ) -> None:
        clip = check_positive("clip", clip)
        words = [str(w) for w in words]
        matrix = np.asarray(vectors)
        if matrix.ndim != 2:
            raise InvalidParameter(f"vectors must be a 2-D matrix (words x dim), got shape {matrix.shape}")
        if matrix.shape[0] != len(words):
            raise InvalidParameter(
                f"vectors has {matrix.shape[0]} rows but words has {len(words)} entries; they must match"
            )
        if len(words) == 0 or matrix.shape[1] == 0:
            raise UnsafeInput(f"a vocabulary needs at least one word and one dimension, got {matrix.shape}")
        if not np.issubdtype(matrix.dtype, np.number) or np.iscomplexobj(matrix):
            raise TypeError(f"vectors must be a real numeric matrix, got dtype {matrix.dtype}")
        matrix = np.array(matrix, dtype=np.float32, copy=True)
        if not np.all(np.isfinite(matrix)):
            raise UnsafeInput("vectors contains NaN or Inf; refusing to build the vocabulary")
        if any(not w for w in words):
            raise UnsafeInput("words contains an empty string")
        if len(set(words)) != len(words):
            raise UnsafeInput("words contains duplicates; each word must appear once")
        too_big = float(np.max(np.abs(matrix)))
        if too_big > clip:
            if not clip_vectors:
                raise UnsafeInput(
                    f"vectors has a coordinate of magnitude {too_big:.4g} > clip={clip:g}; pass "
                    "clip_vectors=True to clip them (the distance bounds of the mechanisms need it)"
                )
            np.clip(matrix, -clip, clip, out=matrix)
        matrix.setflags(write=False)
        self._words: list[str] = words
        self._index: dict[str, int] = {w: i for i, w in enumerate(words)}
        self._vectors = matrix
        self.clip = clip
        self.meta: dict[str, Any] = dict(meta or {})
        sq64 = np.einsum("ij,ij->i", matrix, matrix, dtype=np.float64)
        self._sq_norms = sq64.astype(np.float32)
        #: Largest norm of a word vector (float64); unknown words' vectors are scaled into this ball.
        self.max_norm = float(np.sqrt(np.max(sq64)))
        self.subwords: SubwordTable | None = None
        if subword_table is not None:
            table = np.asarray(subword_table)
            if table.ndim != 2 or table.shape[1] != matrix.shape[1]:
                raise InvalidParameter(
                    f"subword_table must be (buckets x {matrix.shape[1]}), got shape {table.shape}"
                )
            self.subwords = SubwordTable(
                table, min_n=int(subword_n[0]), max_n=int(subword_n[1]), clip=clip, max_norm=self.max_norm
            )
        self._exact: ExactSearch | None = None
        self._faiss: dict[str, Any] = {}
        self._nn_distance: float | None = None

    # ------------------------------------------------------------------ basic access
    @property
    def words(self) -> list[str]:
        """The words, in index order (a copy)."""
        return list(self._words)

    @property
    def vectors(self) -> np.ndarray:
        """The ``V x dim`` float32 matrix (read-only view)."""
        return self._vectors

    @property
    def dim(self) -> int:
        return int(self._vectors.shape[1])

    def __len__(self) -> int:
        return len(self._words)

    def __contains__(self, word: object) -> bool:
        return word in self._index

    def __repr__(self) -> str:
        return f"Vocabulary({len(self)} words, dim={self.dim}, clip={self.clip:g})"

    def index(self, word: str) -> int:
        """Index of ``word``; KeyError if absent."""
        return self._index[word]

    def get(self, word: str) -> int | None:
        """Index of ``word`` or None."""
        return self._index.get(word)

    def word(self, index: int) -> str:
        return self._words[int(index)]

    def lookup(self, indices: Iterable[int]) -> list[str]:
        """Words at the given indices."""
        return [self._words[int(i)] for i in indices]

    def vectors_for(self, words: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Input vectors for ``words`` and a mask of the known ones.

        Known words: their vocabulary vector. Unknown words: their subword vector
        (:meth:`SubwordTable.vector`) when the vocabulary has an n-gram table, else the zero vector
        (the centre of the clip box). Both are public, data-independent maps into the clip box and
        the ball of radius :attr:`max_norm`, so :attr:`diameter_bound` covers every input.
        """
        idx = np.array([self._index.get(w, -1) for w in words], dtype=np.int64)
        known = idx >= 0
        out = np.zeros((len(idx), self.dim), dtype=np.float32)
        out[known] = self._vectors[idx[known]]
        if self.subwords is not None and not known.all():
            unknown = np.nonzero(~known)[0]
            out[unknown] = self.subwords.vectors([words[int(i)] for i in unknown])
        return out, known

    # ------------------------------------------------------------------ distance bounds
    @property
    def box_diameter(self) -> float:
        """``2 * clip * sqrt(dim)``: the largest distance between any two vectors in the clip box."""
        return 2.0 * self.clip * math.sqrt(self.dim)

    @property
    def diameter_bound(self) -> float:
        """An upper bound on the distance between any two words of this vocabulary (and the origin).

        ``min(2 max_w ||w||, box_diameter)``: by the triangle inequality ``||a - b|| <= ||a|| + ||b||``.
        It is computed from the public vocabulary only, never from a user's text.
        """
        max_norm = float(np.sqrt(np.max(self._sq_norms.astype(np.float64))))
        # Round up a little: float32 norms, and the bound must never be below the truth.
        return min(2.0 * max_norm * (1.0 + 1e-6), self.box_diameter)

    def nearest_neighbour_distance(self, *, sample: int = 2000, quantile: float = 0.5) -> float:
        """Typical distance from a word to its nearest *other* word (median over a fixed sample).

        Used to say what a per-distance guarantee means for two similar words. The sample of words
        is fixed (the first ``sample`` words after a deterministic shuffle), so the number is
        reproducible; it describes the public vocabulary, not anyone's data.
        """
        if quantile == 0.5 and sample == 2000 and self._nn_distance is not None:
            return self._nn_distance
        if len(self) < 2:
            raise InvalidParameter("a vocabulary with one word has no nearest neighbour")
        order = np.random.default_rng(0).permutation(len(self))[: min(sample, len(self))]
        queries = self._vectors[order]
        dists = np.empty(len(order), dtype=np.float64)
        for lo in range(0, len(order), _QUERY_BLOCK):
            q = queries[lo : lo + _QUERY_BLOCK].astype(np.float64)
            d2 = (
                np.sum(q * q, axis=1)[:, None]
                - 2.0 * q @ self._vectors.T.astype(np.float64)
                + self._sq_norms.astype(np.float64)[None, :]
            )
            d2[np.arange(len(q)), order[lo : lo + _QUERY_BLOCK]] = np.inf
            dists[lo : lo + len(q)] = np.sqrt(np.maximum(d2.min(axis=1), 0.0))
        value = float(np.quantile(dists, quantile))
        if quantile == 0.5 and sample == 2000:
            self._nn_distance = value
        return value

    # ------------------------------------------------------------------ search
    def nearest(self, vectors: Any, *, method: str = "exact") -> np.ndarray:
        """Index of the nearest vocabulary word (Euclidean) for each row of ``vectors``.

        Args:
            vectors: ``n x dim`` (or one ``dim`` vector) of finite reals.
            method: ``"exact"`` (default: blocked float32 GEMM + argmin), ``"faiss-flat"`` (exact,
                faiss ``IndexFlatL2``), ``"faiss-hnsw"`` (approximate; see :meth:`search_recall`),
                or ``"numpy"`` (one argmin per row; a slow reference).

        Returns:
            int64 array of ``n`` indices (a scalar index for a single vector). ``"exact"`` is exact
            (:mod:`gaussdp.text.search`: float32 lower bounds with proven error margins, then a
            float64 / rational re-check): the smallest true distance, ties to the lowest index.
            faiss ranks by float32 distances and may differ on near-ties.

        Raises:
            UnsafeInput: NaN/Inf in ``vectors``; InvalidParameter: wrong dimension or method.
        """
        q = np.asarray(vectors, dtype=np.float32)
        single = q.ndim == 1
        if single:
            q = q[None, :]
        if q.ndim != 2 or q.shape[1] != self.dim:
            raise InvalidParameter(f"vectors must have shape (n, {self.dim}), got {np.shape(vectors)}")
        if not np.all(np.isfinite(q)):
            raise UnsafeInput("vectors contains NaN or Inf")
        if method == "exact":
            out = self._nearest_exact(q)
        elif method == "numpy":
            out = np.array([int(np.argmin(np.sum((self._vectors - v) ** 2, axis=1))) for v in q])
        elif method in ("faiss-flat", "faiss-hnsw"):
            index = self._faiss_index(method)
            _, ids = index.search(np.ascontiguousarray(q), 1)
            out = ids[:, 0].astype(np.int64)
        else:
            raise InvalidParameter(
                f"method must be 'exact', 'numpy', 'faiss-flat' or 'faiss-hnsw', got method={method!r}"
            )
        return out[0] if single else out

    def _nearest_exact(self, q: np.ndarray) -> np.ndarray:
        if self._exact is None:  # built on first use: a projection of the (immutable) vectors
            self._exact = ExactSearch(self._vectors)
        return self._exact.nearest(q)

    def _faiss_index(self, method: str) -> Any:
        if method not in self._faiss:
            try:
                import faiss
            except ImportError as exc:  # pragma: no cover - depends on the environment
                raise ImportError("faiss search needs the 'text' extra: pip install 'gaussdp[text]'") from exc
            index: Any
            if method == "faiss-flat":
                index = faiss.IndexFlatL2(self.dim)
            else:
                index = faiss.IndexHNSWFlat(self.dim, 32)
                index.hnsw.efSearch = 64
            index.add(np.ascontiguousarray(self._vectors))
            self._faiss[method] = index
        return self._faiss[method]

    def search_recall(self, vectors: Any, *, method: str = "faiss-hnsw") -> float:
        """Fraction of rows where ``method`` returns the same word as the exact search."""
        exact = np.atleast_1d(self.nearest(vectors))
        other = np.atleast_1d(self.nearest(vectors, method=method))
        return float(np.mean(exact == other))

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_keyed_vectors(cls, kv: Any, *, clip: float = 1.0, clip_vectors: bool = True) -> Vocabulary:
        """From a gensim ``KeyedVectors`` (coordinates clipped to ``[-clip, clip]`` by default)."""
        return cls(
            list(kv.index_to_key),
            np.asarray(kv.vectors),
            clip=clip,
            clip_vectors=clip_vectors,
            meta={"source": "gensim KeyedVectors"},
        )

    @classmethod
    def from_word2vec(
        cls,
        path: str | os.PathLike[str],
        *,
        binary: bool | None = None,
        clip: float = 1.0,
        clip_vectors: bool = True,
        limit: int | None = None,
    ) -> Vocabulary:
        """From a word2vec text or binary file (gensim's reader; ``binary`` guessed from the suffix)."""
        require_extra("text", feature="reading word2vec files")
        from gensim.models import KeyedVectors

        path = Path(path)
        if binary is None:
            binary = path.suffix.lower() in (".bin", ".gz") and not path.name.endswith(".txt.gz")
        kv = KeyedVectors.load_word2vec_format(str(path), binary=binary, limit=limit)
        vocab = cls.from_keyed_vectors(kv, clip=clip, clip_vectors=clip_vectors)
        vocab.meta["source"] = f"word2vec {'binary' if binary else 'text'} file {path.name}"
        return vocab

    @classmethod
    def train(
        cls,
        sentences: Iterable[Sequence[str]] | str | os.PathLike[str],
        *,
        dim: int = 50,
        min_count: int = 3,
        window: int = 5,
        negative: int = 8,
        epochs: int = 5,
        max_vocab: int | None = 100_000,
        clip: float = 1.0,
        workers: int = 1,
        seed: int = 1,
        subwords: bool = False,
        buckets: int = 8192,
        subword_n: tuple[int, int] = (3, 6),
    ) -> Vocabulary:
        """Train word2vec (gensim, skip-gram with negative sampling) and clip to ``[-clip, clip]``.

        Defaults are the text perturbation service's: 50 dimensions, min count 3, window 5, 8 negative
        samples, vectors clipped to ``[-1, 1]``, at most 100k words. ``sentences`` is a path to a UTF-8 text
        file (tokenised with :func:`gaussdp.text.tokenize.words`, one sentence per line) or an
        iterable of token lists. The vectors are public parameters of the mechanism: train them on
        public text, not on the text you mean to protect. ``seed`` only makes training reproducible
        (the word vectors are not noise).

        ``subwords=True`` trains gensim's ``FastText`` (the same skip-gram objective plus character
        n-grams hashed into ``buckets`` vectors, lengths ``subword_n``) instead, and keeps the n-gram
        table so that unknown words get a vector (:mod:`gaussdp.text.subwords`).
        """
        return train_word2vec(
            sentences,
            dim=dim,
            min_count=min_count,
            window=window,
            negative=negative,
            epochs=epochs,
            max_vocab=max_vocab,
            clip=clip,
            workers=workers,
            seed=seed,
            subwords=subwords,
            buckets=buckets,
            subword_n=subword_n,
        )

    # ------------------------------------------------------------------ file format
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the vocabulary as one ``.npz`` file (words, float32 vectors, JSON metadata)."""
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        meta = {"format": "gaussdp-vocabulary", "version": FORMAT_VERSION, "clip": self.clip, **self.meta}
        arrays: dict[str, Any] = {}
        if self.subwords is not None:
            meta["subword_n"] = [self.subwords.min_n, self.subwords.max_n]
            arrays["subword_table"] = self.subwords.table
        with open(path, "wb") as fh:
            np.savez_compressed(
                fh,
                words=np.array(self._words, dtype=str),
                vectors=self._vectors,
                meta=np.array(json.dumps(meta)),
                **arrays,
            )
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Vocabulary:
        """Read a file written by :meth:`save`. Also accepts word2vec ``.txt``/``.bin`` files."""
        path = Path(path)
        if path.suffix.lower() in (".txt", ".bin", ".vec", ".gz"):
            return cls.from_word2vec(path)
        with np.load(path, allow_pickle=False) as data:
            try:
                words, vectors, meta_raw = data["words"], data["vectors"], data["meta"]
            except KeyError as exc:
                raise UnsafeInput(f"{path} is not a gaussdp vocabulary file (missing {exc})") from None
            meta = json.loads(str(meta_raw))
            table = data["subword_table"] if "subword_table" in data.files else None
        if meta.get("format") != "gaussdp-vocabulary" or int(meta.get("version", -1)) > FORMAT_VERSION:
            raise UnsafeInput(f"{path} is not a gaussdp vocabulary file of version <= {FORMAT_VERSION}")
        clip = float(meta.pop("clip", 1.0))
        n_range = meta.pop("subword_n", [3, 6])
        for key in ("format", "version"):
            meta.pop(key, None)
        return cls(
            words.tolist(),
            vectors,
            clip=clip,
            meta=meta,
            subword_table=table,
            subword_n=(int(n_range[0]), int(n_range[1])),
        )


def train_word2vec(
    sentences: Iterable[Sequence[str]] | str | os.PathLike[str],
    *,
    dim: int = 50,
    min_count: int = 3,
    window: int = 5,
    negative: int = 8,
    epochs: int = 5,
    max_vocab: int | None = 100_000,
    clip: float = 1.0,
    workers: int = 1,
    seed: int = 1,
    subwords: bool = False,
    buckets: int = 8192,
    subword_n: tuple[int, int] = (3, 6),
) -> Vocabulary:
    """See :meth:`Vocabulary.train`."""
    require_extra("text", feature="training word2vec")
    from gensim.models import FastText, Word2Vec

    from gaussdp.text.tokenize import words as tokenize_words

    if isinstance(sentences, (str, os.PathLike)):
        path = Path(sentences)
        text = path.read_text(encoding="utf-8")
        corpus = [toks for line in text.splitlines() if (toks := tokenize_words(line))]
        source = f"word2vec trained on {path.name}"
    else:
        corpus = [list(s) for s in sentences]
        source = "word2vec trained on an in-memory corpus"
    if not corpus:
        raise UnsafeInput("the training corpus has no words")
    common: dict[str, Any] = {
        "sentences": corpus,
        "vector_size": int(dim),
        "min_count": int(min_count),
        "window": int(window),
        "negative": int(negative),
        "sg": 1,
        "epochs": int(epochs),
        "workers": int(workers),
        "seed": int(seed),
        "max_final_vocab": max_vocab,
    }
    model: Any
    if subwords:
        buckets = int(buckets)
        if buckets < 1:
            raise InvalidParameter(f"buckets must be >= 1, got buckets={buckets}")
        model = FastText(**common, bucket=buckets, min_n=int(subword_n[0]), max_n=int(subword_n[1]))
        source = source.replace("word2vec", "fastText (subwords)")
    else:
        model = Word2Vec(**common)
    kv = model.wv
    if len(kv.index_to_key) == 0:
        raise UnsafeInput(f"no word occurs at least min_count={min_count} times in the corpus")
    vocab = Vocabulary(
        list(kv.index_to_key),
        np.asarray(kv.vectors),
        clip=clip,
        clip_vectors=True,
        subword_table=np.asarray(kv.vectors_ngrams) if subwords else None,
        subword_n=(int(subword_n[0]), int(subword_n[1])),
    )
    vocab.meta.update(
        {
            "source": source,
            "dim": int(dim),
            "min_count": int(min_count),
            "window": int(window),
            "negative": int(negative),
            "epochs": int(epochs),
        }
    )
    return vocab


def vocabulary_id(vocabulary: Vocabulary) -> str:
    """The vocabulary's id: first 16 hex digits of sha256 of its words joined by newlines.

    The page declares it with an upload and the fine-tuning service checks it against its own.
    """
    return hashlib.sha256("\n".join(vocabulary.words).encode("utf-8")).hexdigest()[:16]
