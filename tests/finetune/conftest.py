"""A tiny causal LM saved from a config (no download) and real text: gensim's Lee corpus lines."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("gensim")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from gaussdp.finetune import tiny_causal_lm

    return tiny_causal_lm(tmp_path_factory.mktemp("tiny_gpt2"), vocab_size=1000, n_embd=32)


@pytest.fixture(scope="session")
def lee_lines():
    """The first 48 distinct documents of the Lee corpus, one record each."""
    from gaussdp.inference.tiny_lm import corpus_documents

    return corpus_documents()[:48]
