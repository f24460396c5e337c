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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_up(url: str, proc: subprocess.Popen, **kwargs: object) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/healthz", **kwargs).status_code == 200:  # type: ignore[arg-type]
                return
        except httpx.TransportError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


@pytest.mark.slow
def test_serve_with_workers_tls_and_environment_configuration(tmp_path: Path) -> None:
    """`gaussdp serve --workers 2` over HTTPS, configured by GAUSSDP_* variables; SIGTERM stops it."""
    import shutil

    from gaussdp.budget import Ledger
    from gaussdp.service.keys import create_api_key

    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a self-signed certificate")
    cert, key_file = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            str(key_file),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    with Ledger(db) as ledger:
        key = create_api_key(ledger.store, "acme", scope="admin")
    port = _free_port()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "GAUSSDP_DB": db,
        "GAUSSDP_PORT": str(port),
        "GAUSSDP_WORKERS": "2",
        "GAUSSDP_SSL_CERTFILE": str(cert),
        "GAUSSDP_SSL_KEYFILE": str(key_file),
        "GAUSSDP_MAX_BODY_BYTES": "2048",
        "GAUSSDP_TEXT": "off",
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", "from gaussdp.cli import main; main()", "serve"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    base = f"https://127.0.0.1:{port}"
    try:
        _wait_up(base, proc, verify=False)
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/healthz")  # TLS only
        h = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=base, verify=False, headers=h) as c:
            assert (
                c.post("/v1/sessions", json={"epsilon": 5.0, "delta": 1e-5, "session_id": "s"}).status_code
                == 201
            )
            for _ in range(6):  # over both workers
                assert (
                    c.post("/v1/sessions/s/release", json={"vector": [1.0], "sigma": 50.0}).status_code == 200
                )
            assert (
                c.post("/v1/sessions/s/release", json={"vector": [1.0] * 1000, "sigma": 50.0}).status_code
                == 413
            )
            assert c.get("/text/guarantee", params={"sigma": 1.0}).status_code == 404  # GAUSSDP_TEXT=off
            assert c.get("/metrics").status_code == 200
        pids = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(pids) >= 2, pids  # the worker processes
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0].decode(errors="replace")
    assert "with 2 worker(s)" in out, out
    with Ledger(db) as ledger:
        assert len(ledger.history("acme/s")) == 6


def test_serve_refuses_limits_that_do_not_make_sense(tmp_path: Path) -> None:
    """The limits against hostile clients are checked before the server listens (exit 2, named)."""
    from typer.testing import CliRunner

    from gaussdp.cli import build_app

    db = f"sqlite:///{tmp_path / 'l.db'}"
    saved = {k: v for k, v in os.environ.items() if k.startswith("GAUSSDP_")}
    try:
        for args, named in [
            (["--max-stream-s", "-1"], "max_stream_s"),
            (["--stream-idle-s", "0"], "stream_idle_s"),
            (["--ckks-tenant-memory-bytes", str(1 << 40)], "ckks_tenant_memory_bytes"),
        ]:
            for name in [k for k in os.environ if k.startswith("GAUSSDP_")]:
                del os.environ[name]  # serve hands its options to its workers in GAUSSDP_*
            r = CliRunner().invoke(build_app(), ["serve", "--db", db, *args])
            assert r.exit_code == 2 and named in r.output, (args, r.output)
    finally:
        for name in [k for k in os.environ if k.startswith("GAUSSDP_")]:
            del os.environ[name]
        os.environ.update(saved)
