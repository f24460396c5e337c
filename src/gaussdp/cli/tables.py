"""``gaussdp sanitize`` for tables (Parquet, in one process or on Ray) and the CLI's ledger charge.

Called by :func:`gaussdp.cli.core.sanitize`; kept apart so that the ``.npy`` command stays small and
pyarrow/Ray are imported only when a table is sanitized.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

TABLE_SUFFIXES = (".parquet", ".pq")


def is_table(in_path: str, column: str | None, engine: str) -> bool:
    """A table job: a Parquet input (by suffix or a directory), ``--column``, or ``--engine ray``."""
    text = in_path.rstrip("/")
    return (
        column is not None
        or engine != "local"
        or text.lower().endswith(TABLE_SUFFIXES)
        or ("://" not in text and os.path.isdir(text))
    )


def ledger_charge(
    ledger_url: str | None,
    session: str | None,
    budget_epsilon: float | None,
    budget_delta: float | None,
) -> tuple[Callable[[Any], object] | None, Any]:
    """``(charge, ledger)`` for ``--ledger URL --session ID``: ``charge(event)`` charges the session.

    With ``--budget-epsilon/--budget-delta`` the session is opened with that budget (a no-op when it
    is already open with it; a different budget is refused: a budget never grows); without them it
    must already be open (by the service or an earlier command).
    """
    from gaussdp.errors import InvalidParameter

    if ledger_url is None and session is None:
        if budget_epsilon is not None or budget_delta is not None:
            raise InvalidParameter("--budget-epsilon/--budget-delta need --ledger and --session")
        return None, None
    if ledger_url is None or session is None:
        raise InvalidParameter("--ledger and --session go together (the ledger URL and the session charged)")
    if (budget_epsilon is None) != (budget_delta is None):
        raise InvalidParameter("--budget-epsilon and --budget-delta go together")
    from gaussdp.budget import Budget, Ledger, UnknownPrincipal

    ledger = Ledger(ledger_url)
    try:
        if budget_epsilon is not None and budget_delta is not None:
            ledger.open(session, Budget(epsilon=budget_epsilon, delta=budget_delta))
        else:
            ledger.budget(session)  # an unknown session is refused before any work, not after it
    except UnknownPrincipal:
        ledger.close()
        raise InvalidParameter(
            f"--session {session!r} was never opened on {ledger_url}: open it with --budget-epsilon and "
            "--budget-delta (or through the service)"
        ) from None
    except BaseException:
        ledger.close()
        raise
    return (lambda event: ledger.charge(session, event)), ledger


def sanitize_table(
    *,
    in_path: str,
    out_path: str,
    column: str | None,
    engine: str,
    address: str | None,
    epsilon: float,
    delta: float,
    clip_norm: float,
    noise: str,
    batch_rows: int | None,
    workers: int | None,
    charge: Callable[[Any], object] | None,
    progress: Callable[[int], None] | None,
) -> Any:
    """Run the table job the options describe; return its :class:`gaussdp.tables.TableReport`."""
    from gaussdp._extras import require_extra
    from gaussdp.errors import InvalidParameter

    if column is None:
        raise InvalidParameter(
            f"--column is required for a table input ({in_path!r}): name the embedding column"
        )
    require_extra("data", feature="gaussdp sanitize on Parquet")
    from gaussdp.tables import sanitize_dataset, sanitize_parquet

    if engine == "local":
        if address is not None:
            raise InvalidParameter("--address is for --engine ray")
        return sanitize_parquet(
            in_path,
            out_path,
            column=column,
            epsilon=epsilon,
            delta=delta,
            clip_norm=clip_norm,
            noise=noise,  # type: ignore[arg-type]
            batch_rows=batch_rows,
            workers=workers,
            charge=charge,
            progress=progress,
        )
    if workers is not None:
        raise InvalidParameter("--workers is for one process: on Ray, the cluster's CPUs are the workers")
    require_extra("ray", feature="gaussdp sanitize --engine ray")
    if "://" not in in_path:  # the workers' working directory is not ours: an absolute path
        in_path = os.path.abspath(in_path)
        if not os.path.exists(in_path):
            raise FileNotFoundError(f"in_path {in_path!r} does not exist")
    import ray
    import ray.data

    where = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=where, log_to_driver=False)
    except ConnectionError as exc:
        raise InvalidParameter(f"--address {where!r}: no Ray cluster answers there ({exc})") from None
    try:
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ds = ray.data.read_parquet(in_path, override_num_blocks=_num_blocks(in_path, ray))
        return sanitize_dataset(
            ds,
            out_path,
            column=column,
            epsilon=epsilon,
            delta=delta,
            clip_norm=clip_norm,
            noise=noise,
            charge=charge,
        )
    finally:
        ray.shutdown()


# Target bytes of one Ray block. Ray Data's default splits a read into at least 200 blocks (4.5 MB
# each for a 920 MB file), and a task per tiny block cost 2.3x the single-process time in the
# benchmark; 64 MiB blocks cost 1.3x (one CPU). A block's task holds about 5 copies of it.
_BLOCK_BYTES = 64 * 1024 * 1024


def _num_blocks(in_path: str, ray: Any) -> int:
    """Blocks of about 64 MiB of input, at least two per CPU of the cluster."""
    import math

    import fsspec

    fs, path = fsspec.core.url_to_fs(in_path)
    size = int(fs.du(path)) if fs.isdir(path) else int(fs.size(path))
    cpus = int(ray.cluster_resources().get("CPU", 1))
    return max(2 * cpus, math.ceil(size / _BLOCK_BYTES))
