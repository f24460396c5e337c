"""A CNN with normalisation layers under DP-SGD: BatchNorm refused, GroupNorm trained.

BatchNorm normalises each image with statistics of the whole batch (and keeps their running averages
without noise), so one record moves every other record's gradient and the per-sample clipping bound
no longer holds. gaussdp refuses such a model at ``make_private``; ``ModuleValidator.fix`` returns a
copy with ``GroupNorm`` over the same channels, which normalises each sample on its own. This script
builds the BatchNorm CNN, shows the refusal, fixes it and trains the GroupNorm CNN on scikit-learn's
digits. Each image is one record (add/remove); prints the epsilon spent and the test accuracy.

Run: ``python examples/digits_groupnorm_cnn.py [--epochs 15] [--epsilon 3]``
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from gaussdp.torch import ModuleValidator, PrivacyEngine, UnsupportedModule


def digits(limit: int | None) -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    if limit:
        x, y = x[:limit], y[:limit]
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    as_set = lambda a, b: TensorDataset(torch.from_numpy(a), torch.from_numpy(b).long())  # noqa: E731
    return as_set(xtr, ytr), as_set(xte, yte)


def batchnorm_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 4x4
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 2x2
        nn.Flatten(),
        nn.Linear(16 * 2 * 2, 10),
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--limit", type=int, default=None, help="use only the first N images (smoke tests)")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)

    train, test = digits(args.limit)
    make = dict(
        data_loader=DataLoader(train, batch_size=args.batch_size),
        target_epsilon=args.epsilon,
        target_delta=args.delta,
        epochs=args.epochs,
        max_grad_norm=args.max_grad_norm,
    )
    model = batchnorm_cnn()
    problems = ModuleValidator.validate(model)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=args.lr)
        PrivacyEngine().make_private_with_epsilon(module=model, optimizer=opt, **make)
        raise SystemExit("a BatchNorm model was accepted: the per-sample bound would not hold")
    except UnsupportedModule as exc:
        refusal = str(exc).splitlines()[0]
    if not args.json:
        print(f"refused: {refusal[:100]}...")
        print(f"ModuleValidator.validate found {len(problems)} problem(s); fix() swaps in GroupNorm")

    model = ModuleValidator.fix(model)
    engine = PrivacyEngine()
    model, optimizer, loader = engine.make_private_with_epsilon(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9), **make
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
        "groupnorm_layers": sum(isinstance(m, nn.GroupNorm) for m in model.modules()),
        "problems_found": len(problems),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"DP-SGD GroupNorm CNN on digits: epsilon={result['epsilon']:.3f} (delta={args.delta:g}, "
            f"add/remove one image), noise multiplier {result['noise_multiplier']:.3f}, "
            f"test accuracy {acc:.3f}"
        )
    return result


if __name__ == "__main__":
    main()
