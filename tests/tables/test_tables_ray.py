"""The same release on a real local Ray cluster (a head and a worker process, stopped by the tests).

Acceptance of issue 33: a Parquet table sanitized on the cluster keeps its rows and other columns, its
rows are clipped as promised, the noise has the calibrated standard deviation, and the ledger holds
one charge equal to the accountant's value; a worker killed mid-job leaves a complete output with
each block once, a manifest that agrees, and one charge; the single-process path and Ray agree in
their statistics while drawing different noise.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pyarrow")
pytest.importorskip("ray.data")

import pyarrow.parquet as pq
from ray_faults import CrashOnce

from conftest import embeddings_table, ray_env
from gaussdp.accounting import accountant
from gaussdp.budget import Budget, Ledger
from gaussdp.calibration import sigma_for
from gaussdp.noise import GRID_SLACK
from gaussdp.tables import read_release, sanitize_dataset, sanitize_parquet
from gaussdp.tables._ray import MANIFEST, part_name

pytestmark = pytest.mark.slow

EPS, DELTA, CLIP = 4.0, 1e-5, 1.0


@pytest.fixture(scope="module")
def connected(ray_cluster):
    import ray
    import ray.data

    ray.init(address=ray_cluster.address, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ray_cluster
    ray.shutdown()


def _read(path: Path) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(ids, embeddings, labels) of an output, sorted by id."""
    t = pq.read_table(path)
    ids = t.column("id").to_numpy()
    order = np.argsort(ids)
    y = np.asarray(t.column("embedding").combine_chunks().flatten().to_numpy()).reshape(t.num_rows, -1)
    labels = t.column("label").to_pylist()
    return ids[order], y[order], [labels[i] for i in order]


def _clipped(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x.astype(np.float64), axis=1)
    return x.astype(np.float64) * np.minimum(1.0, CLIP / norms)[:, None]


def _check_noise(x: np.ndarray, y: np.ndarray, sigma: float) -> np.ndarray:
    """The residual after the promised clipping: mean 0 along each clipped row, std sigma (6-SE bands)."""
    r = y.astype(np.float64) - _clipped(x)
    n = r.size
    # the sample std of n Gaussian draws has relative standard error 1/sqrt(2n): a 6-SE band
    assert abs(r.std() / sigma - 1.0) < 6.0 / np.sqrt(2 * n), (r.std(), sigma)
    assert abs(r.mean()) < 6.0 * sigma / np.sqrt(n)
    # rows above the clip norm were clipped: the residual along their direction has mean 0 (unclipped,
    # it would be norm - C, about 0.4 here)
    norms = np.linalg.norm(x.astype(np.float64), axis=1)
    big = norms > CLIP
    along = np.einsum("ij,ij->i", r[big], x[big] / norms[big, None])
    assert big.sum() > 500 and abs(along.mean()) < 6.0 * sigma / np.sqrt(big.sum())
    return r


def _ledger(tmp_path: Path) -> tuple[Ledger, str]:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = Ledger(url)
    ledger.open("dataset-42", Budget(epsilon=10.0, delta=1e-4))
    return ledger, url


def _one_charge_equal_to_the_accountant(ledger: Ledger, report) -> None:
    history = ledger.history("dataset-42")
    assert len(history) == 1
    assert report.charge == {"principal": "dataset-42", "charge_id": history[0].charge_id}
    sigma = sigma_for(epsilon=EPS, delta=DELTA, sensitivity=CLIP * (1 + GRID_SLACK))
    assert report.sigma == pytest.approx(sigma, rel=1e-9)
    # the ledger composes with its accountant (pld) at the budget's delta: one Gaussian event
    expected = accountant("pld").compose(_event()).epsilon(1e-4)
    assert ledger.spent("dataset-42").epsilon == pytest.approx(expected, rel=1e-9)
    assert report.epsilon <= EPS * (1 + 1e-9)


def _event():
    from gaussdp.mechanism import GaussianMechanism

    return GaussianMechanism(epsilon=EPS, delta=DELTA, sensitivity=CLIP).event


def test_ray_cluster_sanitizes_a_parquet_table(connected, tmp_path):
    import ray
    import ray.data

    x, raw = embeddings_table(tmp_path / "in.parquet")
    ledger, _ = _ledger(tmp_path)
    ds = ray.data.read_parquet(str(tmp_path / "in.parquet"), override_num_blocks=8)
    report = sanitize_dataset(
        ds,
        tmp_path / "out",
        column="embedding",
        epsilon=EPS,
        delta=DELTA,
        clip_norm=CLIP,
        charge=lambda ev: ledger.charge("dataset-42", ev),
    )
    assert report.engine == "ray" and report.rows == len(x) and report.cols == x.shape[1]
    ids, y, labels = _read(tmp_path / "out")
    assert ids.tolist() == list(range(len(x)))  # every row once, none lost or doubled
    assert labels == raw.column("label").to_pylist()  # other columns untouched
    assert y.dtype == np.float32
    _check_noise(x, y, report.sigma)
    assert report.n_clipped == int((np.linalg.norm(x.astype(np.float64), axis=1) > CLIP).sum())
    assert report.avg_norm_after <= CLIP
    _one_charge_equal_to_the_accountant(ledger, report)
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest == read_release(str(tmp_path / "out"))
    assert manifest["charge"] == report.charge and manifest["sigma"] == report.sigma
    assert manifest["neighbouring"] == "add_remove" and manifest["clip_norm"] == CLIP
    files = sorted(p.name for p in (tmp_path / "out").iterdir() if p.name != MANIFEST)
    assert files == [b["file"] for b in manifest["blocks"]] == [part_name(i) for i in range(report.blocks)]
    assert report.blocks >= 2  # the job was split: both nodes could take part


def test_a_killed_worker_leaves_each_block_once(connected, tmp_path):
    import ray.data

    x, _ = embeddings_table(tmp_path / "in.parquet")
    ledger, _ = _ledger(tmp_path)
    markers = tmp_path / "markers"
    markers.mkdir()
    out = tmp_path / "out"
    # block 1's worker dies after writing its temporary file (its copy must never land); block 2's
    # after committing (the retry must discard its own copy, never replace the committed one)
    fault = CrashOnce(str(markers), str(out), {1: "written", 2: "committed"})
    ds = ray.data.read_parquet(str(tmp_path / "in.parquet"), override_num_blocks=6)
    report = sanitize_dataset(
        ds,
        out,
        column="embedding",
        epsilon=EPS,
        delta=DELTA,
        clip_norm=CLIP,
        charge=lambda ev: ledger.charge("dataset-42", ev),
        _fault=fault,
    )
    crashed = {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in markers.iterdir()}
    assert set(crashed) == {1, 2}, crashed  # both workers really died
    ids, y, _ = _read(out)
    assert ids.tolist() == list(range(len(x)))  # complete, each row once
    _check_noise(x, y, report.sigma)  # one noisy copy: two summed draws would have std sqrt(2) sigma
    manifest = json.loads((out / MANIFEST).read_text())
    files = sorted(p.name for p in out.iterdir() if p.name != MANIFEST)
    assert files == [part_name(i) for i in range(report.blocks)] == [b["file"] for b in manifest["blocks"]]
    for block in manifest["blocks"]:
        assert pq.read_metadata(out / block["file"]).num_rows == block["rows"]
    assert sum(b["rows"] for b in manifest["blocks"]) == len(x)
    committed = hashlib.sha256((out / part_name(2)).read_bytes()).hexdigest()
    assert committed == crashed[2]["sha256"]  # the first committed copy won
    assert len(ledger.history("dataset-42")) == 1  # retries are not charged again


def test_single_process_and_ray_agree_in_statistics(connected, tmp_path):
    import ray.data

    x, _ = embeddings_table(tmp_path / "in.parquet", rows=6000)
    common = {"column": "embedding", "epsilon": EPS, "delta": DELTA, "clip_norm": CLIP}
    local = sanitize_parquet(tmp_path / "in.parquet", tmp_path / "local.parquet", **common)
    ds = ray.data.read_parquet(str(tmp_path / "in.parquet"))
    remote = sanitize_dataset(ds, tmp_path / "ray", **common)
    _, y_local, _ = _read(tmp_path / "local.parquet")
    ids, y_ray, _ = _read(tmp_path / "ray")
    assert ids.tolist() == list(range(len(x)))
    assert local.sigma == remote.sigma and local.epsilon == remote.epsilon
    assert local.n_clipped == remote.n_clipped
    assert local.avg_norm_before == pytest.approx(remote.avg_norm_before, rel=1e-9)
    r_local = _check_noise(x, y_local, local.sigma)
    r_ray = _check_noise(x, y_ray, remote.sigma)
    assert not np.array_equal(y_local, y_ray)  # different draws, never the same
    n = r_local.size
    corr = float(np.corrcoef(r_local.ravel(), r_ray.ravel())[0, 1])
    assert abs(corr) < 6.0 / np.sqrt(n)  # independent noise (no seed shared between paths)
    # the two variances agree: F-ratio within a 6-SE band of 1
    assert abs(r_local.var() / r_ray.var() - 1.0) < 6.0 * np.sqrt(4.0 / n)


def test_cli_engine_ray_charges_the_ledger_once(connected, tmp_path):
    x, _ = embeddings_table(tmp_path / "in.parquet", rows=2000)
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    argv = [
        sys.executable, "-m", "gaussdp.cli", "sanitize", str(tmp_path / "in.parquet"), str(tmp_path / "out"),
        "--column", "embedding", "--engine", "ray", "--address", connected.address,
        "--epsilon", str(EPS), "--delta", str(DELTA), "--clip-norm", str(CLIP),
        "--ledger", db, "--session", "dataset-42", "--budget-epsilon", "10", "--budget-delta", "1e-4",
        "--json",
    ]  # fmt: skip
    done = subprocess.run(argv, env=ray_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout)
    assert printed["engine"] == "ray" and printed["rows"] == len(x)
    with Ledger(db) as ledger:
        history = ledger.history("dataset-42")
        assert len(history) == 1 and printed["charge"]["charge_id"] == history[0].charge_id
    assert read_release(str(tmp_path / "out"))["charge"] == printed["charge"]
    # a second run into a non-empty directory is refused before anything is charged
    again = subprocess.run(argv, env=ray_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert again.returncode == 2 and "must not exist or be an empty directory" in again.stderr
    with Ledger(db) as ledger:
        assert len(ledger.history("dataset-42")) == 1
    assert os.path.isfile(tmp_path / "out" / MANIFEST)


def test_readme_parquet_and_ray_commands(connected, tmp_path):
    """README's ``<!-- readme-data -->`` commands, run as written in a fresh directory.

    The reader's ``ray start --head`` and ``ray stop`` are this module's cluster (started and stopped
    by the fixture; ``ray stop`` would stop every Ray process on the machine): its address replaces
    ``127.0.0.1:6380``.
    """
    import re
    import shlex

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    start = readme.index("<!-- readme-data -->")
    block = re.search(r"```console\n(.*?)```", readme[start:], flags=re.S)
    assert block is not None
    commands = [line[2:] for line in block.group(1).splitlines() if line.startswith("$ ")]
    assert commands[1] == "ray start --head --port=6380 --num-cpus=2" and commands[3] == "ray stop"
    x, _ = embeddings_table(tmp_path / "embeddings.parquet", rows=1000)
    for command in (commands[0], commands[2]):
        argv = shlex.split(command.replace("127.0.0.1:6380", connected.address))
        assert argv[0] == "gaussdp"
        done = subprocess.run(
            [sys.executable, "-m", "gaussdp.cli", *argv[1:]],
            env=ray_env(),
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert done.returncode == 0, f"{command}: {done.stderr[-3000:]}"
        assert "true epsilon per individual" in done.stdout
    assert pq.read_table(tmp_path / "sanitized.parquet").num_rows == len(x)
    assert pq.read_table(tmp_path / "sanitized-ray").num_rows == len(x)
    assert (tmp_path / "sanitized-ray" / MANIFEST).is_file()
    with Ledger(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        assert len(ledger.history("dataset-42")) == 2  # one charge per release
