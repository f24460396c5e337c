"""A small causal language model trained on real text shipped in an installed package (no downloads).

``gaussdp inference-report`` measures what hidden-state noise does to a model's predictions. On a
model with random weights, or on random token ids, its perplexities mean nothing. This module
builds a model whose numbers do mean something, from parts already on the machine:

* the text: the Lee background corpus that gensim ships for its own tests
  (``gensim/test/test_data/lee_background.cor``: 300 news articles, about 60 000 words; Lee, Pincombe
  & Welsh 2005). One document per line. Every tenth document is held out (:func:`held_out_split`).
* a word-level tokenizer built from the training documents (Hugging Face ``tokenizers``: NFKC,
  lower case, words and punctuation, the ``vocab_size`` most frequent with ``min_frequency`` 2,
  ``[UNK]`` for the rest, ``[EOS]`` between documents);
* a GPT-2 built from a config (2 blocks, width 128 by default, about 0.8 M parameters, 3 MB) and
  trained on CPU for a couple of minutes; saved with ``save_pretrained`` (model and tokenizer) so
  that ``AutoModelForCausalLM`` / ``AutoTokenizer`` load it from the directory.

Perplexity is per word-level token (``[UNK]`` included as a target), on the held-out documents.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gaussdp._validate import check_counts
from gaussdp.errors import InvalidParameter

__all__ = [
    "TinyLMResult",
    "build_tokenizer",
    "corpus_documents",
    "default_corpus_path",
    "held_out_split",
    "load_causal_lm",
    "perplexity",
    "read_prompts",
    "train_tiny_lm",
]

_CORPUS = "lee_background.cor"


def default_corpus_path() -> Path:
    """Path of gensim's Lee background corpus (installed with gensim; never downloaded).

    Raises:
        FileNotFoundError: gensim is not installed, or its test data were stripped from it.
    """
    import importlib.util

    spec = importlib.util.find_spec("gensim")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default corpus is gensim's test data (gensim/test/test_data/lee_background.cor): "
            "install gensim ('gaussdp[text]'), or pass a text file of your own"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "test" / "test_data" / _CORPUS
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing (gensim installed without its test data)")
    return path


def corpus_documents(path: str | Path | None = None) -> list[str]:
    """The distinct non-empty lines of ``path`` (default :func:`default_corpus_path`), in order, one
    document each (the Lee corpus repeats some articles: a held-out copy of a training document
    would measure memorisation)."""
    p = default_corpus_path() if path is None else Path(path)
    lines = (line.strip() for line in p.read_text(encoding="utf-8", errors="replace").splitlines())
    docs = list(dict.fromkeys(d for d in lines if d))
    if not docs:
        raise InvalidParameter(f"{p} holds no text")
    return docs


def held_out_split(docs: Sequence[str], *, every: int = 10) -> tuple[list[str], list[str]]:
    """``(train, held_out)``: every ``every``-th document (the 10th, 20th, ...) is held out (the last
    one when there are fewer than ``every``)."""
    if len(docs) < 2:
        raise InvalidParameter(f"need at least 2 documents to hold one out, got {len(docs)}")
    held_idx = set(range(every - 1, len(docs), every)) or {len(docs) - 1}
    train = [d for i, d in enumerate(docs) if i not in held_idx]
    held = [d for i, d in enumerate(docs) if i in held_idx]
    return train, held


def read_prompts(path: str | Path) -> list[str]:
    """The non-empty lines of a UTF-8 text file, one prompt each (``inference-report --prompts``)."""
    p = Path(path)
    if not p.is_file():
        raise InvalidParameter(f"--prompts: no such file {str(p)!r}")
    prompts = [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise InvalidParameter(f"--prompts: {str(p)!r} holds no non-empty line")
    return prompts


def build_tokenizer(train_docs: Sequence[str], vocab_size: int) -> Any:
    """A word-level ``PreTrainedTokenizerFast`` of ``train_docs`` (``[UNK]``, ``[EOS]`` included)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=["[UNK]", "[EOS]"]
    )
    tok.train_from_iterator(list(train_docs), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]", pad_token="[EOS]", bos_token="[EOS]"
    )


def _stream(tokenizer: Any, docs: Sequence[str]) -> Any:
    """All documents' token ids, ``[EOS]`` after each, as one long tensor."""
    import torch

    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for d in docs:
        ids.extend(tokenizer(d, add_special_tokens=False)["input_ids"])
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def perplexity(model: Any, tokenizer: Any, docs: Sequence[str], *, seq_len: int = 64) -> float:
    """Per-token perplexity of ``model`` on ``docs`` (blocks of ``seq_len`` tokens, no noise)."""
    import torch
    import torch.nn.functional as F

    stream = _stream(tokenizer, docs)
    n = (stream.numel() - 1) // seq_len * seq_len
    if n <= 0:
        raise InvalidParameter(f"the documents hold fewer than {seq_len + 1} tokens")
    nll, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, n, 32 * seq_len):
            end = min(n, start + 32 * seq_len)
            x = stream[start:end].reshape(-1, seq_len)
            y = stream[start + 1 : end + 1].reshape(-1, seq_len)
            logits = model(x).logits
            nll += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).double(), y.reshape(-1), reduction="sum"
            ).item()
            count += y.numel()
    return math.exp(nll / count)


@dataclass(frozen=True)
class TinyLMResult:
    """What :func:`train_tiny_lm` built.

    Attributes:
        path: the directory (``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer``).
        vocab_size: tokens in the tokenizer (``[UNK]`` and ``[EOS]`` included).
        parameters: number of model parameters.
        train_tokens, held_out_tokens: tokens in each part of the corpus.
        perplexity_before, perplexity_after: held-out perplexity of the untrained and trained model.
        seconds: wall-clock training time.
    """

    path: Path
    vocab_size: int
    parameters: int
    train_tokens: int
    held_out_tokens: int
    perplexity_before: float
    perplexity_after: float
    seconds: float


def train_tiny_lm(
    out_dir: str | Path,
    *,
    corpus: str | Path | None = None,
    vocab_size: int = 4000,
    n_embd: int = 128,
    n_layer: int = 2,
    n_head: int = 4,
    seq_len: int = 64,
    batch_size: int = 16,
    steps: int = 600,
    learning_rate: float = 3e-3,
    seed: int = 0,
    num_threads: int | None = 1,
) -> TinyLMResult:
    """Train a small GPT-2 on ``corpus`` (default: gensim's Lee corpus) and save it to ``out_dir``.

    The weights are trained on the training documents only (see :func:`held_out_split`); the
    held-out ones are what ``inference-report`` measures on. CPU only, deterministic for a seed.
    ``num_threads`` torch threads while training (1 by default: on a small, shared machine extra
    threads only contend; ``None`` keeps torch's setting).

    Returns:
        A :class:`TinyLMResult` (with the held-out perplexity before and after training).
    """
    import torch

    check_counts(vocab_size=vocab_size, steps=steps, seq_len=seq_len, batch_size=batch_size)
    threads = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        return _train(
            Path(out_dir), corpus, vocab_size, n_embd, n_layer, n_head, seq_len, batch_size, steps,
            learning_rate, seed,
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)


def _train(
    out: Path,
    corpus: str | Path | None,
    vocab_size: int,
    n_embd: int,
    n_layer: int,
    n_head: int,
    seq_len: int,
    batch_size: int,
    steps: int,
    learning_rate: float,
    seed: int,
) -> TinyLMResult:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    t0 = time.perf_counter()
    train_docs, held = held_out_split(corpus_documents(corpus))
    tokenizer = build_tokenizer(train_docs, vocab_size)
    train_ids = _stream(tokenizer, train_docs)
    held_ids = _stream(tokenizer, held)
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=max(128, seq_len),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = GPT2LMHeadModel(config)
    eval_seq = min(seq_len, max(1, held_ids.numel() - 1))
    before = perplexity(model, tokenizer, held, seq_len=eval_seq)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=learning_rate, total_steps=steps, pct_start=0.1)
    top = train_ids.numel() - seq_len - 1
    if top < 1:
        raise InvalidParameter(f"the training documents hold fewer than {seq_len + 2} tokens")
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, top, (batch_size,), generator=g)
        x = torch.stack([train_ids[s : s + seq_len] for s in starts.tolist()])
        y = torch.stack([train_ids[s + 1 : s + seq_len + 1] for s in starts.tolist()])
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    after = perplexity(model, tokenizer, held, seq_len=eval_seq)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return TinyLMResult(
        path=out,
        vocab_size=len(tokenizer),
        parameters=sum(p.numel() for p in model.parameters()),
        train_tokens=int(train_ids.numel()),
        held_out_tokens=int(held_ids.numel()),
        perplexity_before=before,
        perplexity_after=after,
        seconds=time.perf_counter() - t0,
    )


def load_causal_lm(path: str | Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local Hugging Face directory (never a hub name: no download).

    Raises:
        InvalidParameter: ``path`` is not a directory, or holds no tokenizer (text prompts need one).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise InvalidParameter(f"model path {str(p)!r} is not a local directory (nothing is downloaded)")
    no_tokenizer = InvalidParameter(
        f"{str(p)!r} holds no tokenizer: text prompts need the model's own (save it with "
        "tokenizer.save_pretrained, as `gaussdp train-tiny-lm` does)"
    )
    # transformers may build an empty tokenizer from a config alone: look for the files first
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise no_tokenizer
    model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError):
        raise no_tokenizer from None
    return model, tokenizer
