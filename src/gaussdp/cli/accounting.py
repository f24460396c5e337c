"""``gaussdp account``: epsilon of a DP-SGD run (or the noise for a target), with the accountant named."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any

import typer

from gaussdp._extras import require_extra
from gaussdp.cli._output import EXIT_USAGE, JSON_HELP, emit_json, fail, make_console

_ALL = ("pld", "rdp", "gdp", "advanced", "basic")  # the plot's curves; gdp drawn dashed, labelled


class AccountantName(StrEnum):
    """The accountants whose figures are upper bounds (gdp, an approximation, is only drawn by --plot)."""

    pld = "pld"
    rdp = "rdp"
    advanced = "advanced"
    basic = "basic"


def register(app: typer.Typer) -> None:
    app.command()(account)


def account(
    noise_multiplier: float = typer.Option(None, help="sigma / clip norm; omit with --target-epsilon."),
    sample_rate: float = typer.Option(1.0, help="Poisson sampling rate q in (0, 1]."),
    steps: int = typer.Option(1, help="Number of steps (releases)."),
    delta: float = typer.Option(1e-5, help="Target delta, in (0, 1)."),
    accountant: AccountantName = typer.Option(
        AccountantName.pld,
        help="pld (default, tight) | rdp | advanced | basic: upper bounds only ('gdp', a CLT "
        "approximation, is drawn in --plot but never printed as a guarantee).",
    ),
    target_epsilon: float = typer.Option(None, help="Print the noise multiplier that meets this epsilon."),
    plot: str = typer.Option("", help="Write a PNG of epsilon over steps for every accountant."),
    json_output: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Epsilon of STEPS subsampled Gaussian steps (add/remove neighbours), or the noise for a target.

    Printed epsilons are rounded up and a printed noise multiplier is rounded up then re-accounted,
    so that typed back it meets the target; --json gives the unrounded floats.
    """
    from gaussdp._format import format_calibrated, format_exact, format_upper
    from gaussdp.accounting import SubsampledGaussianEvent, noise_for_epsilon
    from gaussdp.accounting import accountant as make_accountant

    name = accountant.value
    console = make_console()

    def epsilon_of(noise: float) -> float:
        step = SubsampledGaussianEvent(noise, sample_rate)
        return make_accountant(name).compose(step, count=steps).epsilon(delta)

    if target_epsilon is not None:
        target_sigma = noise_for_epsilon(
            target_epsilon=target_epsilon,
            delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=name,
        )
        noise_multiplier = target_sigma
        if not json_output:
            # Printed rounded up, then re-accounted: the printed value, typed back, meets the target;
            # the epsilon line below is that printed value's.
            sigma_text, noise_multiplier = format_calibrated(
                target_sigma, lambda s: epsilon_of(s) <= target_epsilon
            )
            console.print(
                f"noise multiplier = {sigma_text} for epsilon <= {format_exact(target_epsilon)} at "
                f"delta={format_exact(delta)} ({steps} steps, sample rate {format_exact(sample_rate)}, "
                f"accountant={name})"
            )
    if noise_multiplier is None:
        fail("give --noise-multiplier or --target-epsilon", EXIT_USAGE)
    eps = epsilon_of(noise_multiplier)
    if plot:
        _plot(Path(plot), noise_multiplier, sample_rate, steps, delta)
    if json_output:
        emit_json(
            {
                "epsilon": eps,
                "delta": delta,
                "accountant": name,
                "noise_multiplier": noise_multiplier,
                "sample_rate": sample_rate,
                "steps": steps,
                "neighbours": "add/remove",
                "target_epsilon": target_epsilon,
                "plot": plot or None,
            }
        )
        return
    console.print(
        f"epsilon = {format_upper(eps)} at delta={format_exact(delta)}   accountant={name}; "
        f"noise multiplier {format_exact(noise_multiplier)}, sample rate {format_exact(sample_rate)}, "
        f"{steps} steps, add/remove neighbours"
    )
    if plot:
        console.print(f"plot written to {plot}")


def epsilon_curve(
    name: str, noise_multiplier: float, sample_rate: float, steps: int, delta: float, points: int = 16
) -> tuple[list[int], list[float]]:
    """Epsilon after each of ``points`` step counts up to ``steps`` (one accountant, composed online)."""
    import numpy as np

    from gaussdp.accounting import SubsampledGaussianEvent
    from gaussdp.accounting import accountant as make_accountant
    from gaussdp.errors import PrivacyError

    counts = sorted({int(c) for c in np.unique(np.geomspace(1, steps, points).round()) if c >= 1})
    acc = make_accountant(name, allow_approximate=True)  # a curve, labelled "approximate" where it is
    event = SubsampledGaussianEvent(noise_multiplier, sample_rate)
    xs: list[int] = []
    ys: list[float] = []
    done = 0
    for c in counts:
        acc.compose(event, count=c - done)
        done = c
        try:
            ys.append(acc.epsilon(delta))
            xs.append(c)
        except PrivacyError:
            break
    return xs, ys


def _plot(path: Path, noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> None:
    require_extra("plot", feature="gaussdp account --plot")
    import matplotlib

    from gaussdp._format import format_exact

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.progress import track

    fig, ax = plt.subplots(figsize=(7, 4.5))
    progress = make_console(stderr=True)
    for name in track(_ALL, description="accounting for the plot", console=progress, transient=True):
        xs, ys = epsilon_curve(name, noise_multiplier, sample_rate, steps, delta)
        label = f"{name} (approximate)" if name == "gdp" else name
        ax.plot(xs, ys, label=label, linestyle="--" if name == "gdp" else "-")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("steps")
    ax.set_ylabel(f"epsilon at delta={format_exact(delta)}")
    ax.set_title(
        f"noise multiplier {format_exact(noise_multiplier)}, sample rate {format_exact(sample_rate)}"
    )
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def demo(console: Any, out_dir: Path) -> None:
    """Accounting section of ``gaussdp demo``: Abadi et al. 2016's MNIST run under every accountant."""
    from gaussdp._format import format_exact, format_upper
    from gaussdp.accounting import SubsampledGaussianEvent, noise_for_epsilon
    from gaussdp.accounting import accountant as make_accountant

    q, sigma, steps, delta = 256 / 60000, 1.1, 14063, 1e-5
    console.print(
        f"DP-SGD on MNIST (Abadi et al. 2016): q=256/60000, sigma={format_exact(sigma)}, {steps} steps, "
        f"delta={format_exact(delta)}"
    )
    for name in ("pld", "rdp", "gdp"):
        acc = make_accountant(name, allow_approximate=True).compose(
            SubsampledGaussianEvent(sigma, q), count=steps
        )
        note = "  (CLT approximation, not a bound)" if acc.approximate else ""
        console.print(f"  {name:<4} epsilon = {format_upper(acc.epsilon(delta), 4)}{note}")
    nm = noise_for_epsilon(target_epsilon=2.0, delta=delta, sample_rate=q, steps=steps)
    console.print(f"  noise multiplier for epsilon <= 2 (pld): {format_upper(nm, 4)}")
    path = out_dir / "accounting_epsilon_over_steps.png"
    try:
        _plot(path, sigma, q, steps, delta)
        console.print(f"  plot: {path}")
    except ImportError:
        console.print("  (matplotlib not installed: no plot)")
