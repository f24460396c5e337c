"""One block of a table through clip -> noise: the embedding column in, the same column type out.

Every engine (the single-process Parquet streamer, each Ray task) releases a block with
:func:`release_block`, which clips with :func:`gaussdp.clipping.clip_rows` and noises with
:func:`gaussdp._rows.noise_rows` (the core's row path, as the ``.npy`` streamer does): nothing about
the clip or the sigma is computed here. The other columns are carried through untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from gaussdp._rows import noise_rows
from gaussdp.clipping import clip_rows
from gaussdp.errors import UnsafeInput
from gaussdp.noise import NoiseSource

__all__ = ["BlockStats", "check_embedding_field", "embedding_matrix", "release_block"]

_FLOATS = (pa.float32(), pa.float64())


@dataclass(frozen=True)
class BlockStats:
    """What clipping saw in one block (norms in float64): rows, rows clipped, norm sums."""

    rows: int
    n_clipped: int
    norm_sum_before: float
    norm_sum_after: float


def _is_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t))


def check_embedding_field(schema: pa.Schema, column: str, where: str) -> pa.DataType:
    """The embedding column's type, or :class:`UnsafeInput` naming the column and what is wrong.

    Accepted: a fixed-size list, list or large list of float32 or float64.
    """
    if not isinstance(column, str) or not column:
        raise TypeError(f"column must be a non-empty str, got column={column!r}")
    if column not in schema.names:
        raise UnsafeInput(f"{where} has no column {column!r}; its columns are {schema.names}")
    t = schema.field(column).type
    if not _is_list(t):
        raise UnsafeInput(
            f"column {column!r} of {where} must hold one embedding per row (a list or fixed-size list "
            f"of float32/float64), got type {t}"
        )
    if t.value_type not in _FLOATS:
        raise UnsafeInput(
            f"column {column!r} of {where} must hold float32 or float64 values (non-numeric or "
            f"integer data is refused), got type {t}"
        )
    return t


def embedding_matrix(batch: pa.RecordBatch | pa.Table, column: str, where: str) -> np.ndarray:
    """The embedding column of ``batch`` as a 2-D float array (rows x dims), validated.

    Raises:
        UnsafeInput: missing or non-float column, a null row or value, ragged rows (rows of different
            lengths), empty rows. NaN/Inf are refused by the clipping that follows.
    """
    t = check_embedding_field(batch.schema, column, where)
    col = batch.column(column)
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if arr.null_count:
        first = int(pc.index(pc.is_null(arr), True).as_py())
        raise UnsafeInput(f"column {column!r} of {where}: row {first} is null (no embedding)")
    rows = len(arr)
    if pa.types.is_fixed_size_list(t):
        dims = t.list_size
    else:
        lengths = pc.list_value_length(arr).to_numpy(zero_copy_only=False)
        dims = int(lengths[0]) if rows else 0
        ragged = np.flatnonzero(lengths != dims)
        if ragged.size:
            i = int(ragged[0])
            raise UnsafeInput(
                f"column {column!r} of {where} has ragged rows: row {i} has {int(lengths[i])} values, "
                f"row 0 has {dims} (every embedding must have the same length)"
            )
    if rows and dims == 0:
        raise UnsafeInput(f"column {column!r} of {where} holds empty embeddings (0 values per row)")
    values = arr.flatten()  # respects the array's offset (a slice of a block)
    if values.null_count:
        first = int(pc.index(pc.is_null(values), True).as_py())
        raise UnsafeInput(f"column {column!r} of {where}: row {first // dims} has a null value")
    flat = values.to_numpy(zero_copy_only=False)
    return flat.reshape(rows, dims)


def _embedding_array(released: np.ndarray, t: pa.DataType) -> pa.Array:
    rows, dims = released.shape
    values = pa.array(released.reshape(-1), type=t.value_type)
    if pa.types.is_fixed_size_list(t):
        out: pa.Array = pa.FixedSizeListArray.from_arrays(values, dims)
    else:
        offsets = pa.array(np.arange(rows + 1, dtype=np.int64) * dims)
        if pa.types.is_list(t):
            offsets = offsets.cast(pa.int32())
            out = pa.ListArray.from_arrays(offsets, values)
        else:
            out = pa.LargeListArray.from_arrays(offsets, values)
    return out.cast(t) if out.type != t else out  # keeps the item field's name


def release_block(
    batch: pa.RecordBatch | pa.Table,
    *,
    column: str,
    sigma: float,
    clip_norm: float,
    source: NoiseSource,
    where: str,
) -> tuple[pa.Table, BlockStats]:
    """Clip every row of ``column`` to ``clip_norm`` and add ``N(0, sigma^2)``: one release per row.

    ``sigma`` is the calibrated mechanism's (computed once, by the caller); the noise is drawn from
    ``source``. Returns a :class:`pyarrow.Table`: the other columns untouched, in the same order; the
    embedding column keeps its Arrow type (float32 stays float32).

    Raises:
        UnsafeInput: the column is missing, not float lists, ragged, null, NaN/Inf (nothing released).
    """
    if isinstance(batch, pa.RecordBatch):
        batch = pa.Table.from_batches([batch])
    x = embedding_matrix(batch, column, where)
    t = batch.schema.field(column).type
    if x.shape[0] == 0:
        return batch, BlockStats(0, 0, 0.0, 0.0)
    try:
        clipped, norms = clip_rows(x, clip_norm)
    except UnsafeInput as exc:
        raise UnsafeInput(f"column {column!r} of {where}: {exc}") from None
    del x
    norms = np.asarray(norms, dtype=np.float64)
    released = noise_rows(clipped, sigma=sigma, clip_norm=clip_norm, source=source, seed=None, first_row=0)
    del clipped
    idx = batch.schema.get_field_index(column)
    out = batch.set_column(idx, batch.schema.field(column), _embedding_array(np.asarray(released), t))
    stats = BlockStats(
        rows=int(norms.size),
        n_clipped=int(np.count_nonzero(norms > clip_norm)),
        norm_sum_before=float(norms.sum()),
        norm_sum_after=float(np.minimum(norms, clip_norm).sum()),
    )
    return out, stats
