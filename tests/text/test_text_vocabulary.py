"""Vocabulary: construction checks, our file format, word2vec files, and exact nearest-word search."""

from __future__ import annotations

import numpy as np
import pytest

from gaussdp.errors import InvalidParameter, UnsafeInput
from gaussdp.text import Vocabulary


def _random_vocab(n=3000, dim=20, seed=0):
    rng = np.random.default_rng(seed)
    return Vocabulary([f"w{i}" for i in range(n)], rng.uniform(-1, 1, (n, dim)).astype(np.float32))


def test_text_vocabulary_rejects_unsafe_input():
    with pytest.raises(UnsafeInput, match="NaN"):
        Vocabulary(["a", "b"], [[0.0, np.nan], [0.1, 0.2]])
    with pytest.raises(UnsafeInput, match="duplicates"):
        Vocabulary(["a", "a"], [[0.0, 0.0], [0.1, 0.2]])
    with pytest.raises(UnsafeInput, match="clip"):
        Vocabulary(["a", "b"], [[0.0, 1.5], [0.1, 0.2]])
    with pytest.raises(InvalidParameter, match="rows"):
        Vocabulary(["a"], [[0.0, 0.5], [0.1, 0.2]])
    v = Vocabulary(["a", "b"], [[0.0, 1.5], [0.1, -3.0]], clip_vectors=True)
    assert float(np.max(np.abs(v.vectors))) == 1.0
    with pytest.raises(ValueError):
        v.vectors[0, 0] = 0.5  # read-only: the distance bounds were computed from it


def test_text_vocabulary_distance_bounds_hold():
    v = _random_vocab(500, 8)
    x = v.vectors.astype(np.float64)
    pair_max = max(float(np.max(np.linalg.norm(x - row, axis=1))) for row in x)
    assert pair_max <= v.diameter_bound <= v.box_diameter == pytest.approx(2 * np.sqrt(8))
    assert float(np.max(np.linalg.norm(x, axis=1))) <= v.diameter_bound  # unknown words sit at 0
    d_nn = v.nearest_neighbour_distance()
    brute = np.sort(np.linalg.norm(x[:, None, :] - x[None, :, :], axis=2), axis=1)[:, 1]
    assert min(brute) <= d_nn <= max(brute)


def test_text_vocabulary_npz_round_trip(tmp_path):
    v = _random_vocab(100, 5)
    v.meta["source"] = "test"
    path = v.save(tmp_path / "vocab")
    assert path.suffix == ".npz"
    w = Vocabulary.load(path)
    assert w.words == v.words and w.meta["source"] == "test"
    np.testing.assert_array_equal(w.vectors, v.vectors)
    assert w.vectors.dtype == np.float32
    np.savez(tmp_path / "other.npz", words=np.array(["a"]), vectors=np.zeros((1, 2)))
    with pytest.raises(UnsafeInput, match="not a gaussdp vocabulary"):
        Vocabulary.load(tmp_path / "other.npz")


@pytest.mark.parametrize("binary", [False, True])
def test_text_vocabulary_reads_word2vec_files(tmp_path, binary):
    from gensim.models import KeyedVectors

    rng = np.random.default_rng(1)
    kv = KeyedVectors(vector_size=4)
    kv.add_vectors(["alpha", "beta", "gamma"], rng.uniform(-2, 2, (3, 4)).astype(np.float32))
    path = tmp_path / ("v.bin" if binary else "v.txt")
    kv.save_word2vec_format(str(path), binary=binary)
    v = Vocabulary.load(path)
    assert v.words == ["alpha", "beta", "gamma"]
    np.testing.assert_allclose(v.vectors, np.clip(kv.vectors, -1, 1), atol=1e-5)
    assert Vocabulary.from_keyed_vectors(kv).words == v.words


def test_text_vocabulary_train_document_002_settings():
    from gaussdp.text.corpus import demo_corpus

    v = Vocabulary.train(demo_corpus(3000, seed=3), epochs=2)
    assert v.dim == 50 and v.meta["min_count"] == 3 and v.meta["negative"] == 8 and v.meta["window"] == 5
    assert float(np.max(np.abs(v.vectors))) <= 1.0
    assert "dog" in v and "piano" in v


def test_text_nearest_matches_float64_brute_force_and_faiss():
    v = _random_vocab(5000, 20, seed=2)
    rng = np.random.default_rng(3)
    q = (v.vectors[rng.integers(0, len(v), 1500)] + rng.normal(0, 0.4, (1500, 20))).astype(np.float32)
    ours = v.nearest(q)
    x = v.vectors.astype(np.float64)
    q64 = q.astype(np.float64)
    d = (q64**2).sum(1)[:, None] - 2 * q64 @ x.T + (x**2).sum(1)[None, :]
    order = np.sort(d, axis=1)
    tie_free = (order[:, 1] - order[:, 0]) > 1e-4 * order[:, 1]
    assert tie_free.mean() > 0.99
    np.testing.assert_array_equal(ours[tie_free], d.argmin(axis=1)[tie_free])
    flat = v.nearest(q, method="faiss-flat")
    np.testing.assert_array_equal(ours[tie_free], flat[tie_free])
    np.testing.assert_array_equal(v.nearest(q[:50], method="numpy"), ours[:50])
    assert v.nearest(q[0]) == ours[0]  # a single vector gives a scalar index
    recall = v.search_recall(q, method="faiss-hnsw")
    assert 0.5 <= recall <= 1.0


def test_text_nearest_refuses_bad_vectors():
    v = _random_vocab(10, 3)
    with pytest.raises(UnsafeInput):
        v.nearest([[0.0, np.inf, 0.0]])
    with pytest.raises(InvalidParameter, match="shape"):
        v.nearest(np.zeros((2, 4)))
    with pytest.raises(InvalidParameter, match="method"):
        v.nearest(np.zeros((2, 3)), method="ivf")


def test_train_with_subwords_gives_gensims_unknown_word_vectors():
    """fastText training keeps the n-gram table; an unknown word's vector is gensim's (mean of its
    n-gram buckets) up to the float16 table, then clipped into the box and the max-norm ball."""
    pytest.importorskip("gensim")
    from gensim.models import FastText

    from gaussdp.text.corpus import demo_corpus

    corpus = demo_corpus(1500, seed=4)
    vocab = Vocabulary.train(corpus, epochs=1, subwords=True, buckets=512, seed=2)
    assert vocab.subwords is not None and vocab.subwords.table.shape == (512, 50)
    ref = FastText(
        sentences=corpus,
        vector_size=50,
        min_count=3,
        window=5,
        negative=8,
        sg=1,
        epochs=1,
        workers=1,
        seed=2,
        max_final_vocab=100_000,
        bucket=512,
        min_n=3,
        max_n=6,
    ).wv
    for word in ("zorblatt", "grandmothers", "kitchens"):
        assert word not in vocab
        want = np.clip(ref.get_vector(word), -1, 1)
        got = vocab.subwords.vector(word)
        np.testing.assert_allclose(got, want, atol=2e-3)  # float16 table: ~3 significant digits
    plain = Vocabulary.train(corpus, epochs=1, seed=2)
    assert plain.subwords is None
    vecs, known = plain.vectors_for(["dog", "zorblatt"])
    assert known.tolist() == [True, False] and not vecs[1].any()
