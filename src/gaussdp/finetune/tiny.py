"""A tiny causal LM for demos and tests: :func:`tiny_causal_lm` (no download, seconds on a CPU)."""

from __future__ import annotations

from pathlib import Path

from gaussdp._validate import check_counts
from gaussdp.errors import InvalidParameter

__all__ = ["tiny_causal_lm"]


def tiny_causal_lm(
    out_dir: str | Path,
    *,
    train: bool = False,
    vocab_size: int = 2000,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 2,
    n_positions: int = 128,
    train_steps: int = 200,
    seed: int = 0,
) -> Path:
    """Save a small GPT-2 and its word-level tokenizer to ``out_dir``; return it.

    The tokenizer is built from gensim's Lee background corpus (training documents only, as in
    :mod:`gaussdp.inference.tiny_lm`), the model from a ``GPT2Config`` (2 blocks, width 64: about
    0.2 M parameters with the default vocabulary). Both are saved with ``save_pretrained``, so
    ``AutoModelForCausalLM`` / ``AutoTokenizer`` (and :func:`gaussdp.finetune.run_finetune`) load the
    directory. Untrained by default (random weights: enough to test the plumbing, in about a
    second); ``train=True`` trains it for ``train_steps`` non-private steps on the same corpus first
    (:func:`gaussdp.inference.tiny_lm.train_tiny_lm`; tens of seconds).

    Raises:
        InvalidParameter: a size argument that is not a positive int (named).
        FileNotFoundError: gensim (and its test corpus) is not installed.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gaussdp.inference.tiny_lm import build_tokenizer, corpus_documents, held_out_split, train_tiny_lm

    check_counts(
        vocab_size=vocab_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        n_positions=n_positions, train_steps=train_steps,
    )  # fmt: skip
    if n_embd % n_head:
        raise InvalidParameter(f"n_embd must be a multiple of n_head, got n_embd={n_embd}, n_head={n_head}")
    out = Path(out_dir)
    if train:
        train_tiny_lm(
            out, vocab_size=vocab_size, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
            steps=train_steps, seed=seed,
        )  # fmt: skip
        return out
    train_docs, _ = held_out_split(corpus_documents())
    tokenizer = build_tokenizer(train_docs, vocab_size)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
