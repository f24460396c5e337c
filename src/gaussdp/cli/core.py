"""Core commands: ``gaussdp calibrate`` and ``gaussdp sanitize``, and the core demo section."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer


def register(app: typer.Typer) -> None:
    app.command()(calibrate)


def calibrate(
    epsilon: float = typer.Option(..., help="Target epsilon, > 0."),
    delta: float = typer.Option(..., help="Target delta, in (0, 1)."),
    sensitivity: float = typer.Option(1.0, help="L2 sensitivity of the query."),
    method: str = typer.Option("analytic", help="'analytic' (exact, default) or 'classical'."),
) -> None:
    """Print the noise sigma for one (epsilon, delta) Gaussian release, and what it really buys."""
    from rich.console import Console

    from gaussdp.calibration import delta_for, epsilon_for, sigma_for
    from gaussdp.errors import PrivacyError

    console = Console()
    try:
        sigma = sigma_for(epsilon=epsilon, delta=delta, sensitivity=sensitivity, method=method)  # type: ignore[arg-type]
    except PrivacyError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    console.print(f"sigma = {sigma:.10g}   (method={method}, sensitivity={sensitivity:g})")
    true_eps = epsilon_for(sigma=sigma, delta=delta, sensitivity=sensitivity)
    true_delta = delta_for(sigma=sigma, epsilon=epsilon, sensitivity=sensitivity)
    console.print(f"true epsilon at delta={delta:g}: {true_eps:.6g}")
    console.print(f"true delta at epsilon={epsilon:g}: {true_delta:.6g}")
    if method == "classical":
        analytic = sigma_for(epsilon=epsilon, delta=delta, sensitivity=sensitivity)
        console.print(
            f"the analytic sigma for the same target is {analytic:.10g} "
            f"({sigma / analytic:.3f}x less noise than classical)"
        )


def demo(console: Any, out_dir: Path) -> None:
    """Core section of ``gaussdp demo``."""
    from gaussdp.calibration import classical_sigma, epsilon_for, sigma_for

    for eps in (0.5, 1.0, 4.0, 8.0):
        exact = sigma_for(epsilon=eps, delta=1e-5)
        classical = classical_sigma(epsilon=eps, delta=1e-5)
        console.print(
            f"epsilon={eps:<4g} delta=1e-5: analytic sigma={exact:.4f}; classical sigma={classical:.4f} "
            f"(its true epsilon is {epsilon_for(sigma=classical, delta=1e-5):.3f})"
        )
