"""``gaussdp keys``, ``gaussdp ledger show`` and ``gaussdp serve`` (a real process, SQLite in the cwd)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")


def test_keys_and_ledger_commands(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gaussdp.budget import Budget, Ledger
    from gaussdp.cli import build_app

    app, runner, db = build_app(), CliRunner(), f"sqlite:///{tmp_path / 'l.db'}"
    r = runner.invoke(app, ["keys", "create", "acme", "--db", db])
    assert r.exit_code == 0, r.output
    key = r.stdout.splitlines()[0] if hasattr(r, "stdout") else r.output.splitlines()[0]
    assert key.startswith("gdp_")
    listed = runner.invoke(app, ["keys", "list", "--db", db]).output
    assert "acme" in listed and key not in listed
    assert runner.invoke(app, ["keys", "create", "bad/tenant", "--db", db]).exit_code == 2
    with Ledger(db) as ledger:
        ledger.open("acme/s1", Budget(1.0, 1e-5))
        assert {r.tenant for r in ledger.store.list_api_keys()} == {"acme"}
    shown = runner.invoke(app, ["ledger", "show", "--db", db])
    assert shown.exit_code == 0 and "acme/s1" in shown.output
    key_id = key.split("_")[1]
    assert runner.invoke(app, ["keys", "revoke", key_id, "--db", db]).exit_code == 0
    assert "revoked" in runner.invoke(app, ["keys", "list", "--db", db]).output
    assert runner.invoke(app, ["keys", "revoke", "nope", "--db", db]).exit_code == 2


@pytest.mark.slow
def test_serve_starts_on_sqlite_in_the_working_directory(tmp_path: Path) -> None:
    from gaussdp.budget import Ledger
    from gaussdp.service.keys import create_api_key

    with Ledger(f"sqlite:///{tmp_path / 'gaussdp-ledger.db'}") as ledger:  # what `gaussdp keys create` does
        key = create_api_key(ledger.store, "acme")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-c", "from gaussdp.cli import main; main()", "serve", "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        assert httpx.get(base + "/docs").status_code == 200
        h = {"Authorization": f"Bearer {key}"}
        r = httpx.post(base + "/v1/sessions", json={"epsilon": 1.0, "delta": 1e-5}, headers=h)
        assert r.status_code == 201, r.text
        sid = r.json()["session_id"]
        r = httpx.post(
            base + f"/v1/sessions/{sid}/release", json={"vector": [1.0, 2.0], "sigma": 50.0}, headers=h
        )
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=20)
    with Ledger(f"sqlite:///{tmp_path / 'gaussdp-ledger.db'}") as ledger:
        assert len(ledger.history(f"acme/{sid}")) == 1
