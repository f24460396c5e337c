"""A local Ray cluster for the table tests: a head and one worker node, each a separate process tree.

Started with ``ray start --block`` in their own sessions and stopped by killing those process groups
(never ``ray stop``, which would stop every Ray process on the machine, other users' included).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ray_env() -> dict[str, str]:
    """The environment of the cluster's processes: the gaussdp under test importable in every worker."""
    import gaussdp

    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "GAUSSDP_"))}
    src = str(Path(gaussdp.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([src, str(Path(__file__).resolve().parent)])
    env["OMP_NUM_THREADS"] = "1"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_DEDUP_LOGS"] = "0"
    return env


@dataclass
class Cluster:
    address: str
    head: subprocess.Popen[bytes]
    workers: list[subprocess.Popen[bytes]]
    log_dir: Path


def _ray() -> str:
    exe = Path(sys.executable).parent / "ray"
    return str(exe) if exe.exists() else "ray"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=20)
            break
        except subprocess.TimeoutExpired:
            continue
    # raylet's children may have left the group: kill every process of the session we started
    with contextlib.suppress(ProcessLookupError, subprocess.SubprocessError, FileNotFoundError):
        subprocess.run(["pkill", "-KILL", "-s", str(proc.pid)], timeout=10, check=False)


@contextlib.contextmanager
def local_cluster(tmp: Path, *, workers: int = 1, cpus_per_node: int = 1) -> Iterator[Cluster]:
    """``ray start --head`` plus ``workers`` ``ray start --address`` nodes; all stopped on exit."""
    port = free_port()
    env = ray_env()
    tmp.mkdir(parents=True, exist_ok=True)
    # a short temp dir: Ray's socket paths must fit in 107 bytes
    temp_dir = Path("/tmp") / f"gdp-ray-{os.getpid()}-{port}"
    common = [f"--num-cpus={cpus_per_node}", "--object-store-memory=200000000", "--block"]
    logs = []

    def start(args: list[str], name: str) -> subprocess.Popen[bytes]:
        log = open(tmp / f"{name}.log", "wb")
        logs.append(log)
        return subprocess.Popen(
            [_ray(), "start", *args, *common],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    head = start(
        [
            "--head",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={temp_dir}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        "head",
    )
    procs = [head]
    cluster = Cluster(address=f"127.0.0.1:{port}", head=head, workers=[], log_dir=tmp)
    try:
        _wait_port(port, head, tmp / "head.log")
        for i in range(workers):
            w = start([f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.1"], f"worker{i}")
            procs.append(w)
            cluster.workers.append(w)
        _wait_nodes(cluster, 1 + workers)
        yield cluster
    finally:
        for p in reversed(procs):
            _stop(p)
        for log in logs:
            log.close()
        import shutil

        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_port(port: int, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        tail = log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "ray head did not listen: " + tail
        time.sleep(0.3)


def _wait_nodes(cluster: Cluster, n: int, timeout_s: float = 120) -> None:
    code = (
        "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
        "print(sum(1 for n in ray.nodes() if n['Alive']))"
    )
    deadline = time.monotonic() + timeout_s
    while True:
        for p in [cluster.head, *cluster.workers]:
            assert p.poll() is None, (cluster.log_dir / "head.log").read_text(errors="replace")[-3000:]
        done = subprocess.run(
            [sys.executable, "-c", code, cluster.address],
            env=ray_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode == 0 and done.stdout.strip().splitlines()[-1:] == [str(n)]:
            return
        why = f"{done.stdout[-500:]} {done.stderr[-2000:]}"
        assert time.monotonic() < deadline, f"{n} nodes did not join: {why}"
        time.sleep(1.0)


def embeddings_table(path: Path, *, rows: int = 4000, dims: int = 16, row_group: int = 500, seed: int = 0):
    """A Parquet table: ``id``, ``embedding`` (fixed-size list of float32), ``label``; norms around 1."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, dims)).astype(np.float32)
    x *= (rng.uniform(0.2, 1.8, rows) / np.linalg.norm(x, axis=1)).astype(np.float32)[:, None]
    table = pa.table(
        {
            "id": np.arange(rows, dtype=np.int64),
            "embedding": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), dims),
            "label": [f"row-{i}" for i in range(rows)],
        }
    )
    pq.write_table(table, path, row_group_size=row_group)
    return x, table


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    pytest.importorskip("ray.data")
    with local_cluster(tmp_path_factory.mktemp("ray"), workers=1) as cluster:
        yield cluster
