"""``gaussdp audit``: an empirical lower bound on the epsilon of a Gaussian release."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    app.command()(audit)


def audit(
    epsilon: float = typer.Option(1.0, help="Claimed epsilon of one release."),
    delta: float = typer.Option(1e-5, help="Claimed delta, in (0, 1)."),
    sensitivity: float = typer.Option(1.0, help="L2 sensitivity (x=sensitivity vs x'=0)."),
    samples: int = typer.Option(200_000, help="Releases drawn on each side."),
    path: str = typer.Option(
        "secure", help="'secure' (gaussdp's float-safe default), 'fast', or 'naive' (x + sigma*Z)."
    ),
    sigma_scale: float = typer.Option(1.0, help="Multiply the calibrated sigma (e.g. 0.5 to break it)."),
    alpha: float = typer.Option(1e-6, help="Error probability of the Clopper-Pearson bound."),
) -> None:
    """Release x=sensitivity and x'=0 many times; print the epsilon lower bound the samples certify."""
    import numpy as np
    from rich.console import Console

    from gaussdp.audit import epsilon_lower_bound
    from gaussdp.errors import PrivacyError
    from gaussdp.mechanism import GaussianMechanism

    console = Console()
    try:
        mech = GaussianMechanism(epsilon=epsilon, delta=delta, sensitivity=sensitivity)
        sigma = mech.sigma * sigma_scale
        if path == "naive":
            rng = np.random.default_rng()
            s32, x32 = np.float32(sigma), np.float32(sensitivity)
            a = x32 + s32 * rng.standard_normal(samples, dtype=np.float32)
            b = np.float32(0.0) + s32 * rng.standard_normal(samples, dtype=np.float32)
        elif path in ("secure", "fast"):
            m = GaussianMechanism(sigma=sigma, sensitivity=sensitivity, noise=path)  # type: ignore[arg-type]
            a = m.release_rows(np.full((samples, 1), sensitivity, np.float32))[:, 0]
            b = m.release_rows(np.zeros((samples, 1), np.float32))[:, 0]
        else:
            raise typer.BadParameter("path must be 'secure', 'fast' or 'naive'")
        result = epsilon_lower_bound(a, b, delta=delta, alpha=alpha)
    except PrivacyError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    verdict = "[red]claim refuted[/red]" if result.epsilon_lower_bound > epsilon else "consistent"
    console.print(
        f"path={path} sigma={sigma:.6g} samples={samples} per side: epsilon lower bound "
        f"{result.epsilon_lower_bound:.4f} (confidence {1 - alpha:g}) vs claim {epsilon:g}: {verdict}"
    )
    console.print(
        f"best event: {result.event} ({result.count}/{result.n} vs {result.count_neighbour}/"
        f"{result.n_neighbour})"
    )
