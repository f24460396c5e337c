"""Fixtures shared across test folders: a real ``gaussdp serve`` subprocess with a tiny LM (issue 20)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
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


@contextlib.contextmanager
def serve_subprocess(root: Path, args: list[str], *, prelude: str = "") -> Iterator[str]:
    """``gaussdp serve ARGS --port <free>`` in a subprocess (log in ``root/serve.log``); yields its URL.

    ``prelude``: Python run in the server process before the CLI (the fault-injection tests patch
    the privatizer there); stopped with SIGINT at the end.
    """
    import httpx

    import gaussdp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    # the gaussdp under test (a relative PYTHONPATH would not hold in the server's directory)
    pythonpath = os.pathsep.join(
        [str(Path(gaussdp.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    )
    log = open(root / "serve.log", "wb")  # a file, not a pipe: nobody reads a pipe, and a full one blocks
    code = f"{prelude}\nfrom gaussdp.cli import main; main()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "serve", *args, "--port", str(port)],
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
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def served_lm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedLM]:
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    pytest.importorskip("websockets")
    from gaussdp.budget import Ledger
    from gaussdp.service.keys import create_api_key

    root = tmp_path_factory.mktemp("served_lm")
    model_dir, adapter_dir = save_tiny_lm(root)
    db = f"sqlite:///{root / 'ledger.db'}"
    with Ledger(db) as ledger:
        key = create_api_key(ledger.store, "acme")
    args = ["--db", db, "--model", f"tiny={model_dir}", "--adapter", f"ad={adapter_dir}"]
    with serve_subprocess(root, args) as url:
        yield ServedLM(url, key, db, model_dir, adapter_dir)


@pytest.fixture(scope="session")
def serve_gaussdp() -> Callable[..., contextlib.AbstractContextManager[str]]:
    """:func:`serve_subprocess`, for test modules that start a server of their own."""
    return serve_subprocess
