"""Document 003's embedding sanitizer and the streaming sanitizer over .npy files."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from gaussdp.calibration import classical_sigma, epsilon_for, sigma_for
from gaussdp.embeddings import (
    SEED_BLOCK_ROWS,
    DPConfig,
    EmbeddingSanitizer,
    GaussianMechanism,
    sanitize_npy,
)
from gaussdp.errors import InvalidParameter, NotPrivateWarning, PrivacyError, UnsafeInput
from gaussdp.noise import GRID_SLACK

# The default (float-safe) mechanism calibrates for the sensitivity C * (1 + GRID_SLACK).
SLACK = 1.0 + GRID_SLACK

# Every statistical test below is two-sided with this false-alarm rate (fixed seeds, so a failure
# reproduces): a correct implementation fails one of them with probability <= 1e-6 per seed.
ALPHA = 1e-6


def chi2_variance_ok(samples: np.ndarray, sigma: float) -> bool:
    """Two-sided chi-square test of Var = sigma^2 for zero-mean samples, at false-alarm ALPHA."""
    x = np.asarray(samples, dtype=np.float64).ravel()
    n = x.size
    stat = float(np.dot(x, x)) / sigma**2  # ~ chi2(n) when the mean is known to be 0
    lo, hi = stats.chi2.ppf(ALPHA / 2, n), stats.chi2.isf(ALPHA / 2, n)
    return bool(lo <= stat <= hi)


def doc_rows(dtype: type = np.float64) -> np.ndarray:
    # Document 003's worked example: norms 0.5, 1.0 and 5.0 with clipping_norm=1.
    return np.array([[0.3, 0.4, 0.0, 0.0], [0.6, 0.8, 0.0, 0.0], [3.0, 4.0, 0.0, 0.0]], dtype=dtype)


# ---- DPConfig ------------------------------------------------------------------------------------


def test_dpconfig_defaults_match_document():
    cfg = DPConfig()
    assert (cfg.enabled, cfg.epsilon, cfg.delta, cfg.clipping_norm) == (False, 1.0, 1e-5, 1.0)


def test_dpconfig_validates_only_when_enabled():
    DPConfig(enabled=False, epsilon=100.0, delta=2.0, clipping_norm=-1.0)  # document: not validated
    with pytest.raises(InvalidParameter, match="epsilon"):
        DPConfig(enabled=True, epsilon=100.0)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"epsilon": 0.09}, "epsilon"),
        ({"epsilon": 10.5}, "epsilon"),
        ({"epsilon": math.nan}, "epsilon"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"delta": math.inf}, "delta"),
        ({"clipping_norm": 0.0}, "clipping_norm"),
        ({"clipping_norm": -1.0}, "clipping_norm"),
    ],
)
def test_dpconfig_rejects_out_of_range_when_enabled(kwargs, name):
    with pytest.raises(InvalidParameter, match=name):
        DPConfig(enabled=True, **kwargs)


def test_dpconfig_accepts_document_range_bounds():
    assert DPConfig(enabled=True, epsilon=0.1).epsilon == 0.1
    assert DPConfig(enabled=True, epsilon=10.0).epsilon == 10.0


def test_dpconfig_types():
    with pytest.raises(TypeError, match="enabled"):
        DPConfig(enabled="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="epsilon"):
        DPConfig(enabled=True, epsilon=True)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="epsilon"):
        DPConfig(enabled=True, epsilon=1 + 0j)  # type: ignore[arg-type]


def test_dpconfig_is_frozen_and_round_trips_through_dict():
    cfg = DPConfig(enabled=True, epsilon=2.0, delta=1e-6, clipping_norm=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.clipping_norm = 5.0  # type: ignore[misc]
    assert DPConfig.from_dict(cfg.to_dict()) == cfg
    assert DPConfig.from_dict({"enabled": True, "epsilon": 3}).epsilon == 3.0


def test_dpconfig_from_dict_refuses_unknown_keys():
    with pytest.raises(InvalidParameter, match="epsilom"):
        DPConfig.from_dict({"enabled": True, "epsilom": 0.5})
    with pytest.raises(TypeError):
        DPConfig.from_dict([("enabled", True)])  # type: ignore[arg-type]


# ---- document 003's GaussianMechanism -----------------------------------------------------------


def test_document_mechanism_is_exactly_calibrated_not_classical():
    mech = GaussianMechanism(1.0, 1e-5, 1.0)
    assert mech.sigma == pytest.approx(sigma_for(epsilon=1.0, delta=1e-5, sensitivity=SLACK), rel=1e-9)
    assert mech.sigma < classical_sigma(epsilon=1.0, delta=1e-5)  # the document's 4.845
    assert mech.epsilon(1e-5) <= 1.0 + 1e-9
    assert mech.target == (1.0, 1e-5)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((0.05, 1e-5, 1.0), "epsilon"),
        ((11.0, 1e-5, 1.0), "epsilon"),
        ((1.0, 0.0, 1.0), "delta"),
        ((1.0, 1e-5, 0.0), "sensitivity"),
        ((1.0, 1e-5, -2.0), "sensitivity"),
    ],
)
def test_document_mechanism_validation(args, name):
    with pytest.raises(InvalidParameter, match=name):
        GaussianMechanism(*args)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_noise_keeps_dtype_and_shape(dtype):
    mech = GaussianMechanism(1.0, 1e-5, 1.0)
    x = np.zeros((3, 5), dtype=dtype)
    y = mech.add_noise(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert not np.array_equal(y, mech.add_noise(x))  # fresh OS-entropy noise each call


def test_add_noise_seed_is_reproducible_and_marked_not_private():
    mech = GaussianMechanism(1.0, 1e-5, 1.0)
    x = np.zeros(64, dtype=np.float32)
    with pytest.warns(NotPrivateWarning):
        a = mech.add_noise(x, seed=7)
    with pytest.warns(NotPrivateWarning):
        b = mech.add_noise(x, seed=7)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="seed"):
        mech.add_noise(x, seed=1.5)  # type: ignore[arg-type]


# ---- EmbeddingSanitizer --------------------------------------------------------------------------


def test_clip_embeddings_document_example():
    san = EmbeddingSanitizer(DPConfig(enabled=True, clipping_norm=1.0))
    clipped, n_clipped, before, after = san.clip_embeddings(doc_rows())
    np.testing.assert_allclose(clipped, [[0.3, 0.4, 0, 0], [0.6, 0.8, 0, 0], [0.6, 0.8, 0, 0]], atol=1e-12)
    assert n_clipped == 1
    assert before == pytest.approx((0.5 + 1.0 + 5.0) / 3)
    assert after == pytest.approx((0.5 + 1.0 + 1.0) / 3)


def test_clip_embeddings_float32_never_exceeds_norm():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2000, 33)) * rng.lognormal(0, 2, (2000, 1))).astype(np.float32)
    san = EmbeddingSanitizer(DPConfig(enabled=True, clipping_norm=0.7))
    clipped, n_clipped, _, after = san.clip_embeddings(x)
    assert clipped.dtype == np.float32
    norms = np.linalg.norm(clipped.astype(np.float64), axis=1)
    assert norms.max() <= 0.7
    assert n_clipped == int((np.linalg.norm(x.astype(np.float64), axis=1) > 0.7).sum())
    assert after <= 0.7


def test_sanitize_disabled_returns_input_unchanged():
    x = doc_rows()
    san = EmbeddingSanitizer(DPConfig(enabled=False))
    assert san.sanitize(x) is x
    assert san.mechanism is None and san.sigma is None
    assert san.get_stats()["num_sanitizations"] == 0
    with pytest.raises(InvalidParameter, match="disabled"):
        san.epsilon()


def test_sanitize_stats_are_the_five_documented_counters():
    san = EmbeddingSanitizer(DPConfig(enabled=True, epsilon=2.0))
    y32 = EmbeddingSanitizer(DPConfig(enabled=True)).sanitize(doc_rows(np.float32))
    assert y32.dtype == np.float32 and y32.shape == (3, 4)
    y = san.sanitize(doc_rows())  # float64: norms exactly 0.5, 1.0 and 5.0
    assert y.dtype == np.float64 and y.shape == (3, 4)
    san.sanitize(np.full((5, 4), 0.25))  # norms 0.5, none clipped
    s = san.get_stats()
    assert set(s) == {
        "num_sanitizations",
        "total_embeddings_processed",
        "embeddings_clipped",
        "avg_norm_before_clip",
        "avg_norm_after_clip",
    }
    assert s["num_sanitizations"] == 2
    assert s["total_embeddings_processed"] == 8
    assert s["embeddings_clipped"] == 1
    assert s["avg_norm_before_clip"] == pytest.approx((0.5 + 1 + 5 + 5 * 0.5) / 8, rel=1e-6)
    assert s["avg_norm_after_clip"] == pytest.approx((0.5 + 1 + 1 + 5 * 0.5) / 8, rel=1e-6)


@pytest.mark.parametrize(
    "bad",
    [
        np.array([[0.1, np.nan], [0.2, 0.3]]),
        np.array([[0.1, np.inf], [0.2, 0.3]]),
        np.zeros((0, 4)),
        np.zeros((3, 0)),
        np.zeros(4),
        np.zeros((2, 2, 2)),
        [[0.1, 0.2], [0.3]],
    ],
    ids=["nan", "inf", "no-rows", "no-cols", "1d", "3d", "ragged"],
)
def test_sanitize_refuses_bad_input_and_releases_nothing(bad):
    san = EmbeddingSanitizer(DPConfig(enabled=True))
    with pytest.raises(UnsafeInput):
        san.sanitize(bad)
    assert san.get_stats()["num_sanitizations"] == 0


@pytest.mark.parametrize("bad", [np.ones((2, 2), dtype=complex), np.ones((2, 2), dtype=bool)])
def test_sanitize_refuses_non_real_dtypes(bad):
    with pytest.raises((TypeError, PrivacyError)):
        EmbeddingSanitizer(DPConfig(enabled=True)).sanitize(bad)


def test_sanitizer_epsilon_add_remove_and_replace():
    san = EmbeddingSanitizer(DPConfig(enabled=True, epsilon=1.0, delta=1e-5, clipping_norm=2.0))
    assert san.sigma == pytest.approx(sigma_for(epsilon=1.0, delta=1e-5, sensitivity=2.0 * SLACK), rel=1e-9)
    eps = san.epsilon()
    assert 0.999 <= eps <= 1.0 + 1e-9
    # Replacing a row moves it by up to 2C: same sigma at double the sensitivity.
    assert san.epsilon(neighbouring="replace_one") == pytest.approx(
        epsilon_for(sigma=san.sigma, delta=1e-5, sensitivity=4.0 * SLACK), rel=1e-9
    )
    with pytest.raises(InvalidParameter, match="neighbouring"):
        san.epsilon(neighbouring="swap")
    assert san.event.noise_multiplier == pytest.approx(san.sigma / (2.0 * SLACK), rel=1e-12)


def test_sanitize_noise_level_chi_square():
    """Noise on zero rows has variance sigma^2 (two-sided chi-square, false alarm 1e-6)."""
    san = EmbeddingSanitizer(DPConfig(enabled=True, epsilon=1.0, delta=1e-5, clipping_norm=1.0))
    x = np.zeros((400, 500), dtype=np.float64)
    with pytest.warns(NotPrivateWarning):
        y = san.sanitize(x, seed=12345)
    assert chi2_variance_ok(y, san.sigma)
    # The test has power: the document's classical sigma (30% larger) is rejected.
    assert not chi2_variance_ok(y, classical_sigma(epsilon=1.0, delta=1e-5))
    # And the values are Gaussian (KS, same false-alarm rate).
    assert stats.kstest(y.ravel()[:20000] / san.sigma, "norm").pvalue > ALPHA


# ---- streaming over .npy files -------------------------------------------------------------------


def _make_npy(path: Path, rows: int = 1000, cols: int = 16, dtype=np.float32, seed: int = 0, order="C"):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * rng.lognormal(-1.5, 1.0, (rows, 1))).astype(dtype)
    if order == "F":
        x = np.asfortranarray(x)
    np.save(path, x)
    return x


def _no_leftovers(directory: Path, keep: set[str]) -> bool:
    return {p.name for p in directory.iterdir()} == keep


def test_sanitize_npy_chunked_equals_one_shot(tmp_path):
    """For a seeded run, any chunking gives the same output as sanitizing the whole matrix at once."""
    src = tmp_path / "in.npy"
    x = _make_npy(src, rows=1500, cols=16)
    outs = []
    for chunk in (1, 256, 700, 1500, None):
        dst = tmp_path / f"out_{chunk}.npy"
        with pytest.warns(NotPrivateWarning):
            rep = sanitize_npy(src, dst, epsilon=1.0, delta=1e-5, clip_norm=0.5, chunk_rows=chunk, seed=42)
        assert not rep.private
        assert rep.chunk_rows % SEED_BLOCK_ROWS == 0  # seeded chunks start on a noise block
        outs.append(np.load(dst))
    san = EmbeddingSanitizer(DPConfig(enabled=True, epsilon=1.0, delta=1e-5, clipping_norm=0.5))
    with pytest.warns(NotPrivateWarning):
        expected = san.sanitize(x, seed=42)
    for out in outs:
        assert out.dtype == np.float32 and out.shape == x.shape
        np.testing.assert_array_equal(out, expected)
    with pytest.warns(NotPrivateWarning):
        other = san.sanitize(x, seed=43)
    assert not np.array_equal(other, expected)


def test_sanitize_npy_report_and_guarantee(tmp_path):
    src, dst = tmp_path / "in.npy", tmp_path / "out.npy"
    x = _make_npy(src, rows=300, cols=8, dtype=np.float64)
    rep = sanitize_npy(src, dst, epsilon=2.0, delta=1e-6, clip_norm=1.0, chunk_rows=64)
    assert rep.private and (rep.rows, rep.cols, rep.dtype) == (300, 8, "float64")
    norms = np.linalg.norm(x, axis=1)
    assert rep.n_clipped == int((norms > 1.0).sum())
    assert rep.avg_norm_before == pytest.approx(norms.mean(), rel=1e-9)
    assert rep.avg_norm_after == pytest.approx(np.minimum(norms, 1.0).mean(), rel=1e-9)
    assert rep.sigma == pytest.approx(sigma_for(epsilon=2.0, delta=1e-6, sensitivity=SLACK), rel=1e-9)
    assert rep.epsilon <= 2.0 + 1e-9 and rep.epsilon >= 1.99
    assert rep.epsilon_replace == pytest.approx(
        epsilon_for(sigma=rep.sigma, delta=1e-6, sensitivity=2.0 * SLACK), rel=1e-9
    )
    assert _no_leftovers(tmp_path, {"in.npy", "out.npy"})
    y = np.load(dst)
    assert not np.array_equal(y, x)


def test_sanitize_npy_fortran_order_and_big_endian(tmp_path):
    src_c, src_f, src_be = tmp_path / "c.npy", tmp_path / "f.npy", tmp_path / "be.npy"
    x = _make_npy(src_c, rows=50, cols=6)
    np.save(src_f, np.asfortranarray(x))
    np.save(src_be, x.astype(">f4"))
    outs = []
    for src in (src_c, src_f, src_be):
        dst = src.with_name("out_" + src.name)
        with pytest.warns(NotPrivateWarning):
            sanitize_npy(src, dst, epsilon=1.0, delta=1e-5, clip_norm=1.0, chunk_rows=9, seed=3)
        outs.append(np.load(dst))
    for out in outs[1:]:
        assert out.dtype == np.dtype("float32")
        np.testing.assert_array_equal(out, outs[0])


def _bad_arrays():
    rng = np.random.default_rng(1)
    nan_rows = rng.standard_normal((500, 4)).astype(np.float32)
    nan_rows[437, 2] = np.nan
    inf_rows = rng.standard_normal((500, 4))
    inf_rows[3, 0] = -np.inf
    return {
        "nan-row": nan_rows,
        "inf-row": inf_rows,
        "3d": np.zeros((4, 3, 2), dtype=np.float32),
        "1d": np.zeros(10, dtype=np.float32),
        "int": np.ones((10, 3), dtype=np.int64),
        "complex": np.ones((10, 3), dtype=np.complex64),
        "float16": np.ones((10, 3), dtype=np.float16),
        "no-rows": np.zeros((0, 5), dtype=np.float32),
        "no-cols": np.zeros((5, 0), dtype=np.float32),
        "structured": np.zeros(4, dtype=[("a", "f4"), ("b", "f4")]),
    }


@pytest.mark.parametrize("kind", list(_bad_arrays()))
def test_sanitize_npy_bad_files_write_nothing(tmp_path, kind):
    src, dst = tmp_path / "in.npy", tmp_path / "out.npy"
    np.save(src, _bad_arrays()[kind])
    with pytest.raises(UnsafeInput) as info:
        sanitize_npy(src, dst, epsilon=1.0, delta=1e-5, clip_norm=1.0, chunk_rows=100)
    if kind == "nan-row":
        assert "rows 400..499" in str(info.value)  # the chunk that held row 437
    assert _no_leftovers(tmp_path, {"in.npy"})


def test_sanitize_npy_keeps_an_existing_output_on_error(tmp_path):
    src, dst = tmp_path / "in.npy", tmp_path / "out.npy"
    x = _make_npy(src, rows=200, cols=4)
    x[150, 1] = np.nan
    np.save(src, x)
    dst.write_bytes(b"previous release")
    with pytest.raises(UnsafeInput):
        sanitize_npy(src, dst, epsilon=1.0, delta=1e-5, clip_norm=1.0, chunk_rows=16)
    assert dst.read_bytes() == b"previous release"
    assert _no_leftovers(tmp_path, {"in.npy", "out.npy"})


@pytest.mark.parametrize("content", [b"not a numpy file at all", b""], ids=["text", "empty"])
def test_sanitize_npy_refuses_non_npy(tmp_path, content):
    src, dst = tmp_path / "in.npy", tmp_path / "out.npy"
    src.write_bytes(content)
    with pytest.raises(UnsafeInput, match="in_path"):
        sanitize_npy(src, dst, epsilon=1.0, delta=1e-5, clip_norm=1.0)
    assert not dst.exists()


def test_sanitize_npy_refuses_pickled_objects_and_npz(tmp_path):
    src, dst = tmp_path / "in.npy", tmp_path / "out.npy"
    np.save(src, np.array([[object()]], dtype=object), allow_pickle=True)
    with pytest.raises(UnsafeInput, match="in_path"):
        sanitize_npy(src, dst, epsilon=1.0, delta=1e-5, clip_norm=1.0)
    npz = tmp_path / "in.npz"
    np.savez(npz, a=np.zeros((2, 2)))
    with pytest.raises(UnsafeInput, match="in_path"):
        sanitize_npy(npz, dst, epsilon=1.0, delta=1e-5, clip_norm=1.0)
    assert not dst.exists()


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"epsilon": 0.0}, InvalidParameter, "epsilon"),
        ({"epsilon": math.nan}, InvalidParameter, "epsilon"),
        ({"delta": 1.0}, InvalidParameter, "delta"),
        ({"delta": -1e-5}, InvalidParameter, "delta"),
        ({"clip_norm": 0.0}, InvalidParameter, "clip_norm"),
        ({"clip_norm": math.inf}, InvalidParameter, "clip_norm"),
        ({"chunk_rows": 0}, InvalidParameter, "chunk_rows"),
        ({"chunk_rows": True}, InvalidParameter, "chunk_rows"),
        ({"epsilon": True}, TypeError, "epsilon"),
        ({"seed": "7"}, TypeError, "seed"),
        ({"seed": -1}, InvalidParameter, "seed"),
        ({"workers": 0}, InvalidParameter, "workers"),
        ({"noise": "loud"}, InvalidParameter, "noise"),
    ],
)
def test_sanitize_npy_bad_parameters_write_nothing(tmp_path, kwargs, exc, name):
    src, dst = tmp_path / "in.npy", tmp_path / "out.npy"
    _make_npy(src, rows=10, cols=3)
    args = {"epsilon": 1.0, "delta": 1e-5, "clip_norm": 1.0} | kwargs
    with pytest.raises(exc, match=name):
        sanitize_npy(src, dst, **args)
    assert _no_leftovers(tmp_path, {"in.npy"})


def test_sanitize_npy_paths(tmp_path):
    src = tmp_path / "in.npy"
    _make_npy(src, rows=10, cols=3)
    with pytest.raises(InvalidParameter, match="differ"):
        sanitize_npy(src, src, epsilon=1.0, delta=1e-5, clip_norm=1.0)
    with pytest.raises(FileNotFoundError):
        sanitize_npy(tmp_path / "missing.npy", tmp_path / "o.npy", epsilon=1.0, delta=1e-5, clip_norm=1.0)
    with pytest.raises(FileNotFoundError):
        sanitize_npy(src, tmp_path / "no_dir" / "o.npy", epsilon=1.0, delta=1e-5, clip_norm=1.0)
    assert _no_leftovers(tmp_path, {"in.npy"})


_MEMORY_PROBE = """
import json, sys, tracemalloc
import gaussdp._npy_stream as stream
from gaussdp.embeddings import sanitize_npy

src, dst, chunk, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
seen = []
real_clip_rows = stream.clip_rows

def spy(x, c):
    seen.append(x.shape[0])
    return real_clip_rows(x, c)

sanitize_npy(src, dst, epsilon=1.0, delta=1e-5, clip_norm=1.0, chunk_rows=chunk, workers=workers)
stream.clip_rows = spy  # measured on the second call: lazy imports and caches are the first's
tracemalloc.start()
sanitize_npy(src, dst, epsilon=1.0, delta=1e-5, clip_norm=1.0, chunk_rows=chunk, workers=workers)
peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"peak": peak, "max_rows": max(seen), "rows": sum(seen)}))
"""


def test_sanitize_npy_memory_is_bounded_by_the_chunk(tmp_path):
    """By design: no step sees more than chunk_rows rows, and the heap peak does not grow with the file.

    The input is memory-mapped (pages of the kernel's page cache, dropped after each chunk; not
    counted by tracemalloc), so every allocation tracemalloc sees comes from the per-chunk work.
    An 8x larger file must not raise the peak, which stays far below the file size. Measured in a
    fresh process: tracemalloc counts every thread's allocations, and threads other tests leave
    running in this one would be counted too.
    """
    import json
    import subprocess
    import sys

    cols, chunk = 128, 500
    file_bytes = 40_000 * cols * 4
    for workers in (1, 2):
        peaks = {}
        for rows in (5_000, 40_000):  # 2.6 MB and 20 MB files
            src, dst = tmp_path / f"in{rows}.npy", tmp_path / f"out{rows}.npy"
            if not src.exists():
                _make_npy(src, rows=rows, cols=cols)
            probe = subprocess.run(
                [sys.executable, "-c", _MEMORY_PROBE, str(src), str(dst), str(chunk), str(workers)],
                capture_output=True,
                text=True,
                timeout=120,
                check=True,
            )
            out = json.loads(probe.stdout.strip().splitlines()[-1])
            assert out["max_rows"] == chunk and out["rows"] == rows
            peaks[rows] = out["peak"]
        # An 8x larger file does not raise the peak; the peak is a fraction of the file.
        assert peaks[40_000] < 1.25 * peaks[5_000] + 64 * 1024, (workers, peaks)
        assert peaks[40_000] < file_bytes / 2, (workers, peaks)


def test_sanitize_npy_charges_before_release(tmp_path):
    """The ledger is charged before the output appears; a refused charge writes nothing."""
    from gaussdp.budget import Budget, Ledger
    from gaussdp.errors import BudgetExhausted

    src, dst = tmp_path / "in.npy", tmp_path / "out.npy"
    _make_npy(src, rows=40, cols=4)
    ledger = Ledger("memory://")
    ledger.open("dataset", Budget(epsilon=1.2, delta=1e-5))
    seen_output_at_charge = []

    def charge(event):
        seen_output_at_charge.append(dst.exists())
        return ledger.charge("dataset", event)

    rep = sanitize_npy(src, dst, epsilon=1.0, delta=1e-5, clip_norm=1.0, charge=charge)
    assert seen_output_at_charge == [False] and dst.exists()
    assert ledger.spent("dataset").epsilon == pytest.approx(rep.epsilon, rel=1e-3)
    dst2 = tmp_path / "out2.npy"
    with pytest.raises(BudgetExhausted):  # two epsilon=1 releases compose to about 1.45 > 1.2
        sanitize_npy(src, dst2, epsilon=1.0, delta=1e-5, clip_norm=1.0, charge=charge)
    assert _no_leftovers(tmp_path, {"in.npy", "out.npy"})
