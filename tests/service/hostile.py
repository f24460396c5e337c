"""A real ``gaussdp serve`` to attack (issue 29): a tiny LM, a LoRA adapter, fine-tuning routes, and
the limits under test given as ``GAUSSDP_*`` variables (a server without them, e.g. an older
gaussdp, starts all the same and shows what the limits prevent).

A plain module (not conftest), imported by name as :mod:`ftserver` is.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import websockets


@dataclass
class HostileTarget:
    url: str
    db: str
    root: Path
    proc: Any
    log_path: Path
    model_dir: Path
    adapter_dir: Path

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1)

    def rss_bytes(self) -> int:
        """The server process's resident memory (VmRSS)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def key(self, tenant: str, scope: str = "release") -> str:
        from gaussdp.budget import Ledger
        from gaussdp.service.keys import create_api_key

        with Ledger(self.db) as ledger:
            return create_api_key(ledger.store, tenant, scope=scope)

    def revoke(self, key: str) -> None:
        from gaussdp.budget import Ledger
        from gaussdp.service.keys import key_id_of

        with Ledger(self.db) as ledger:
            assert ledger.store.revoke_api_key(key_id_of(key))

    def charges(self, tenant: str, session_id: str) -> int:
        from gaussdp.budget import Ledger

        with Ledger(self.db) as ledger:
            return sum(ledger.store.groups(f"{tenant}/{session_id}").values())

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout=20)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)


def start_target(root: Path, limits: dict[str, str], timeout: float = 120.0) -> HostileTarget:
    import httpx
    from ftserver import _free_port, subprocess_env

    from gaussdp.budget import Ledger
    from tiny_served import save_tiny_lm

    model_dir, adapter_dir = save_tiny_lm(root)
    db = f"sqlite:///{root / 'ledger.db'}"
    Ledger(db).close()  # migrated once, before the server starts
    port = _free_port()
    cmd = [
        sys.executable, "-m", "gaussdp.cli", "serve", "--db", db, "--port", str(port),
        "--model", f"tiny={model_dir}", "--adapter", f"ad={adapter_dir}",
        "--data-dir", str(root / "data"), "--finetune-workers", "0",
    ]  # fmt: skip
    log_path = root / "serve.log"
    env = {**subprocess_env(), "PYTHONUNBUFFERED": "1", **limits}
    log = open(log_path, "wb")  # the server writes it until it stops
    proc = subprocess.Popen(
        cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    target = HostileTarget(url, db, root, proc, log_path, model_dir, adapter_dir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gaussdp serve exited: {target.log()[-3000:]}")
        try:
            if httpx.get(url + "/healthz", timeout=1.0).status_code == 200:
                return target
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    target.stop()
    raise RuntimeError(f"gaussdp serve did not answer in {timeout} s: {target.log()[-3000:]}")


def session(target: HostileTarget, key: str, epsilon: float = 50.0) -> str:
    import httpx

    r = httpx.post(
        target.url + "/v1/sessions",
        json={"epsilon": epsilon, "delta": 1e-5},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert r.status_code == 201, r.text
    return str(r.json()["session_id"])


START = {"model": "tiny", "prompt_ids": [1, 2, 3], "noise_multiplier": 8.0, "stop_at_eos": False}


def open_stream(target: HostileTarget, key: str, sid: str, **start: Any) -> Any:
    """A connected stream whose start message was sent (the ``start`` answer is not read)."""
    from websockets.sync.client import connect

    ws = connect(
        f"{target.ws_url}/v1/sessions/{sid}/generate",
        additional_headers={"Authorization": f"Bearer {key}"},
        open_timeout=30,
        close_timeout=2,
    ).__enter__()
    try:  # a refused stream (no slot left) may be closed before its start message is read
        ws.send(json.dumps({**START, **start}))
    except (websockets.exceptions.ConnectionClosed, OSError):
        pass
    return ws


def first_message(ws: Any) -> dict[str, Any]:
    """The stream's first message; on a refusal, also waits for the close (its code in ``close_code``)."""
    try:
        message = json.loads(ws.recv(timeout=30))
    except websockets.exceptions.ConnectionClosed:
        return {"type": "closed"}
    if message["type"] == "error":
        with contextlib.suppress(websockets.exceptions.ConnectionClosed):
            ws.recv(timeout=10)
    return dict(message)


_PROBE = """
import json, sys, threading, time
import httpx
url, done = sys.argv[1], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
latencies = []
with httpx.Client(timeout=30) as client:
    while not done.is_set():
        t0 = time.perf_counter()
        assert client.get(url + "/healthz").status_code == 200
        latencies.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.01)
print(json.dumps(latencies))
"""


class HealthProbe:
    """``GET /healthz`` every 10 ms from another process (the test's own threads do not compete
    with it for a GIL), until :meth:`stop`, which returns the latencies in ms."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PROBE, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def stop(self) -> list[float]:
        out, _ = self.proc.communicate("", timeout=60)
        assert self.proc.returncode == 0, out
        return list(json.loads(out))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
