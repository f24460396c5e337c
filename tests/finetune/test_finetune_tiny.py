"""tiny_causal_lm: a directory AutoModelForCausalLM and AutoTokenizer load, untrained or trained."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gaussdp.errors import InvalidParameter  # noqa: E402
from gaussdp.finetune import tiny_causal_lm  # noqa: E402


def test_untrained_and_trained_models_load_and_differ(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trained = tiny_causal_lm(tmp_path / "t", train=True, train_steps=3, vocab_size=1000, n_embd=32)
    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    b = AutoModelForCausalLM.from_pretrained(trained, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(trained, local_files_only=True)
    assert a.config.model_type == b.config.model_type == "gpt2" and len(tok) == a.config.vocab_size
    wa, wb = a.transformer.wte.weight, b.transformer.wte.weight
    assert wa.shape == wb.shape and not torch.equal(wa, wb)
    ids = tok("the prime minister said", return_tensors="pt")["input_ids"]
    assert (ids != tok.unk_token_id).any()  # a word-level vocabulary of real text


def test_bad_sizes_are_named(tmp_path):
    with pytest.raises(InvalidParameter, match="n_layer"):
        tiny_causal_lm(tmp_path, n_layer=0)
    with pytest.raises(InvalidParameter, match="n_embd must be a multiple of n_head"):
        tiny_causal_lm(tmp_path, n_embd=30, n_head=4)
