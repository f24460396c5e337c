"""Embedding tables beyond ``.npy``: Parquet/Arrow in and out, and the same release on Ray Data.

The flow is the library's: **clip each row of the embedding column to L2 norm ``C``, charge the
release, add Gaussian noise calibrated to ``(epsilon, delta)`` at sensitivity ``C``, release**, with
the other columns carried through untouched. Every block, in one process or in a Ray worker, is
clipped by :func:`gaussdp.clipping.clip_rows` and noised by the core's row path with the sigma the
driver calibrated once (:class:`gaussdp.mechanism.GaussianMechanism`), as
:func:`gaussdp.embeddings.sanitize_npy` does.

What the guarantee covers: each row is one individual's embedding, released once. Under add/remove
of one row (an absent row counting as the zero vector, the number of rows public) the release is
``(epsilon, delta)``-DP per individual; under replacement of one row the reported
``epsilon_replace`` (sensitivity ``2C``) applies. Releasing the same individuals again composes:
charge each release to a :class:`gaussdp.budget.Ledger` (``charge=``).

* :func:`sanitize_parquet`: one process, streamed by row group; local paths and fsspec URLs.
* :func:`sanitize_dataset`: a ``ray.data.Dataset`` on a Ray cluster; one charge for the whole
  release before any output is written; exactly-once output (see :mod:`gaussdp.tables._ray`).

Needs the ``data`` extra (pyarrow, fsspec); :func:`sanitize_dataset` also the ``ray`` extra.
"""

from __future__ import annotations

import os
from typing import Any

from gaussdp._extras import require_extra

require_extra("data", feature="gaussdp.tables")

from gaussdp.tables._release import METADATA_KEY  # noqa: E402
from gaussdp.tables.parquet import TableReport, sanitize_parquet  # noqa: E402

__all__ = ["METADATA_KEY", "TableReport", "read_release", "sanitize_dataset", "sanitize_parquet"]


def sanitize_dataset(*args: Any, **kwargs: Any) -> TableReport:
    """Sanitize a ``ray.data.Dataset`` on a Ray cluster: see :func:`gaussdp.tables._ray.sanitize_dataset`."""
    require_extra("ray", feature="gaussdp.tables.sanitize_dataset")
    from gaussdp.tables._ray import sanitize_dataset as run

    return run(*args, **kwargs)


def read_release(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The release record of a sanitized output: a Parquet file's metadata, or a Ray job's manifest.

    For a file, the record is the ``gaussdp.release`` entry of its key-value metadata
    (``pyarrow.parquet.read_metadata(path).metadata``).

    Raises:
        UnsafeInput: the output carries no gaussdp release record.
    """
    import json

    import pyarrow.parquet as pq

    from gaussdp.errors import UnsafeInput

    path = os.fspath(path)
    if os.path.isdir(path):
        manifest = os.path.join(path, "_manifest.json")
        if not os.path.isfile(manifest):
            raise UnsafeInput(f"{path!r} has no _manifest.json: not a committed gaussdp release")
        with open(manifest, encoding="utf-8") as f:
            return dict(json.load(f))
    # the file's key-value metadata (written at commit, with the charge), not the Arrow schema's
    meta = pq.read_metadata(path).metadata or {}
    if METADATA_KEY not in meta:
        raise UnsafeInput(f"{path!r} carries no {METADATA_KEY.decode()} record: not a gaussdp release")
    return dict(json.loads(meta[METADATA_KEY]))
