"""Stream a ``.npy`` matrix of embeddings through clip -> noise -> atomic write, in chunks.

The public entry point is :func:`gaussdp.embeddings.sanitize_npy` (re-exported there); see
:mod:`gaussdp.embeddings` for what the guarantee covers.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import numbers
import os
import tempfile
import threading
import warnings
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gaussdp import mechanism as _mechanism
from gaussdp._neighbouring import Neighbouring
from gaussdp._rows import SEED_BLOCK_ROWS, check_seed, noise_rows, release_epsilon
from gaussdp._validate import check_choice, check_delta, check_epsilon, check_positive
from gaussdp.clipping import clip_rows
from gaussdp.errors import InvalidParameter, NotPrivateWarning, UnsafeInput
from gaussdp.noise import NoiseSource, SourceKind, noise_source

__all__ = ["SanitizeReport", "sanitize_npy"]

# Target size of one chunk of input rows when the caller does not choose ``chunk_rows``.
_CHUNK_BYTES = 16 * 1024 * 1024
_SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class SanitizeReport:
    """What :func:`sanitize_npy` released.

    ``epsilon`` is the true epsilon of the release at ``delta`` per individual (add/remove one
    row, sensitivity ``clip_norm``); ``epsilon_replace`` the same for replacement of one row
    (sensitivity ``2 * clip_norm``). ``private`` is False when a seed was given.
    """

    rows: int
    cols: int
    dtype: str
    clip_norm: float
    sigma: float
    delta: float
    epsilon: float
    epsilon_replace: float
    n_clipped: int
    avg_norm_before: float
    avg_norm_after: float
    chunk_rows: int
    noise: str
    private: bool


def _sniff_not_npy(path: Path) -> None:
    """Refuse a file that is not a .npy at all (a CSV named .npy) with what it looks like."""
    with open(path, "rb") as f:
        head = f.read(256)
    if head.startswith(b"\x93NUMPY"):
        return
    if head.startswith(b"PAR1"):
        raise UnsafeInput(
            f"in_path {str(path)!r} is a Parquet file, not a .npy: name the embedding column with --column "
            "(gaussdp.tables.sanitize_parquet)"
        )
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    if text and (text.isprintable() or any(c in text for c in ",;\t\n")):
        first = text.splitlines()[0][:60] if text.splitlines() else text[:60]
        raise UnsafeInput(
            f"in_path {str(path)!r} is text (it starts {first!r}), not a .npy array: a CSV? Convert it "
            "first, e.g. numpy.save('x.npy', numpy.loadtxt('x.csv', delimiter=',', dtype='float32'))"
        )
    raise UnsafeInput(f"in_path {str(path)!r} is not a .npy file (no NumPy magic string)")


def _open_npy_matrix(path: Path) -> np.memmap:
    _sniff_not_npy(path)
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise
    except (ValueError, OSError, EOFError) as exc:
        raise UnsafeInput(f"in_path {str(path)!r} is not a readable .npy array: {exc}") from None
    if not isinstance(arr, np.ndarray):
        raise UnsafeInput(f"in_path {str(path)!r} is not a .npy array (an .npz archive?)")
    if arr.dtype.kind != "f" or arr.dtype.newbyteorder("=") not in _SUPPORTED_DTYPES:
        raise UnsafeInput(
            f"in_path {str(path)!r} must hold a 2-D float32 or float64 array, got dtype {arr.dtype}"
        )
    if arr.ndim != 2:
        raise UnsafeInput(f"in_path {str(path)!r} must hold a 2-D array (rows x dims), got shape {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise UnsafeInput(f"in_path {str(path)!r} holds an empty array of shape {arr.shape}")
    return arr  # type: ignore[return-value]


class _WorkerSources:
    """One noise source per worker thread: sources are not thread-safe, and independent
    OS-entropy-keyed streams per thread give the same guarantee as one stream."""

    def __init__(self, kind: str, first: NoiseSource) -> None:
        self._kind = kind
        self._local = threading.local()
        self._first: NoiseSource | None = first
        self._lock = threading.Lock()

    def get(self) -> NoiseSource:
        src = getattr(self._local, "source", None)
        if src is None:
            with self._lock:
                src, self._first = (self._first, None) if self._first is not None else (None, None)
            if src is None:
                src = noise_source(self._kind)  # type: ignore[arg-type]
            self._local.source = src
        return src


def _drop_pages(arr: np.memmap, start_row: int, stop_row: int) -> None:
    """Unmap the input pages of rows already processed so the resident set stays one chunk.

    Pages of a read-only file mapping count in the process's resident set once touched; the
    kernel keeps them in its page cache either way, so dropping them from our mapping costs a
    re-read only if we touched them again (we do not).
    """
    mm = getattr(arr, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    if arr.flags.c_contiguous:
        row_bytes = arr.shape[1] * arr.dtype.itemsize
        begin = arr.offset + start_row * row_bytes
        end = arr.offset + stop_row * row_bytes
        begin -= begin % page
        end -= end % page  # keep the partly processed last page mapped
    else:  # Fortran order: a block of rows touches every column, drop the whole mapping
        begin, end = 0, len(mm)
    if end > begin:
        with contextlib.suppress(OSError, ValueError):
            mm.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def sanitize_npy(
    in_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    epsilon: float,
    delta: float,
    clip_norm: float,
    chunk_rows: int | None = None,
    noise: SourceKind = "secure",
    seed: int | None = None,
    progress: Callable[[int], None] | None = None,
    workers: int | None = None,
    charge: Callable[[Any], object] | None = None,
) -> SanitizeReport:
    """Sanitize a 2-D ``.npy`` file of embeddings row by row, in chunks, into ``out_path``.

    Every row is one individual's embedding: it is clipped to L2 norm ``clip_norm`` and
    ``N(0, sigma^2)`` noise is added to each coordinate, with ``sigma`` calibrated exactly for
    ``(epsilon, delta)`` at sensitivity ``clip_norm`` (add/remove one row; the report also gives
    the epsilon under replacement of one row, sensitivity ``2 * clip_norm``).

    The input is opened with ``np.load(mmap_mode="r")`` and read ``chunk_rows`` rows at a time;
    pages already processed are dropped from the mapping, so memory is bounded by the chunk, not
    the file. Output goes to a temporary file next to ``out_path`` that is fsynced and renamed
    over ``out_path`` only once every row was released; on any error (bad parameters, a file that
    is not a non-empty 2-D float32/float64 array, NaN/Inf in any row) the temporary file is
    removed and nothing is written. The output keeps the input's dtype (native byte order, C
    order).

    Args:
        in_path: the input ``.npy`` (float32 or float64, shape rows x dims).
        out_path: where the sanitized ``.npy`` goes; must differ from ``in_path``.
        epsilon, delta: the per-individual guarantee of this release.
        clip_norm: L2 bound of each row (the sensitivity).
        chunk_rows: rows per chunk (default: about 16 MiB of input per chunk).
        noise: ``"secure"`` (default, floating-point safe) or ``"fast"``.
        seed: reproducible noise, **not private** (warns :class:`NotPrivateWarning`); drawn in
            blocks of :data:`SEED_BLOCK_ROWS` rows (``chunk_rows`` is rounded up to a multiple),
            so the output is the same for every chunking and equals
            ``EmbeddingSanitizer.sanitize(whole_matrix, seed=seed)``.
        progress: called with the number of rows finished after each chunk.
        workers: threads clipping and noising chunks in parallel (default: up to 2). Each thread
            draws from its own noise source keyed from OS entropy (independent streams); at most
            ``workers + 1`` chunks are in memory at a time, written in row order.
        charge: called with the release's accounting event (``mechanism.event``: one Gaussian
            release per individual) after every row was noised and before the output is renamed
            into place, e.g. ``charge=lambda ev: ledger.charge("dataset-42", ev)``. If it raises
            (:class:`~gaussdp.errors.BudgetExhausted`), nothing is written.

    Returns:
        A :class:`SanitizeReport` with the true epsilon of the release.

    Raises:
        InvalidParameter, TypeError: bad parameters (checked before any file is touched).
        UnsafeInput: the input is not a non-empty 2-D float array, or holds NaN/Inf.
        FileNotFoundError: ``in_path`` or the directory of ``out_path`` does not exist.
    """
    epsilon = check_epsilon(epsilon)
    delta = check_delta(delta)
    clip_norm = check_positive("clip_norm", clip_norm)
    if chunk_rows is not None and (
        isinstance(chunk_rows, bool) or not isinstance(chunk_rows, numbers.Integral) or chunk_rows <= 0
    ):
        raise InvalidParameter(f"chunk_rows must be a positive int, got chunk_rows={chunk_rows!r}")
    check_choice("noise", noise, ("secure", "fast"))
    if workers is not None and (
        isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or workers <= 0
    ):
        raise InvalidParameter(f"workers must be a positive int, got workers={workers!r}")
    if seed is not None:
        seed = check_seed(seed)
    src = Path(in_path)
    dst = Path(out_path)
    if not src.is_file():
        raise FileNotFoundError(f"in_path {str(src)!r} does not exist or is not a file")
    if not dst.parent.is_dir():
        raise FileNotFoundError(f"the directory of out_path {str(dst)!r} does not exist")
    if dst.exists() and dst.resolve() == src.resolve():
        raise InvalidParameter("out_path must differ from in_path (the raw file would be overwritten)")

    # Calibration and accounting come from the mechanism; a seeded run draws from per-block
    # sources instead of the mechanism's own (see _noise_rows).
    mech = _mechanism.GaussianMechanism(epsilon=epsilon, delta=delta, sensitivity=clip_norm, noise=noise)
    if seed is not None:
        warnings.warn(
            "sanitize_npy(seed=...) gives reproducible noise that anyone who knows the seed can "
            "remove: the output file is not private",
            NotPrivateWarning,
            stacklevel=2,
        )

    arr = _open_npy_matrix(src)
    rows, cols = arr.shape
    out_dtype = arr.dtype.newbyteorder("=")
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_BYTES // (cols * out_dtype.itemsize))
    chunk_rows = int(chunk_rows)
    if seed is not None:  # seeded chunks start on a noise block, so chunking cannot change the output
        chunk_rows = -(-chunk_rows // SEED_BLOCK_ROWS) * SEED_BLOCK_ROWS

    if workers is None:
        workers = min(2, os.cpu_count() or 1)
    sources = _WorkerSources(noise, first=mech.source)
    native_c = arr.dtype == out_dtype and arr.flags.c_contiguous

    def work(start: int, stop: int) -> tuple[np.ndarray, int, float, float]:
        """Clip and noise rows [start, stop): runs in a worker thread, touches only its chunk."""
        view = arr[start:stop]
        if not native_c:  # big-endian or Fortran order: one native C-order copy first
            view = np.array(view, dtype=out_dtype, order="C")
        try:
            clipped, norms = clip_rows(view, clip_norm)  # a copy: the mapped pages can go
        except UnsafeInput as exc:
            raise UnsafeInput(f"in_path {str(src)!r}, rows {start}..{stop - 1}: {exc}") from None
        del view
        _drop_pages(arr, start, stop)
        norms = np.asarray(norms, dtype=np.float64)
        released = noise_rows(
            clipped,
            sigma=mech.sigma,
            clip_norm=clip_norm,
            source=sources.get(),
            seed=seed,
            first_row=start,
        )
        return (
            np.ascontiguousarray(released, dtype=out_dtype),
            int(np.count_nonzero(norms > clip_norm)),
            float(norms.sum()),
            float(np.minimum(norms, clip_norm).sum()),
        )

    fd, tmp_name = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent)
    n_clipped = 0
    sum_before = 0.0
    sum_after = 0.0
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="gaussdp-sanitize")
    try:
        with os.fdopen(fd, "wb") as f:
            header = {
                "descr": np.lib.format.dtype_to_descr(out_dtype),
                "fortran_order": False,
                "shape": (rows, cols),
            }
            np.lib.format.write_array_header_2_0(f, header)
            # At most workers + 1 chunks in flight; results are written in row order.
            starts = iter(range(0, rows, chunk_rows))
            pending: deque[tuple[int, int, Future[tuple[np.ndarray, int, float, float]]]] = deque()
            for start in itertools.islice(starts, workers + 1):
                stop = min(rows, start + chunk_rows)
                pending.append((start, stop, pool.submit(work, start, stop)))
            while pending:
                start, stop, fut = pending.popleft()
                released, n_c, s_b, s_a = fut.result()
                nxt = next(starts, None)
                if nxt is not None:
                    pending.append(
                        (
                            nxt,
                            min(rows, nxt + chunk_rows),
                            pool.submit(work, nxt, min(rows, nxt + chunk_rows)),
                        )
                    )
                f.write(released.data)
                del released
                n_clipped += n_c
                sum_before += s_b
                sum_after += s_a
                if progress is not None:
                    progress(stop - start)
            f.flush()
            os.fsync(f.fileno())
        if charge is not None:
            charge(mech.event)  # charge before release: the rename below is the release
        os.replace(tmp_name, dst)
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    finally:
        pool.shutdown(wait=True)

    eps_true = release_epsilon(mech, delta, Neighbouring.ADD_REMOVE)
    eps_replace = release_epsilon(mech, delta, Neighbouring.REPLACE_ONE)
    return SanitizeReport(
        rows=rows,
        cols=cols,
        dtype=str(out_dtype),
        clip_norm=clip_norm,
        sigma=float(mech.sigma),
        delta=delta,
        epsilon=eps_true,
        epsilon_replace=eps_replace,
        n_clipped=n_clipped,
        avg_norm_before=sum_before / rows,
        avg_norm_after=sum_after / rows,
        chunk_rows=chunk_rows,
        noise=noise,
        private=seed is None,
    )
