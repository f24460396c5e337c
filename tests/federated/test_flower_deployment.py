"""The example app on Flower's deployment runtime: a real SuperLink and 3 SuperNodes, ``flwr run``.

Every process is started by the test (``flower-superlink``, ``flower-supernode``, ``flwr``, all from
the environment of ``sys.executable``) on 127.0.0.1 with free ports and a private ``FLWR_HOME``, and
stopped by the fixture's finalizer (SIGTERM, then SIGKILL), also when a test fails. Flower starts the
ServerApp and ClientApp processes in sessions of their own: the cluster finds all its processes by
an environment variable with a token of its own, which every descendant inherits. The environment
(``PYTHONPATH`` included) is passed through, so the apps import the same gaussdp as the test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("sklearn")

from gaussdp.accounting import SubsampledGaussianEvent, accountant
from gaussdp.budget import Ledger
from gaussdp.federated.flower import load_checkpoint
from gaussdp.noise import GRID_SLACK

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower-digits"
BIN = Path(sys.executable).parent
NODES = 3
# The example's pyproject.toml: q, z and the budget's delta; the test reads the run's own figures.
Q, Z, DELTA = 0.7, 1.0, 1e-5


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _marked(token: str) -> list[tuple[int, str]]:
    """The live processes (zombies excluded) whose environment carries the cluster's token.

    Flower starts the ServerApp and ClientApp processes in sessions of their own, so a process
    group does not hold them all; the environment variable every descendant inherits does.
    """
    marker = f"GAUSSDP_FLOWER_TEST={token}".encode()
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if marker not in (d / "environ").read_bytes().split(b"\0"):
                continue
            stat = (d / "stat").read_text()
            if stat[stat.rindex(")") + 2 :].split()[0] == "Z":
                continue
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            found.append((int(d.name), cmd))
        except (OSError, ValueError):
            continue
    return found


class Cluster:
    """A SuperLink and its SuperNodes as processes, each the leader of its own session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.home = root / "flwr-home"
        self.home.mkdir()
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ)
        self.env["PATH"] = f"{BIN}{os.pathsep}{self.env.get('PATH', '')}"  # flower-superexec, flwr-*
        self.env["FLWR_HOME"] = str(self.home)
        self.env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
        self.token = uuid.uuid4().hex
        self.env["GAUSSDP_FLOWER_TEST"] = self.token
        self.port, *self.node_ports = _free_ports(1 + NODES)
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "test"\n\n[superlink.test]\naddress = "127.0.0.1:{self.port}"\n'
            "insecure = true\n"
        )

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        with open(self.root / f"{name}.log", "wb") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [str(BIN / args[0]), *args[1:]],
                env=self.env,
                cwd=self.root,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def start(self) -> None:
        self.start_superlink("superlink")
        for i, port in enumerate(self.node_ports):
            self.spawn(
                f"supernode{i}",
                "flower-supernode",
                "--insecure",
                "--superlink",
                f"127.0.0.1:{self.port}",
                "--port",
                str(port),
                "--node-config",
                f"partition-id={i} num-partitions={NODES}",
            )

    def start_superlink(self, name: str) -> subprocess.Popen:
        """The SuperLink, its state in ``superlink.db`` (a restart with the same file continues)."""
        link = self.spawn(
            name,
            "flower-superlink",
            "--insecure",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--database",
            str(self.root / "superlink.db"),
            "--disable-runtime-dependency-installation",
        )
        deadline = time.monotonic() + 60
        while True:
            if link.poll() is not None:
                raise RuntimeError(f"flower-superlink exited:\n{self.log(name)[-3000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"no SuperLink on port {self.port}:\n{self.log(name)[-3000:]}"
                    ) from None
                time.sleep(0.2)
        return link

    def flwr_run(self, config: str, *, stream: bool, timeout: float, name: str) -> str:
        args = ["flwr", "run", str(EXAMPLE), "test", "--run-config", config] + (
            ["--stream"] if stream else []
        )
        proc = self.spawn(name, *args)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(
                f"flwr run did not finish in {timeout} s:\n{self.log(name)[-4000:]}"
            ) from None
        out = self.log(name)
        assert proc.returncode == 0, out[-4000:]
        return out

    def alive(self) -> list[tuple[int, str]]:
        """Every process of this cluster still running: the ones spawned here and their descendants."""
        return _marked(self.token)

    def stop(self) -> None:
        """SIGTERM every process of the cluster, SIGKILL what is left after 15 s; reap the children."""
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            for pid, _ in self.alive():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while self.alive() and time.monotonic() < deadline:
                for p in self.procs:
                    p.poll()
                time.sleep(0.2)
            if not self.alive():
                break
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was sent
                pass


@pytest.fixture
def cluster(tmp_path, request):
    c = Cluster(tmp_path)
    request.addfinalizer(c.stop)
    c.start()
    return c


def _config(tmp_path: Path, **extra: object) -> str:
    items = {
        "ledger": f'"sqlite:///{tmp_path / "ledger.db"}"',
        "checkpoint": f'"{tmp_path / "checkpoint.npz"}"',
        "num-clients": NODES,
        **{k: str(v) for k, v in extra.items()},
    }
    return " ".join(f"{k}={v}" for k, v in items.items())


def _accountant_epsilon(rounds: int) -> float:
    # The run's event: the float-safe release accounts for sensitivity (1 + GRID_SLACK) C.
    return float(
        accountant("pld").compose(SubsampledGaussianEvent(Z / (1 + GRID_SLACK), Q), rounds).epsilon(DELTA)
    )


def _rounds(tmp_path: Path) -> list[str]:
    led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    return [r.idempotency_key for r in led.history("digits")]


def test_flwr_run_on_a_superlink_and_three_supernodes(cluster, tmp_path) -> None:
    out = cluster.flwr_run(
        _config(tmp_path, **{"num-server-rounds": 3}), stream=True, timeout=300, name="run"
    )
    assert "done: 3 rounds" in out, out[-4000:]
    assert _rounds(tmp_path) == ["digits#round=1", "digits#round=2", "digits#round=3"]
    led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    spent = led.spent("digits").epsilon
    assert spent == pytest.approx(_accountant_epsilon(3), rel=1e-12)
    assert f"epsilon {spent:.4f} at delta 1e-05" in out
    r, _, _ = load_checkpoint(tmp_path / "checkpoint.npz")
    assert r == 3
    # The ClientApps ran on the SuperNodes (one ClientApp process per message).
    assert all("flwr-clientapp" in cluster.log(f"supernode{i}") for i in range(NODES))
    cluster.stop()
    assert cluster.alive() == []


def _serverapp_pids(cluster: Cluster) -> list[int]:
    return [pid for pid, cmd in cluster.alive() if "/flwr-serverapp " in cmd]


def test_a_killed_serverapp_resumes_at_the_next_round(cluster, tmp_path) -> None:
    config = _config(tmp_path, **{"num-server-rounds": 2, "round-pause-s": 30.0})
    cluster.flwr_run(config, stream=False, timeout=60, name="submit")  # returns once the run started
    ck = tmp_path / "checkpoint.npz"
    deadline = time.monotonic() + 300
    while (saved := load_checkpoint(ck) if ck.exists() else None) is None or saved[0] < 1:
        assert time.monotonic() < deadline, cluster.log("superlink")[-4000:]
        time.sleep(0.2)
    # Round 1 is charged and saved; the ServerApp now pauses 30 s before round 2: kill it there.
    pids = _serverapp_pids(cluster)
    assert len(pids) == 1, cluster.alive()
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _serverapp_pids(cluster) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _rounds(tmp_path) == ["digits#round=1"]

    # Started again with the same ledger, run name and checkpoint, it continues at round 2.
    out = cluster.flwr_run(
        config.replace("round-pause-s=30.0", "round-pause-s=0.0"), stream=True, timeout=300, name="resume"
    )
    assert "rounds in the ledger: 1" in out and "done: 2 rounds" in out, out[-4000:]
    assert "round 2:" in out and "round 1:" not in out
    keys = _rounds(tmp_path)
    assert keys == ["digits#round=1", "digits#round=2"]  # none twice, none lost
    spent = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}").spent("digits").epsilon
    assert spent == pytest.approx(_accountant_epsilon(2), rel=1e-12)
    assert load_checkpoint(ck)[0] == 2
    cluster.stop()
    assert cluster.alive() == []


def test_a_killed_superlink_restarts_and_the_run_completes(cluster, tmp_path) -> None:
    """Issue 34: the SuperLink is killed after round 1 and started again on its database; the
    SuperNodes reconnect, a new ``flwr run`` continues from the ledger: each round charged once."""
    config = _config(tmp_path, **{"num-server-rounds": 3, "round-pause-s": 30.0})
    cluster.flwr_run(config, stream=False, timeout=60, name="submit")
    ck = tmp_path / "checkpoint.npz"
    deadline = time.monotonic() + 300
    while (saved := load_checkpoint(ck) if ck.exists() else None) is None or saved[0] < 1:
        assert time.monotonic() < deadline, cluster.log("superlink")[-4000:]
        time.sleep(0.2)
    link = cluster.procs[0]
    os.killpg(link.pid, signal.SIGKILL)  # the SuperLink and the SuperExec it started
    link.wait(timeout=10)
    # The run's ServerApp ends with its SuperExec (Flower 1.42); if it lingers, it is stopped here as
    # an operator would: its round 2 was never charged, so nothing is lost either way.
    deadline = time.monotonic() + 30
    while _serverapp_pids(cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in _serverapp_pids(cluster):
        os.kill(pid, signal.SIGKILL)
    assert _rounds(tmp_path) == ["digits#round=1"]

    cluster.start_superlink("superlink-restarted")
    out = cluster.flwr_run(
        config.replace("round-pause-s=30.0", "round-pause-s=0.0"), stream=True, timeout=300, name="resume"
    )
    assert "rounds in the ledger: 1" in out and "done: 3 rounds" in out, out[-4000:]
    assert "round 1:" not in out and "round 3:" in out
    assert _rounds(tmp_path) == ["digits#round=1", "digits#round=2", "digits#round=3"]
    spent = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}").spent("digits").epsilon
    assert spent == pytest.approx(_accountant_epsilon(3), rel=1e-12)
    assert load_checkpoint(ck)[0] == 3
    # the SuperNodes reconnected to the restarted SuperLink (its database kept their registration)
    assert all("Connection successful" in cluster.log(f"supernode{i}") for i in range(NODES))
    cluster.stop()
    assert cluster.alive() == []


README = EXAMPLE / "README.md"
README_PORTS = (9091, 9094, 9095, 9096)


def _readme_deployment_block() -> str:
    text = README.read_text()
    start = text.index("```bash\n", text.index("Deployment runtime")) + len("```bash\n")
    return text[start : text.index("```", start)]


def test_the_readmes_deployment_commands_run_as_written(tmp_path) -> None:
    """The README's block, verbatim, in a copy of the example folder: a SuperLink on its database,
    3 SuperNodes, ``flwr run``; it must exit 0 having printed ``done: 3 rounds`` and charged each
    round once."""
    import shutil

    for port in README_PORTS:  # the README's fixed ports
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                pytest.skip(f"port {port} of the README's commands is in use on this machine")
    app = tmp_path / "flower-digits"
    shutil.copytree(
        EXAMPLE, app, ignore=shutil.ignore_patterns(".flwr", "*.db", "*.log", "*.npz", "__pycache__")
    )
    token = uuid.uuid4().hex
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["FLWR_DISABLE_UPDATE_CHECK"] = "1"
    env["GAUSSDP_FLOWER_TEST"] = token
    with open(tmp_path / "readme.log", "wb") as log:
        proc = subprocess.Popen(
            ["bash", "-c", _readme_deployment_block()],
            cwd=app,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        rc = proc.wait(timeout=300)
        out = (tmp_path / "readme.log").read_text(errors="replace")
        assert rc == 0, out[-4000:]
        assert "done: 3 rounds" in out
        ledgers = sorted(app.rglob("gaussdp-digits-ledger.db"))
        assert len(ledgers) == 1, ledgers
        keys = [r.idempotency_key for r in Ledger(f"sqlite:///{ledgers[0]}").history("digits")]
        assert keys == ["digits#round=1", "digits#round=2", "digits#round=3"]
        spent = Ledger(f"sqlite:///{ledgers[0]}").spent("digits").epsilon
        assert spent == pytest.approx(_accountant_epsilon(3), rel=1e-12)
    finally:
        for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
            for pid, _ in _marked(token):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while _marked(token) and time.monotonic() < deadline:
                time.sleep(0.2)
        proc.poll()
    assert _marked(token) == []
