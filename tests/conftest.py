"""Fixtures shared across test folders: a real ``gaussdp serve`` subprocess with a tiny LM (issue 20)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tiny_served import save_tiny_lm


@dataclass
class ServedLM:
    """``gaussdp serve --model tiny=... --adapter ad=...`` on a free port, with a ``release`` key."""

    url: str
    key: str
    db: str
    model_dir: Path
    adapter_dir: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1)


@pytest.fixture(scope="session")
def served_lm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedLM]:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    pytest.importorskip("websockets")
    import httpx

    from gaussdp.budget import Ledger
    from gaussdp.service.keys import create_api_key

    root = tmp_path_factory.mktemp("served_lm")
    model_dir, adapter_dir = save_tiny_lm(root)
    db = f"sqlite:///{root / 'ledger.db'}"
    with Ledger(db) as ledger:
        key = create_api_key(ledger.store, "acme")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    args = [
        "serve",
        "--db",
        db,
        "--port",
        str(port),
        "--model",
        f"tiny={model_dir}",
        "--adapter",
        f"ad={adapter_dir}",
    ]
    import gaussdp

    # the gaussdp under test (a relative PYTHONPATH would not hold in the server's directory)
    pythonpath = os.pathsep.join(
        [str(Path(gaussdp.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    )
    log = open(root / "serve.log", "wb")  # a file, not a pipe: nobody reads a pipe, and a full one blocks
    proc = subprocess.Popen(
        [sys.executable, "-c", "from gaussdp.cli import main; main()", *args],
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(url + "/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"gaussdp serve did not start: {(root / 'serve.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield ServedLM(url, key, db, model_dir, adapter_dir)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
