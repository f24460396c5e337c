"""Sanitize an embedding column of a Parquet table in one process, streamed by row group.

The public entry point is :func:`gaussdp.tables.sanitize_parquet`; see :mod:`gaussdp.tables` for what
the guarantee covers.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from gaussdp._npy_stream import _WorkerSources
from gaussdp.errors import InvalidParameter, UnsafeInput
from gaussdp.noise import SourceKind, noise_source
from gaussdp.tables._columns import BlockStats, check_embedding_field, release_block
from gaussdp.tables._release import TableRelease, check_positive_int

__all__ = ["TableReport", "sanitize_parquet"]

# Target size of one batch of embeddings read at a time when the caller does not choose batch_rows.
_BATCH_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class TableReport:
    """What a table job released (single process or Ray).

    ``epsilon`` is the true epsilon per individual at ``delta`` under add/remove of one row
    (sensitivity ``clip_norm``), ``epsilon_replace`` under replacement of one row (``2 * clip_norm``);
    ``charge`` the ledger charge (principal, charge_id) made before the output was committed, if any.
    ``blocks`` is the number of output blocks (row groups written, or committed Ray blocks).
    """

    out_path: str
    column: str
    rows: int
    cols: int
    clip_norm: float
    sigma: float
    delta: float
    epsilon: float
    epsilon_replace: float
    n_clipped: int
    avg_norm_before: float
    avg_norm_after: float
    noise: str
    blocks: int
    charge: dict[str, Any] | None
    engine: str
    record: dict[str, Any]


def _fs(path: str | os.PathLike[str]) -> tuple[Any, str, bool]:
    """``(filesystem, path, is_local)`` for a local path or an fsspec URL."""
    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    text = os.fspath(path)
    if "://" not in text:
        return LocalFileSystem(), os.path.abspath(text), True
    fs, inner = fsspec.core.url_to_fs(text)
    return fs, inner, isinstance(fs, LocalFileSystem)


def _batch_rows(schema: pa.Schema, column: str) -> int:
    t = schema.field(column).type
    dims = t.list_size if pa.types.is_fixed_size_list(t) else 768
    return max(1, _BATCH_BYTES // (dims * t.value_type.bit_width // 8))


def _batches(pf: pq.ParquetFile, batch_rows: int) -> Iterator[pa.RecordBatch]:
    """The file's rows in batches, one row group at a time.

    ``iter_batches`` over the whole file reads ahead across row groups (Arrow measured 967 MB of
    buffers for a 920 MB file); asked for one row group at a time it holds one (277 MB for 200 MB
    row groups), so memory is bounded by the largest row group, not by the file.
    """
    for group in range(pf.num_row_groups):
        yield from pf.iter_batches(batch_size=batch_rows, row_groups=[group], use_threads=False)


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory: so that a rename or a link in it is durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sanitize_parquet(
    in_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    column: str,
    epsilon: float,
    delta: float,
    clip_norm: float,
    noise: SourceKind = "secure",
    batch_rows: int | None = None,
    charge: Callable[[Any], object] | None = None,
    progress: Callable[[int], None] | None = None,
    workers: int | None = None,
) -> TableReport:
    """Clip and noise the embedding ``column`` of a Parquet file row by row; copy the other columns.

    Every row is one individual's embedding: it is clipped to L2 norm ``clip_norm`` and
    ``N(0, sigma^2)`` noise is added to each coordinate, with ``sigma`` calibrated exactly for
    ``(epsilon, delta)`` at sensitivity ``clip_norm`` (add/remove one row). The column may be a
    fixed-size list or a list of float32/float64 and keeps its type; the other columns are written
    unchanged. The input is read ``batch_rows`` rows at a time (``ParquetFile.iter_batches``, one row
    group at a time), so memory is bounded by a row group and a batch, not by the file.

    Output goes to a temporary file next to ``out_path``; once every row was released, ``charge`` is
    called with the release's event (before anything is visible), the release record (mechanism,
    sigma, clip norm, neighbouring relation, epsilon/delta, the charge) is added to the file's
    metadata under ``gaussdp.release``, and the file is renamed over ``out_path`` (atomically for a
    local path; with the filesystem's move for an fsspec URL). On any error nothing is written and
    nothing is charged.

    Args:
        in_path, out_path: local paths or fsspec URLs (``s3://...``, ``memory://...``).
        column: the embedding column.
        epsilon, delta: the per-individual guarantee of this release.
        clip_norm: L2 bound of each row (the sensitivity).
        noise: ``"secure"`` (default, floating-point safe) or ``"fast"``; keyed from OS entropy.
        batch_rows: rows per batch (default: about 16 MiB of embeddings).
        charge: called with the event before the output is committed, e.g.
            ``charge=lambda ev: ledger.charge("dataset-42", ev)``; if it raises
            (:class:`~gaussdp.errors.BudgetExhausted`) nothing is written.
        progress: called with the number of rows finished after each batch.
        workers: threads clipping and noising batches (default: up to 2), each with its own noise
            stream keyed from OS entropy; at most ``workers + 1`` batches are in memory at a time.

    Returns:
        A :class:`TableReport` (``engine="local"``).

    Raises:
        InvalidParameter, TypeError: bad parameters (checked before any file is touched).
        UnsafeInput: not a Parquet file, a missing or non-float column, ragged or null rows, NaN/Inf.
        FileNotFoundError: ``in_path`` does not exist.
    """
    rel = TableRelease.plan(column=column, epsilon=epsilon, delta=delta, clip_norm=clip_norm, noise=noise)
    if batch_rows is not None:
        batch_rows = check_positive_int("batch_rows", batch_rows)
    workers = min(2, os.cpu_count() or 1) if workers is None else check_positive_int("workers", workers)
    src_fs, src, src_local = _fs(in_path)
    dst_fs, dst, dst_local = _fs(out_path)
    if not src_fs.isfile(src):
        raise FileNotFoundError(f"in_path {os.fspath(in_path)!r} does not exist or is not a file")
    if dst_local and not os.path.isdir(os.path.dirname(dst)):
        raise FileNotFoundError(f"the directory of out_path {os.fspath(out_path)!r} does not exist")
    if type(src_fs) is type(dst_fs) and src == dst:
        raise InvalidParameter("out_path must differ from in_path (the raw file would be overwritten)")

    # a local file is read by Arrow's own I/O; an fsspec URL through the filesystem's file object
    with contextlib.nullcontext(src) if src_local else src_fs.open(src, "rb") as raw:
        try:
            pf = pq.ParquetFile(raw)
        except (pa.ArrowInvalid, OSError) as exc:
            raise UnsafeInput(
                f"in_path {os.fspath(in_path)!r} is not a readable Parquet file: {exc}"
            ) from None
        where = f"in_path {os.fspath(in_path)!r}"
        schema = pf.schema_arrow
        check_embedding_field(schema, column, where)
        if batch_rows is None:
            batch_rows = _batch_rows(schema, column)
        tmp = f"{dst}.{uuid.uuid4().hex}.partial"
        if dst_local:
            tmp = os.path.join(os.path.dirname(dst), "." + os.path.basename(tmp))
        sources = _WorkerSources(noise, first=noise_source(noise))  # OS entropy, one stream per thread
        rows = n_clipped = groups = 0
        cols = 0
        sum_before = sum_after = 0.0

        def work(batch: pa.RecordBatch, start: int) -> tuple[pa.Table, BlockStats]:
            """Clip and noise one batch: runs in a worker thread (pyarrow and the noise release the GIL)."""
            here = f"{where}, rows {start}..{start + batch.num_rows - 1}"
            return release_block(
                batch,
                column=column,
                sigma=rel.sigma,
                clip_norm=rel.clip_norm,
                source=sources.get(),
                where=here,
            )

        # noised floats never repeat: dictionary-encoding the embedding column would be wasted work
        plain = [name for name in schema.names if name != column]
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gaussdp-tables")
        try:
            with contextlib.nullcontext(tmp) if dst_local else dst_fs.open(tmp, "wb") as sink:
                writer = pq.ParquetWriter(sink, schema, use_dictionary=plain)
                try:
                    # at most workers + 1 batches in flight, written in row order
                    pending: deque[Future[tuple[pa.Table, BlockStats]]] = deque()
                    start = 0
                    batches = _batches(pf, batch_rows)
                    while True:
                        while len(pending) <= workers:
                            batch = next(batches, None)
                            if batch is None:
                                break
                            pending.append(pool.submit(work, batch, start))
                            start += batch.num_rows
                        if not pending:
                            break
                        out, stats = pending.popleft().result()
                        if not cols and stats.rows:
                            cols = len(out.column(column)[0])
                        writer.write_table(out)
                        del out
                        rows += stats.rows
                        n_clipped += stats.n_clipped
                        sum_before += stats.norm_sum_before
                        sum_after += stats.norm_sum_after
                        groups += 1
                        if progress is not None:
                            progress(stats.rows)
                    if rows == 0:
                        raise UnsafeInput(f"{where} has no rows")
                    rel.charge_with(charge)  # charge before release: the rename below is the release
                    writer.add_key_value_metadata(rel.metadata(rows=rows, engine="local"))
                finally:
                    writer.close()
            if dst_local:
                fsync_path(tmp)
            if dst_local:
                os.replace(tmp, dst)
            else:
                dst_fs.mv(tmp, dst)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            with contextlib.suppress(OSError, FileNotFoundError):
                dst_fs.rm(tmp)
            raise
        finally:
            pool.shutdown(wait=True)
    return TableReport(
        out_path=os.fspath(out_path),
        column=column,
        rows=rows,
        cols=cols,
        clip_norm=rel.clip_norm,
        sigma=rel.sigma,
        delta=rel.delta,
        epsilon=rel.epsilon_add_remove,
        epsilon_replace=rel.epsilon_replace,
        n_clipped=n_clipped,
        avg_norm_before=sum_before / rows,
        avg_norm_after=sum_after / rows,
        noise=noise,
        blocks=groups,
        charge=rel.charge,
        engine="local",
        record=rel.record(rows=rows, engine="local"),
    )
