"""A text classifier with embeddings and self-attention, trained with DP-SGD on text shipped offline.

The task: tell a window of 24 words from a news article (the Lee corpus that gensim ships with its
tests, ``lee_background.cor``) from a window of a Wikipedia article (gensim's
``head500.noblanks.cor``, stemmed). The data ship with gensim, so nothing is downloaded; the task is
easy on purpose: the point is the private pipeline, not the benchmark. The model is an
``nn.Embedding``, one ``nn.MultiheadAttention`` layer (gaussdp clips its per-sample gradients in the
same backward pass; the module is not replaced) and a linear head over the mean of the attended
tokens. Each window is one record (add/remove one record); prints epsilon and test accuracy.

Run: ``python examples/text_attention_classifier.py [--epochs 3] [--epsilon 4]``
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections import Counter
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gaussdp.torch import PrivacyEngine

WINDOW = 24


def corpus_path(name: str) -> Path:
    import gensim.test.utils

    return Path(gensim.test.utils.datapath(name))


def windows(path: Path, limit: int) -> list[list[str]]:
    out: list[list[str]] = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        toks = re.findall(r"[a-z]+", line.lower())
        out.extend(toks[i : i + WINDOW] for i in range(0, len(toks) - WINDOW + 1, WINDOW))
        if len(out) >= limit:
            break
    return out[:limit]


def dataset(per_class: int, vocab_size: int) -> tuple[TensorDataset, TensorDataset, int]:
    news = windows(corpus_path("lee_background.cor"), per_class)
    wiki = windows(corpus_path("head500.noblanks.cor"), per_class)
    rows = [(w, 0) for w in news] + [(w, 1) for w in wiki]
    random.Random(0).shuffle(rows)
    cut = int(0.8 * len(rows))
    # The vocabulary comes from the training split only; it is a public choice here (the most common
    # words), which a real deployment would take from public data or pay for with budget.
    counts = Counter(t for w, _ in rows[:cut] for t in w)
    index = {t: i + 1 for i, (t, _) in enumerate(counts.most_common(vocab_size - 1))}  # 0: unknown

    def encode(part: list[tuple[list[str], int]]) -> TensorDataset:
        x = torch.tensor([[index.get(t, 0) for t in w] for w, _ in part])
        return TensorDataset(x, torch.tensor([label for _, label in part]))

    return encode(rows[:cut]), encode(rows[cut:]), len(index) + 1


class AttentionClassifier(nn.Module):
    def __init__(self, vocab: int, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head((h + a).mean(dim=1))


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--epsilon", type=float, default=4.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--per-class", type=int, default=1500, help="windows of each class")
    p.add_argument("--vocab-size", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)

    train, test, vocab = dataset(args.per_class, args.vocab_size)
    model = AttentionClassifier(vocab)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9),
        data_loader=DataLoader(train, batch_size=args.batch_size),
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        epochs=args.epochs,
        max_grad_norm=args.max_grad_norm,
    )
    for _ in range(args.epochs):
        model.train()
        for x, y in loader:
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        x, y = test.tensors
        acc = float((model(x).argmax(1) == y).float().mean())
    result = {
        "epsilon": engine.get_epsilon(args.delta),
        "delta": args.delta,
        "noise_multiplier": float(optimizer.noise_multiplier),
        "test_accuracy": acc,
        "train_records": len(train),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"DP-SGD attention classifier (news vs encyclopedia, {len(train)} windows): "
            f"epsilon={result['epsilon']:.3f} (delta={args.delta:g}, add/remove one window), "
            f"noise multiplier {result['noise_multiplier']:.3f}, test accuracy {acc:.3f}"
        )
    return result


if __name__ == "__main__":
    main()
