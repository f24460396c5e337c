"""Local differential privacy for text: perturb each word's embedding, release the nearest word.

The text perturbation service's flow, with honest guarantees: a :class:`Vocabulary` of word vectors clipped to
``[-1, 1]^dim``, a word mechanism (:class:`GaussianWordMechanism`, :class:`LaplaceWordMechanism`,
:class:`MahalanobisWordMechanism`, :class:`TruncatedExponentialWordMechanism`), exact batched
nearest-word search (:mod:`gaussdp.text.search`: proven float32 lower bounds, float64 re-check),
vectors for unknown words from fastText character n-grams (:mod:`gaussdp.text.subwords`, the same
computation in the ``/text`` page), and :func:`perturb_text` for whole documents with the per-word
and per-document guarantee. Needs the ``text`` extra (gensim, faiss-cpu) only to train vocabularies,
read word2vec files and use faiss search; the rest is numpy.
"""

from __future__ import annotations

from gaussdp.text.mechanisms import (
    MECHANISMS,
    GaussianWordMechanism,
    Guarantee,
    LaplaceWordMechanism,
    MahalanobisWordMechanism,
    TruncatedExponentialWordMechanism,
    WordMechanism,
    make_mechanism,
)
from gaussdp.text.perturb import (
    UNKNOWN_POLICIES,
    PerturbedText,
    cosine_similarity,
    perturb_text,
    plausible_deniability,
)
from gaussdp.text.tokenize import MAX_INPUT_BYTES, decode_text, read_text, words
from gaussdp.text.vocabulary import Vocabulary, train_word2vec

__all__ = [
    "MAX_INPUT_BYTES",
    "MECHANISMS",
    "UNKNOWN_POLICIES",
    "GaussianWordMechanism",
    "Guarantee",
    "LaplaceWordMechanism",
    "MahalanobisWordMechanism",
    "PerturbedText",
    "TruncatedExponentialWordMechanism",
    "Vocabulary",
    "WordMechanism",
    "cosine_similarity",
    "decode_text",
    "make_mechanism",
    "perturb_text",
    "plausible_deniability",
    "read_text",
    "train_word2vec",
    "words",
]
