"""``release_block``: any embedding column type, any slice of a block, comes back with its rows in place."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pa = pytest.importorskip("pyarrow")

from gaussdp.noise import noise_source  # noqa: E402
from gaussdp.tables._columns import release_block  # noqa: E402

TYPES = {
    "fixed32": lambda d: pa.list_(pa.float32(), d),
    "fixed64": lambda d: pa.list_(pa.float64(), d),
    "list32": lambda d: pa.list_(pa.float32()),
    "large64": lambda d: pa.large_list(pa.float64()),
}


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 60),
    dims=st.integers(1, 9),
    kind=st.sampled_from(sorted(TYPES)),
    cut=st.tuples(st.integers(0, 20), st.integers(0, 20)),
    scale=st.floats(0.01, 10.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_rows_stay_in_place_clipped_and_typed(rows, dims, kind, cut, scale, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, dims)) * scale
    t = TYPES[kind](dims)
    x = x.astype(t.value_type.to_pandas_dtype())
    table = pa.table({"k": np.arange(rows), "e": pa.array(list(x), type=t)})
    lo, hi = min(cut[0], rows - 1), max(min(rows, rows - cut[1]), min(cut[0], rows - 1) + 1)
    block = table.slice(lo, hi - lo)  # a slice: the list array has an offset
    sigma, clip = 1e-3, 1.0
    src = noise_source()
    out, stats = release_block(block, column="e", sigma=sigma, clip_norm=clip, source=src, where="t")
    assert out.schema.field("e").type == t and out.column("k").equals(block.column("k"))
    y = np.asarray(out.column("e").combine_chunks().flatten().to_numpy()).reshape(hi - lo, dims)
    xs = x[lo:hi].astype(np.float64)
    norms = np.linalg.norm(xs, axis=1)
    clipped = xs * np.minimum(1.0, clip / norms)[:, None]
    # each row is its own clipped row plus noise of sd 1e-3: far below the distance between rows
    assert np.abs(y - clipped).max() < 1e-3 * 8 + 1e-5
    assert stats.rows == hi - lo and stats.n_clipped == int((norms > clip).sum())
