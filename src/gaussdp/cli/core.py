"""Core commands: ``gaussdp calibrate`` and ``gaussdp sanitize``, and the core demo section."""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer

from gaussdp.cli._output import JSON_HELP


def register(app: typer.Typer) -> None:
    app.command()(calibrate)
    app.command()(sanitize)


class CalibrationMethod(StrEnum):
    analytic = "analytic"
    classical = "classical"


class NoiseKind(StrEnum):
    secure = "secure"
    fast = "fast"


def calibrate(
    epsilon: float = typer.Option(..., help="Target epsilon, > 0."),
    delta: float = typer.Option(..., help="Target delta, in (0, 1)."),
    sensitivity: float = typer.Option(1.0, help="L2 sensitivity of the query."),
    method: CalibrationMethod = typer.Option(
        CalibrationMethod.analytic, help="'analytic' (exact, default) or 'classical'."
    ),
    json_output: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Print the noise sigma for one (epsilon, delta) Gaussian release, and what it really buys.

    The printed sigma is rounded up (more noise) and checked: typed back, it meets (epsilon, delta);
    the true epsilon and delta printed are that printed sigma's, rounded up. --json gives the
    unrounded floats of the sigma computed.
    """
    from gaussdp._format import format_calibrated, format_exact, format_upper
    from gaussdp.calibration import delta_for, epsilon_for, sigma_for
    from gaussdp.cli._output import emit_json, make_console

    how = method.value
    sigma = sigma_for(epsilon=epsilon, delta=delta, sensitivity=sensitivity, method=how)  # type: ignore[arg-type]
    analytic = sigma
    if how == "classical":
        analytic = sigma_for(epsilon=epsilon, delta=delta, sensitivity=sensitivity)
    if json_output:
        emit_json(
            {
                "sigma": sigma,
                "method": how,
                "epsilon": epsilon,
                "delta": delta,
                "sensitivity": sensitivity,
                "true_epsilon": epsilon_for(sigma=sigma, delta=delta, sensitivity=sensitivity),
                "true_delta": delta_for(sigma=sigma, epsilon=epsilon, sensitivity=sensitivity),
                "analytic_sigma": analytic,
            }
        )
        return

    def meets(s: float) -> bool:
        return epsilon_for(sigma=s, delta=delta, sensitivity=sensitivity) <= epsilon

    sigma_text, printed = format_calibrated(sigma, meets, 10, what="sigma")
    console = make_console()
    console.print(f"sigma = {sigma_text}   (method={how}, sensitivity={format_exact(sensitivity)})")
    console.print(
        f"true epsilon at delta={format_exact(delta)}: "
        f"{format_upper(epsilon_for(sigma=printed, delta=delta, sensitivity=sensitivity))}"
    )
    console.print(
        f"true delta at epsilon={format_exact(epsilon)}: "
        f"{format_upper(delta_for(sigma=printed, epsilon=epsilon, sensitivity=sensitivity))}"
    )
    if how == "classical":
        analytic_text, _ = format_calibrated(analytic, meets, 10, what="sigma")
        console.print(
            f"the analytic sigma for the same target is {analytic_text} "
            f"(classical adds {sigma / analytic:.3f}x that noise)"
        )


class Engine(StrEnum):
    local = "local"
    ray = "ray"


def _print_sanitized(console: Any, first_line: str, report: Any) -> None:
    """What a sanitize run did, the same for .npy and tables: clipping, noise, both epsilons."""
    from gaussdp._format import format_exact, format_upper

    console.print(
        f"{first_line}\n"
        f"clip_norm={format_exact(report.clip_norm)}: {report.n_clipped} rows clipped; mean row norm "
        f"{report.avg_norm_before:.4g} -> {report.avg_norm_after:.4g}\n"
        f"noise sigma={format_upper(report.sigma)} per coordinate ({report.noise})",
        soft_wrap=True,
    )
    console.print(
        f"true epsilon per individual at delta={format_exact(report.delta)}: "
        f"{format_upper(report.epsilon)} (add/remove one row); {format_upper(report.epsilon_replace)} "
        "(replace one row)",
        soft_wrap=True,
    )


def sanitize(
    in_path: str = typer.Argument(
        ...,
        help="Input: a .npy (2-D float32/float64, one row per individual) or a Parquet table "
        "(.parquet, a local path or an fsspec URL; with --column).",
    ),
    out_path: str = typer.Argument(
        ...,
        help="Output .npy or .parquet (written atomically; nothing on error); a directory for --engine ray.",
    ),
    epsilon: float = typer.Option(..., help="Per-individual epsilon of this release, > 0."),
    delta: float = typer.Option(..., help="Per-individual delta of this release, in (0, 1)."),
    clip_norm: float = typer.Option(..., help="L2 bound of each row (the sensitivity), > 0."),
    column: str | None = typer.Option(None, help="Parquet: the embedding column (list of floats)."),
    engine: Engine = typer.Option(Engine.local, help="Parquet: 'local' (one process) or 'ray'."),
    address: str | None = typer.Option(None, help="--engine ray: the cluster's address (default: auto)."),
    ledger: str | None = typer.Option(
        None, "--ledger", help="Charge this durable ledger (sqlite:///x.db, postgresql://...) first."
    ),
    session: str | None = typer.Option(None, "--session", help="--ledger: the principal charged."),
    budget_epsilon: float | None = typer.Option(
        None, help="--ledger: open --session with this budget epsilon (when not open yet)."
    ),
    budget_delta: float | None = typer.Option(None, help="--ledger: the budget delta to open with."),
    chunk_rows: int | None = typer.Option(
        None, help="Rows per chunk or batch (default: about 16 MiB of input)."
    ),
    noise: NoiseKind = typer.Option(NoiseKind.secure, help="'secure' (floating-point safe) or 'fast'."),
    seed: int | None = typer.Option(None, help=".npy only: reproducible noise, the output is NOT private."),
    workers: int | None = typer.Option(None, help="Threads clipping and noising chunks (default: up to 2)."),
    json_output: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Clip every row of IN_PATH to --clip-norm, add calibrated Gaussian noise, write OUT_PATH.

    Streams the file in chunks (memory bounded by the chunk, not the file) and prints the true
    epsilon of the release: per individual (one row), under add/remove of a row (sensitivity
    clip_norm) and under replacement of a row (sensitivity 2 * clip_norm). A Parquet table keeps its
    other columns; --engine ray runs the same release on a Ray cluster. With --ledger/--session the
    release is charged to the ledger before anything is written.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from gaussdp.cli._output import make_console
    from gaussdp.cli.tables import is_table, ledger_charge, sanitize_table
    from gaussdp.embeddings import sanitize_npy
    from gaussdp.errors import BudgetExhausted, PrivacyError

    console = make_console(stderr=False)
    err = make_console(stderr=True)
    table = is_table(in_path, column, engine.value)
    rows = None
    try:
        if table:
            import pyarrow.parquet as pq

            rows = pq.read_metadata(in_path).num_rows if os.path.isfile(in_path) else None
        else:
            import numpy as np

            if os.path.isfile(in_path):
                rows = int(np.load(in_path, mmap_mode="r", allow_pickle=False).shape[0])
    except Exception:  # the sanitize call reports the real problem below
        rows = None
    progress = Progress(
        TextColumn("[bold]sanitize"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("rows"),
        TimeRemainingColumn(),
        console=err,
        transient=True,
    )
    charge, opened = None, None
    try:
        charge, opened = ledger_charge(ledger, session, budget_epsilon, budget_delta)
        with progress:
            task = progress.add_task("sanitize", total=rows)
            if table:
                if seed is not None:
                    raise PrivacyError("--seed is for .npy inputs (table noise is always from OS entropy)")
                report: Any = sanitize_table(
                    in_path=in_path,
                    out_path=out_path,
                    column=column,
                    engine=engine.value,
                    address=address,
                    epsilon=epsilon,
                    delta=delta,
                    clip_norm=clip_norm,
                    noise=noise.value,
                    batch_rows=chunk_rows,
                    workers=workers,
                    charge=charge,
                    progress=lambda n: progress.advance(task, n),
                )
            else:
                report = sanitize_npy(
                    in_path,
                    out_path,
                    epsilon=epsilon,
                    delta=delta,
                    clip_norm=clip_norm,
                    chunk_rows=chunk_rows,
                    noise=noise.value,
                    seed=seed,
                    progress=lambda n: progress.advance(task, n),
                    workers=workers,
                    charge=charge,
                )
    except BudgetExhausted:
        raise  # exit 3, from the command guard
    except (PrivacyError, TypeError, OSError) as exc:
        err.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        err.print(f"nothing was written to {out_path}", soft_wrap=True)
        raise typer.Exit(2) from None
    finally:
        if opened is not None:
            opened.close()
    if table:
        _print_table_report(report, json_output, console)
        return
    if json_output:
        from gaussdp.cli._output import emit_json

        emit_json(
            {
                "out_path": str(out_path),
                "rows": report.rows,
                "cols": report.cols,
                "dtype": str(report.dtype),
                "clip_norm": report.clip_norm,
                "n_clipped": report.n_clipped,
                "avg_norm_before": report.avg_norm_before,
                "avg_norm_after": report.avg_norm_after,
                "sigma": report.sigma,
                "noise": report.noise,
                "delta": report.delta,
                "epsilon": report.epsilon,
                "epsilon_replace": report.epsilon_replace,
                "private": report.private,
                "charged": charge is not None,
            }
        )
    else:
        _print_sanitized(
            console, f"sanitized {report.rows} rows x {report.cols} ({report.dtype}) -> {out_path}", report
        )
    if charge is not None and not json_output:
        console.print(f"charged to session {session!r} of {ledger} before writing", soft_wrap=True)
    if not report.private:
        err.print("[yellow]warning:[/yellow] seeded noise: this output is NOT private")


def _print_table_report(report: Any, json_output: bool, console: Any) -> None:

    if json_output:
        from gaussdp.cli._output import emit_json

        emit_json(
            {
                "out_path": report.out_path,
                "engine": report.engine,
                "column": report.column,
                "rows": report.rows,
                "cols": report.cols,
                "blocks": report.blocks,
                "clip_norm": report.clip_norm,
                "n_clipped": report.n_clipped,
                "avg_norm_before": report.avg_norm_before,
                "avg_norm_after": report.avg_norm_after,
                "sigma": report.sigma,
                "noise": report.noise,
                "delta": report.delta,
                "epsilon": report.epsilon,
                "epsilon_replace": report.epsilon_replace,
                "charge": report.charge,
                "private": True,
            }
        )
        return
    where = f"{report.blocks} row group(s)"
    if report.engine == "ray":
        where = f"{report.blocks} parts + _manifest.json"
    _print_sanitized(
        console,
        f"sanitized {report.rows} rows x {report.cols} of column {report.column!r} ({report.engine}) -> "
        f"{report.out_path} ({where}; other columns unchanged)",
        report,
    )
    if report.charge is not None:
        console.print(
            f"charged to session {report.charge['principal']!r} before writing (charge id "
            f"{report.charge['charge_id']}); recorded in the output's metadata",
            soft_wrap=True,
        )


def demo(console: Any, out_dir: Path) -> None:
    """Core section of ``gaussdp demo``."""
    from gaussdp._format import format_exact, format_upper
    from gaussdp.calibration import classical_sigma, epsilon_for, sigma_for

    for eps in (0.5, 1.0, 4.0, 8.0):
        exact = sigma_for(epsilon=eps, delta=1e-5)
        classical = classical_sigma(epsilon=eps, delta=1e-5)
        console.print(
            f"epsilon={format_exact(eps):<4} delta=1e-5: analytic sigma={format_upper(exact, 5)}; classical "
            f"sigma={format_upper(classical, 5)} (its true epsilon is "
            f"{format_upper(epsilon_for(sigma=classical, delta=1e-5), 4)})"
        )
    _demo_release(console)


def _demo_release(console: Any) -> None:
    """Release a vector with the float-safe default, then audit it against the naive float path."""
    import warnings

    import numpy as np

    from gaussdp._format import format_lower, format_upper
    from gaussdp.audit import epsilon_lower_bound
    from gaussdp.errors import NotPrivateWarning, UnsafeInput
    from gaussdp.mechanism import GaussianMechanism

    mech = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0)
    x = np.array([3.0, 4.0, 0.0, 1.0], dtype=np.float32)
    y = mech.release(x)
    console.print(
        f"release of {x.tolist()} (norm {float(np.linalg.norm(x)):.2f}, clipped to 1): "
        f"[{', '.join(f'{v:.3f}' for v in y)}] ({y.dtype}); sigma={format_upper(mech.sigma, 5)}, true "
        f"epsilon at delta=1e-5: {format_upper(mech.epsilon(1e-5))} (noise: {mech.source.name}, "
        "float-safe grid)"
    )
    try:
        mech.release(np.array([np.nan, 1.0]))
    except UnsafeInput as exc:
        console.print(f"NaN input refused before any noise was drawn: {exc}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        seeded = GaussianMechanism(epsilon=1.0, delta=1e-5, seed=7)
    console.print(f"a seeded mechanism is reproducible and marked private={seeded.private}")

    n = 100_000
    a = mech.release_rows(np.ones((n, 1), np.float32))[:, 0]
    b = mech.release_rows(np.zeros((n, 1), np.float32))[:, 0]
    safe = epsilon_lower_bound(a, b, delta=1e-5, alpha=1e-6)
    rng = np.random.default_rng()
    sigma32 = np.float32(mech.sigma)
    naive = epsilon_lower_bound(
        np.float32(1.0) + sigma32 * rng.standard_normal(n, dtype=np.float32),
        sigma32 * rng.standard_normal(n, dtype=np.float32),
        delta=1e-5,
        alpha=1e-6,
    )
    console.print(
        f"audit ({n} releases of x=1 vs x'=0, claim epsilon=1): gaussdp's lower bound "
        f"{format_lower(safe.epsilon_lower_bound, 3)} <= 1; naive float32 x + sigma*Z: "
        f"{format_lower(naive.epsilon_lower_bound, 3)} (event: {naive.event}) -- the claim is false"
    )


def demo_sanitize(console: Any, out_dir: Path) -> None:
    """Demo section: sanitize a generated embeddings file with ``gaussdp sanitize``'s library call."""
    import numpy as np

    from gaussdp._format import format_upper
    from gaussdp.embeddings import sanitize_npy

    rng = np.random.default_rng()
    rows, dims = 20_000, 64
    raw = out_dir / "embeddings_raw.npy"
    out = out_dir / "embeddings_sanitized.npy"
    # Synthetic embeddings: a shared direction plus per-row variation, norms spread around 1 so
    # that some rows get clipped.
    center = rng.standard_normal(dims).astype(np.float32)
    center *= np.float32(0.6) / np.linalg.norm(center)
    x = center + rng.standard_normal((rows, dims), dtype=np.float32) * np.float32(0.1)
    np.save(raw, x)
    report = sanitize_npy(raw, out, epsilon=4.0, delta=1e-6, clip_norm=1.0, chunk_rows=4096)
    y = np.load(out)
    console.print(
        f"sanitized {rows} x {dims} float32 embeddings in chunks of {report.chunk_rows} rows: "
        f"{report.n_clipped} rows clipped to norm 1, noise sigma={format_upper(report.sigma, 5)}"
    )
    console.print(
        f"true epsilon per individual at delta=1e-6: {format_upper(report.epsilon, 5)} (add/remove one "
        f"row), {format_upper(report.epsilon_replace, 5)} (replace one row)"
    )
    err = float(np.linalg.norm(y.mean(0) - x.mean(0)))
    cos = float(y.mean(0) @ x.mean(0) / (np.linalg.norm(y.mean(0)) * np.linalg.norm(x.mean(0))))
    console.print(
        f"utility: the mean of the {rows} sanitized rows is {err:.3f} from the true mean (norm "
        f"{float(np.linalg.norm(x.mean(0))):.3f}; cosine {cos:.3f}), while each single row is "
        f"drowned in noise of norm about {report.sigma * dims**0.5:.1f}; wrote {out.name}"
    )
