"""``gaussdp audit``: an empirical lower bound on the epsilon of a Gaussian release."""

from __future__ import annotations

from enum import StrEnum

import typer

from gaussdp.cli._output import JSON_HELP


class ReleasePath(StrEnum):
    secure = "secure"
    fast = "fast"
    naive = "naive"


def register(app: typer.Typer) -> None:
    app.command()(audit)


def audit(
    epsilon: float = typer.Option(1.0, help="Claimed epsilon of one release."),
    delta: float = typer.Option(1e-5, help="Claimed delta, in (0, 1)."),
    sensitivity: float = typer.Option(1.0, help="L2 sensitivity (x=sensitivity vs x'=0)."),
    samples: int = typer.Option(200_000, help="Releases drawn on each side."),
    path: ReleasePath = typer.Option(
        ReleasePath.secure, help="'secure' (gaussdp's float-safe default), 'fast', or 'naive' (x + sigma*Z)."
    ),
    sigma_scale: float = typer.Option(1.0, help="Multiply the calibrated sigma (e.g. 0.5 to break it)."),
    alpha: float = typer.Option(1e-6, help="Error probability of the Clopper-Pearson bound."),
    json_output: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Release x=sensitivity and x'=0 many times; print the epsilon lower bound the samples certify."""
    import numpy as np

    from gaussdp._format import format_exact, format_lower, format_upper
    from gaussdp.audit import epsilon_lower_bound
    from gaussdp.cli._output import EXIT_USAGE, emit_json, fail, make_console
    from gaussdp.errors import PrivacyError
    from gaussdp.mechanism import GaussianMechanism

    console = make_console()
    kind = path.value
    try:
        mech = GaussianMechanism(epsilon=epsilon, delta=delta, sensitivity=sensitivity)
        sigma = mech.sigma * sigma_scale
        if kind == "naive":
            rng = np.random.default_rng()
            s32, x32 = np.float32(sigma), np.float32(sensitivity)
            a = x32 + s32 * rng.standard_normal(samples, dtype=np.float32)
            b = np.float32(0.0) + s32 * rng.standard_normal(samples, dtype=np.float32)
        elif kind in ("secure", "fast"):
            m = GaussianMechanism(sigma=sigma, sensitivity=sensitivity, noise=kind)  # type: ignore[arg-type]
            a = m.release_rows(np.full((samples, 1), sensitivity, np.float32))[:, 0]
            b = m.release_rows(np.zeros((samples, 1), np.float32))[:, 0]
        else:
            raise typer.BadParameter("path must be 'secure', 'fast' or 'naive'")
        result = epsilon_lower_bound(a, b, delta=delta, alpha=alpha)
    except PrivacyError as exc:
        fail(str(exc), EXIT_USAGE)
    refuted = result.epsilon_lower_bound > epsilon
    if json_output:
        emit_json(
            {
                "path": kind,
                "sigma": sigma,
                "samples": samples,
                "epsilon_claimed": epsilon,
                "delta": delta,
                "epsilon_lower_bound": result.epsilon_lower_bound,
                "confidence": 1 - alpha,
                "refuted": refuted,
                "event": str(result.event),
                "count": result.count,
                "n": result.n,
                "count_neighbour": result.count_neighbour,
                "n_neighbour": result.n_neighbour,
            }
        )
        return
    verdict = "[red]claim refuted[/red]" if refuted else "consistent"
    console.print(
        f"path={kind} sigma={format_upper(sigma)} samples={samples} per side: epsilon lower bound "
        f"{format_lower(result.epsilon_lower_bound, 5)} (confidence {1 - alpha:g}) vs claim "
        f"{format_exact(epsilon)}: {verdict}"
    )
    console.print(
        f"best event: {result.event} ({result.count}/{result.n} vs {result.count_neighbour}/"
        f"{result.n_neighbour})"
    )
