"""The same release on Ray Data: every block of a ``ray.data.Dataset`` clipped and noised in a worker.

How a job runs (:func:`sanitize_dataset`):

1. On the driver: the parameters and the embedding column's type are checked, the mechanism is
   calibrated once, and the ledger is charged **once, for the whole release, before any output is
   written** (one Gaussian release per individual: each row is in exactly one block).
2. Ray Data executes the dataset (reading Parquet, any upstream transforms) and hands over its blocks
   in order; block ``i`` goes to a Ray task that clips and noises it with the same core functions as
   the single-process path (:func:`gaussdp.tables._columns.release_block`), drawing noise from a
   source keyed from OS entropy *in that task* (no seed is shared between blocks or attempts).
3. Exactly-once output: the task writes its block to ``_tmp/`` under a unique name, fsyncs it, and
   commits it with ``os.link`` to the deterministic name ``part-<i>.parquet``. A link never replaces
   an existing file, so the first committed copy of a block wins and a retried task's copy is
   discarded (deleted, never renamed into place). When every block is in, the driver checks that the
   output holds exactly ``part-0 .. part-(n-1)``, removes ``_tmp/``, and writes ``_manifest.json``
   (atomically) listing the committed blocks with the release record: the manifest's presence is
   what says the job finished.

What a retried task means for privacy. Ray re-runs a task whose worker died (``max_retries``).
The retry draws *fresh* noise for the same rows. Were both draws published, the rows would be
released twice: two independent Gaussian releases, which compose (about ``sqrt(2)`` times the
epsilon of one), while the ledger was charged for one. So at most one draw per block may land:
either the first attempt died before its link (its temporary file never becomes a part and is
deleted), or it linked and died after (the retry finds ``part-<i>`` taken and deletes its own copy).
In both cases the published output holds one noisy copy of each row, which is what was charged.
A temporary file is itself a noisy copy: ``_tmp/`` must stay private to the job (it is deleted at the
end, and on failure), and readers must take only the parts the manifest lists.

The output directory must be on a filesystem every worker and the driver share (a local disk for a
one-machine cluster, NFS or another POSIX mount for several): ``os.link`` is the atomic,
no-overwrite commit. Object stores have no such primitive; write there after the job.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from gaussdp.errors import InvalidParameter, UnsafeInput
from gaussdp.noise import SourceKind, noise_source
from gaussdp.tables._columns import check_embedding_field, release_block
from gaussdp.tables._release import TableRelease, check_positive_int
from gaussdp.tables.parquet import TableReport, fsync_path

__all__ = ["MANIFEST", "sanitize_dataset"]

MANIFEST = "_manifest.json"
_TMP = "_tmp"


def part_name(index: int) -> str:
    """The committed name of block ``index`` (deterministic: a retry of the block gets the same one)."""
    return f"part-{index:06d}.parquet"


@dataclass(frozen=True)
class _BlockJob:
    """What a worker needs for one block: the calibrated sigma (never recomputed), not the data."""

    out_dir: str
    column: str
    sigma: float
    clip_norm: float
    noise: str
    metadata: dict[bytes, bytes]


def _sanitize_block(
    block: Any,
    index: int,
    start: int | None,
    stop: int | None,
    job: _BlockJob,
    fault: Callable[[int, str], None] | None,
) -> dict[str, Any]:
    """One attempt at block ``index``: clip, noise, write under a temporary name, commit with a link."""
    from ray.data.block import BlockAccessor

    final = os.path.join(job.out_dir, part_name(index))
    table = BlockAccessor.for_block(block).to_arrow()
    if start is not None and stop is not None:
        table = table.slice(start, stop - start)
    source = noise_source(job.noise)  # type: ignore[arg-type]  # OS entropy, this attempt's own
    out, stats = release_block(
        table,
        column=job.column,
        sigma=job.sigma,
        clip_norm=job.clip_norm,
        source=source,
        where=f"block {index}",
    )
    result = {
        "index": index,
        "file": part_name(index),
        "rows": stats.rows,
        "n_clipped": stats.n_clipped,
        "norm_sum_before": stats.norm_sum_before,
        "norm_sum_after": stats.norm_sum_after,
        "committed_here": False,
    }
    if os.path.exists(final):  # an earlier attempt committed: this draw is discarded unwritten
        return result
    meta = dict(out.schema.metadata or {})
    meta.update(job.metadata)
    meta[b"gaussdp.block"] = str(index).encode()
    tmp = os.path.join(job.out_dir, _TMP, f"{part_name(index)}.{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            plain = [name for name in out.schema.names if name != job.column]  # noise never repeats
            pq.write_table(out.replace_schema_metadata(meta), f, use_dictionary=plain)
            f.flush()
            os.fsync(f.fileno())
        if fault is not None:
            fault(index, "written")
        try:
            os.link(tmp, final)  # atomic and never overwrites: the first committed copy wins
            result["committed_here"] = True
        except FileExistsError:
            pass
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # a discarded or committed draw: the temporary name never lands
    fsync_path(job.out_dir)
    if fault is not None:
        fault(index, "committed")
    return result


def _blocks(ds: Any) -> Any:
    """``(block_ref, start, stop)`` for every block of ``ds``, in the order Ray Data produces them."""
    for bundle in ds.iter_internal_ref_bundles():
        slices = getattr(bundle, "slices", None) or [None] * len(bundle.block_refs)
        for ref, cut in zip(bundle.block_refs, slices, strict=True):
            if cut is None:
                yield ref, None, None
            else:
                yield ref, int(cut.start_offset), int(cut.end_offset)


def _prepare_out_dir(out_dir: str) -> None:
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir) or os.listdir(out_dir):
            raise InvalidParameter(
                f"out_dir {out_dir!r} must not exist or be an empty directory (a job commits its "
                "blocks there by name)"
            )
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"the directory of out_dir {out_dir!r} does not exist")
    os.makedirs(os.path.join(out_dir, _TMP), exist_ok=True)


def sanitize_dataset(
    ds: Any,
    out_dir: str | os.PathLike[str],
    *,
    column: str,
    epsilon: float,
    delta: float,
    clip_norm: float,
    noise: SourceKind = "secure",
    charge: Callable[[Any], object] | None = None,
    max_in_flight: int | None = None,
    max_retries: int = 3,
    _fault: Callable[[int, str], None] | None = None,
) -> TableReport:
    """Clip and noise the embedding ``column`` of a ``ray.data.Dataset``; write one part per block.

    The guarantee is :func:`gaussdp.tables.sanitize_parquet`'s: each row (one individual's embedding)
    clipped to ``clip_norm`` and noised once with the sigma calibrated for ``(epsilon, delta)`` at
    sensitivity ``clip_norm`` (add/remove one row). ``charge`` is called once, with the release's
    event, before any task starts; a failure after it leaves no output (the parts written are
    removed) but the charge stands (fail closed: noise may have been drawn).

    Output: ``out_dir/part-<block>.parquet`` per block (other columns untouched, the release record in
    each part's metadata) and ``out_dir/_manifest.json``, written last, listing the committed parts.
    Retried tasks never leave a second copy of a block (see :mod:`gaussdp.tables._ray`).

    Args:
        ds: a ``ray.data.Dataset`` (e.g. ``ray.data.read_parquet(...)``); Ray must be initialised
            (``ray.init(address=...)``).
        out_dir: a new or empty directory on a filesystem the workers share.
        column, epsilon, delta, clip_norm, noise, charge: as for :func:`sanitize_parquet`.
        max_in_flight: blocks being sanitized at once (default: twice the cluster's CPUs); bounds
            the memory the job holds.
        max_retries: how often Ray re-runs a block whose worker died.

    Returns:
        A :class:`~gaussdp.tables.TableReport` with ``engine="ray"`` and ``blocks`` the parts
        committed.

    Raises:
        InvalidParameter, TypeError: bad parameters, a non-empty ``out_dir``.
        UnsafeInput: a missing or non-float column, ragged or null rows, NaN/Inf (named by block).
    """
    import ray

    rel = TableRelease.plan(column=column, epsilon=epsilon, delta=delta, clip_norm=clip_norm, noise=noise)
    if max_in_flight is not None:
        max_in_flight = check_positive_int("max_in_flight", max_in_flight)
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise InvalidParameter(f"max_retries must be an int >= 0, got max_retries={max_retries!r}")
    if not hasattr(ds, "iter_internal_ref_bundles"):
        raise TypeError(f"ds must be a ray.data.Dataset, got {type(ds).__name__}")
    out = os.path.abspath(os.fspath(out_dir))
    schema = ds.schema(fetch_if_missing=True)
    arrow_schema = getattr(schema, "base_schema", schema)
    if not isinstance(arrow_schema, pa.Schema):  # a pandas-backed dataset: its names and types
        arrow_schema = pa.schema(list(zip(schema.names, schema.types, strict=True)))
    check_embedding_field(arrow_schema, column, "the dataset")
    _prepare_out_dir(out)

    if max_in_flight is None:
        max_in_flight = max(1, 2 * int(ray.cluster_resources().get("CPU", 1)))
    task = ray.remote(num_cpus=1, max_retries=max_retries, retry_exceptions=False)(_sanitize_block)
    results: list[dict[str, Any]] = []
    try:
        rel.charge_with(charge)  # one charge, before any output is written
        job = _BlockJob(
            out_dir=out,
            column=column,
            sigma=rel.sigma,
            clip_norm=rel.clip_norm,
            noise=noise,
            metadata=rel.metadata(engine="ray"),
        )
        job_ref = ray.put(job)
        pending: list[Any] = []
        n = 0
        for ref, start, stop in _blocks(ds):
            if len(pending) >= max_in_flight:
                done, pending = ray.wait(pending, num_returns=1)
                results.extend(ray.get(done))
            pending.append(task.remote(ref, n, start, stop, job_ref, _fault))
            n += 1
        results.extend(ray.get(pending))
        results.sort(key=lambda r: r["index"])
        _check_committed(out, n, results)
        shutil.rmtree(os.path.join(out, _TMP))
        rows = sum(r["rows"] for r in results)
        if rows == 0:
            raise UnsafeInput("the dataset has no rows")
        blocks = [{"index": r["index"], "file": r["file"], "rows": r["rows"]} for r in results]
        record = rel.record(rows=rows, engine="ray", blocks=blocks)
        _write_manifest(out, record)
    except BaseException:
        for name in os.listdir(out) if os.path.isdir(out) else []:
            path = os.path.join(out, name)
            with contextlib.suppress(OSError):
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
        raise
    cols = 0
    first = next((b["file"] for b in blocks if b["rows"]), None)
    if first is not None:
        t = pq.read_schema(os.path.join(out, first)).field(column).type
        cols = (
            t.list_size
            if pa.types.is_fixed_size_list(t)
            else len(pq.read_table(os.path.join(out, first), columns=[column]).column(column)[0])
        )
    return TableReport(
        out_path=out,
        column=column,
        rows=rows,
        cols=cols,
        clip_norm=rel.clip_norm,
        sigma=rel.sigma,
        delta=rel.delta,
        epsilon=rel.epsilon_add_remove,
        epsilon_replace=rel.epsilon_replace,
        n_clipped=sum(r["n_clipped"] for r in results),
        avg_norm_before=sum(r["norm_sum_before"] for r in results) / rows,
        avg_norm_after=sum(r["norm_sum_after"] for r in results) / rows,
        noise=noise,
        blocks=len(blocks),
        charge=rel.charge,
        engine="ray",
        record=record,
    )


def _check_committed(out: str, n: int, results: list[dict[str, Any]]) -> None:
    """Every block 0..n-1 committed exactly once, and nothing else in the output (fail closed)."""
    expected = {part_name(i) for i in range(n)}
    present = {name for name in os.listdir(out) if name not in (_TMP, MANIFEST)}
    if [r["index"] for r in results] != list(range(n)):
        raise RuntimeError(f"block results do not cover blocks 0..{n - 1} once each")
    if present != expected:
        raise RuntimeError(
            f"output {out!r} does not hold exactly one part per block: missing "
            f"{sorted(expected - present)[:5]}, unexpected {sorted(present - expected)[:5]}"
        )
    for r in results:  # the committed copy holds the block's rows (the first copy wins)
        rows = pq.read_metadata(os.path.join(out, r["file"])).num_rows
        if rows != r["rows"]:
            raise RuntimeError(f"part {r['file']} holds {rows} rows, block {r['index']} has {r['rows']}")


def _write_manifest(out: str, record: dict[str, Any]) -> None:
    tmp = os.path.join(out, f".{MANIFEST}.{uuid.uuid4().hex}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out, MANIFEST))
    fsync_path(out)


def read_manifest(out_dir: str) -> dict[str, Any]:
    """The manifest of a finished job (its release record and committed blocks)."""
    with open(os.path.join(out_dir, MANIFEST), encoding="utf-8") as f:
        return dict(json.load(f))
