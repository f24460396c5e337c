"""``gaussdp sanitize IN.npy OUT.npy``: streams, prints the true epsilon, writes nothing on error."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from gaussdp.calibration import epsilon_for, sigma_for
from gaussdp.cli import build_app
from gaussdp.errors import NotPrivateWarning
from gaussdp.noise import GRID_SLACK


@pytest.fixture(scope="module")
def app():
    return build_app()


def run(app, *args):
    return CliRunner().invoke(app, ["sanitize", *map(str, args)])


def write(path, x):
    np.save(path, x)
    return path


def test_sanitize_prints_true_epsilon_and_writes_the_file(app, tmp_path):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((1000, 12)) * 0.5).astype(np.float32)
    src, dst = write(tmp_path / "in.npy", x), tmp_path / "out.npy"
    res = run(app, src, dst, "--epsilon", 2, "--delta", 1e-6, "--clip-norm", 1.0, "--chunk-rows", 300)
    assert res.exit_code == 0, res.output
    y = np.load(dst)
    assert y.shape == x.shape and y.dtype == np.float32
    slack = 1.0 + GRID_SLACK  # the float-safe mechanism calibrates for sensitivity C * slack
    sigma = sigma_for(epsilon=2.0, delta=1e-6, sensitivity=slack)
    m = re.search(
        r"true epsilon per individual at delta=1e-06: ([0-9.]+) \(add/remove one row\); ([0-9.]+)", res.output
    )
    assert m, res.output
    assert float(m.group(1)) == pytest.approx(
        epsilon_for(sigma=sigma, delta=1e-6, sensitivity=slack), rel=1e-5
    )
    assert float(m.group(1)) <= 2.0
    assert float(m.group(2)) == pytest.approx(
        epsilon_for(sigma=sigma, delta=1e-6, sensitivity=2 * slack), rel=1e-5
    )
    assert f"{sigma:.6g}" in res.output
    n_clipped = int((np.linalg.norm(x.astype(np.float64), axis=1) > 1.0).sum())
    assert f"{n_clipped} rows clipped" in res.output


def test_sanitize_seed_warns_not_private(app, tmp_path):
    src, dst = write(tmp_path / "in.npy", np.zeros((20, 3))), tmp_path / "out.npy"
    with pytest.warns(NotPrivateWarning):
        res = run(app, src, dst, "--epsilon", 1, "--delta", 1e-5, "--clip-norm", 1, "--seed", 3)
    assert res.exit_code == 0
    assert "NOT private" in res.output


def bad_inputs():
    nan = np.ones((100, 4), dtype=np.float32)
    nan[77] = np.nan
    return {
        "nan-row": nan,
        "3d": np.zeros((3, 2, 2), dtype=np.float32),
        "1d": np.zeros(5, dtype=np.float32),
        "int": np.ones((3, 3), dtype=np.int32),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


@pytest.mark.parametrize("kind", list(bad_inputs()))
def test_sanitize_bad_file_writes_nothing(app, tmp_path, kind):
    src, dst = write(tmp_path / "in.npy", bad_inputs()[kind]), tmp_path / "out.npy"
    res = run(app, src, dst, "--epsilon", 1, "--delta", 1e-5, "--clip-norm", 1, "--chunk-rows", 10)
    assert res.exit_code == 2, res.output
    assert "error" in res.output and "nothing was written" in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npy"]


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        (["--epsilon", "0", "--delta", "1e-5", "--clip-norm", "1"], "epsilon"),
        (["--epsilon", "nan", "--delta", "1e-5", "--clip-norm", "1"], "epsilon"),
        (["--epsilon", "1", "--delta", "2", "--clip-norm", "1"], "delta"),
        (["--epsilon", "1", "--delta", "1e-5", "--clip-norm", "-1"], "clip_norm"),
        (["--epsilon", "1", "--delta", "1e-5", "--clip-norm", "1", "--chunk-rows", "0"], "chunk_rows"),
        (["--epsilon", "1", "--delta", "1e-5", "--clip-norm", "1", "--noise", "loud"], "noise"),
    ],
)
def test_sanitize_bad_parameters_write_nothing(app, tmp_path, flags, name):
    src, dst = write(tmp_path / "in.npy", np.ones((10, 2))), tmp_path / "out.npy"
    res = run(app, src, dst, *flags)
    assert res.exit_code == 2, res.output
    assert name in res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npy"]


def test_sanitize_missing_input(app, tmp_path):
    res = run(
        app, tmp_path / "nope.npy", tmp_path / "out.npy", "--epsilon", 1, "--delta", 1e-5, "--clip-norm", 1
    )
    assert res.exit_code == 2 and "nothing was written" in res.output
    assert list(tmp_path.iterdir()) == []


def test_console_script_help_lists_sanitize():
    out = subprocess.run(
        [sys.executable, "-c", "from gaussdp.cli import main; main()", "sanitize", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    assert "--clip-norm" in out.stdout and "--chunk-rows" in out.stdout
