"""DP-SGD with PyTorch: ``gaussdp dp-sgd`` and the "DP-SGD" section of ``gaussdp demo``.

Both train a small MLP on scikit-learn's bundled digits (8x8 images, 1797 records, no download)
with :class:`gaussdp.torch.PrivacyEngine` and print test accuracy beside non-private training and
the epsilon actually spent (PLD accountant, add/remove one image).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from gaussdp.cli._output import JSON_HELP


def register(app: typer.Typer) -> None:
    app.command("dp-sgd")(dp_sgd)


def _digits() -> tuple[Any, Any, Any, Any]:
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = x / 16.0  # public bound of the pixel range, not computed from the data
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    as_t = torch.as_tensor
    return (as_t(xtr, dtype=torch.float32), as_t(ytr), as_t(xte, dtype=torch.float32), as_t(yte))


def train_digits(
    target_epsilon: float | None,
    *,
    delta: float = 1e-5,
    epochs: int = 15,
    batch_size: int = 64,
    max_grad_norm: float = 1.0,
    lr: float = 0.1,
) -> dict[str, float]:
    """Train the MLP; ``target_epsilon=None`` trains without privacy. Returns accuracy and epsilon."""
    import torch

    xtr, ytr, xte, yte = _digits()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-64-10 MLP: threads only add synchronisation
    try:
        return _train(xtr, ytr, xte, yte, target_epsilon, delta, epochs, batch_size, max_grad_norm, lr)
    finally:
        torch.set_num_threads(threads)


def _train(xtr, ytr, xte, yte, target_epsilon, delta, epochs, batch_size, max_grad_norm, lr):  # type: ignore[no-untyped-def]
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from gaussdp.torch import PrivacyEngine

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    optimizer: Any = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader: Any = DataLoader(TensorDataset(xtr, ytr), batch_size=batch_size, shuffle=True)
    engine = None
    if target_epsilon is not None:
        engine = PrivacyEngine(accountant="pld")
        model, optimizer, loader = engine.make_private_with_epsilon(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            target_epsilon=target_epsilon,
            target_delta=delta,
            epochs=epochs,
            max_grad_norm=max_grad_norm,
        )
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        for xb, yb in loader:
            loss_fn(model(xb), yb).backward()
            optimizer.step()
            optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    out = {"accuracy": acc, "epsilon": float("inf"), "noise_multiplier": 0.0}
    if engine is not None:
        engine.detach()
        out["epsilon"] = engine.get_epsilon(delta)
        out["noise_multiplier"] = float(optimizer.noise_multiplier)
    return out


def dp_sgd(
    epsilon: float = typer.Option(8.0, help="Target epsilon for the whole training run."),
    delta: float = typer.Option(1e-5, help="Target delta."),
    epochs: int = typer.Option(15, help="Epochs (expected passes over the data)."),
    json_output: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Train an MLP on the bundled digits with DP-SGD and print accuracy and the epsilon spent."""
    from gaussdp._format import format_exact, format_upper
    from gaussdp.cli._output import emit_json, make_console

    console = make_console()
    res = train_digits(epsilon, delta=delta, epochs=epochs)
    if json_output:
        emit_json({**res, "target_epsilon": epsilon, "delta": delta, "epochs": epochs})
        return
    console.print(
        f"DP-SGD digits: test accuracy {res['accuracy']:.3f}, epsilon spent "
        f"{format_upper(res['epsilon'], 4)} at delta={format_exact(delta)} (noise multiplier "
        f"{format_upper(res['noise_multiplier'], 4)})"
    )


def demo(console: Any, out_dir: Path) -> None:
    """DP-SGD section of ``gaussdp demo``: digits, non-private vs epsilon 8 and 1."""
    import time

    from rich.table import Table

    from gaussdp._format import format_exact, format_upper

    delta = 1e-5
    table = Table(title="MLP on scikit-learn digits (1347 train / 450 test), 15 epochs")
    for col in ("training", "noise multiplier", "epsilon spent", "test accuracy", "seconds"):
        table.add_column(col)
    for eps in (None, 8.0, 1.0):
        t0 = time.perf_counter()
        res = train_digits(eps, delta=delta)
        label = "non-private" if eps is None else f"DP-SGD, target epsilon {format_exact(eps)}"
        spent = "inf (no noise)" if eps is None else format_upper(res["epsilon"], 4)
        table.add_row(
            label,
            format_upper(res["noise_multiplier"], 4),
            spent,
            f"{res['accuracy']:.3f}",
            f"{time.perf_counter() - t0:.1f}",
        )
    console.print(table)
    console.print(
        f"epsilon at delta={format_exact(delta)}, PLD accountant, add/remove one image; Poisson sampling, "
        "per-sample clipping at norm 1, noise once per step (gaussdp.torch.PrivacyEngine)."
    )
