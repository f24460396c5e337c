"""Fixtures for the service tests: an app over a fresh SQLite ledger, and API keys for two tenants."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")


@dataclass
class Service:
    app: object
    ledger: object
    key_a: str
    key_b: str

    def headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def service(tmp_path) -> Iterator[Service]:  # type: ignore[no-untyped-def]
    from gaussdp.budget import Ledger
    from gaussdp.service.app import create_app
    from gaussdp.service.keys import create_api_key

    with Ledger(f"sqlite:///{tmp_path / 'service.db'}") as ledger:
        app = create_app(ledger=ledger, max_body_bytes=64 * 1024)
        yield Service(
            app, ledger, create_api_key(ledger.store, "tenant-a"), create_api_key(ledger.store, "tenant-b")
        )


@pytest.fixture
def client(service: Service):  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    with TestClient(service.app) as c:
        yield c


# -- fine-tuning: a real `gaussdp serve` (or `gaussdp worker`) in a subprocess -----------------------
@dataclass
class FtServer:
    """A `gaussdp serve --data-dir` subprocess (its own process group: its workers die with it)."""

    url: str
    proc: object
    db: str
    data_dir: object
    log: object

    def kill(self) -> None:
        import os
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)  # type: ignore[attr-defined]

    def stop(self) -> None:
        import os
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)  # type: ignore[attr-defined]
            self.proc.wait(timeout=30)  # type: ignore[attr-defined]
        except ProcessLookupError:
            pass
        except Exception:
            self.kill()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def subprocess_env() -> dict[str, str]:
    """The environment of a gaussdp subprocess: this checkout's source first, no inherited GAUSSDP_*."""
    import os
    from pathlib import Path

    import gaussdp

    env = {k: v for k, v in os.environ.items() if not k.startswith("GAUSSDP_")}
    src = str(Path(gaussdp.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["OMP_NUM_THREADS"] = "1"
    return env


def start_ft_server(db, data_dir, model_dir, log_path, *, lease_s=60.0, workers=1, timeout=120.0) -> FtServer:  # type: ignore[no-untyped-def]
    """Start `gaussdp serve --data-dir ... --model tiny=...` and wait until /healthz answers."""
    import subprocess
    import sys
    import time

    import httpx

    port = _free_port()
    cmd = [
        sys.executable, "-m", "gaussdp.cli", "serve", "--db", db, "--port", str(port),
        "--data-dir", str(data_dir), "--model", f"tiny={model_dir}",
        "--finetune-workers", str(workers), "--finetune-lease-s", str(lease_s),
    ]  # fmt: skip
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env=subprocess_env(), start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"gaussdp serve exited with {proc.returncode}: {open(log_path).read()[-3000:]}"
            )
        try:
            if httpx.get(url + "/healthz", timeout=1.0).status_code == 200:
                return FtServer(url, proc, db, data_dir, log_path)
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server = FtServer(url, proc, db, data_dir, log_path)
    server.kill()
    raise RuntimeError(f"gaussdp serve did not answer in {timeout} s: {open(log_path).read()[-3000:]}")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A tiny causal LM (and tokenizer) saved to a directory, as `gaussdp serve --model` takes it."""
    finetune = pytest.importorskip("gaussdp.finetune")
    return finetune.tiny_causal_lm(tmp_path_factory.mktemp("tiny-lm"))


@pytest.fixture(scope="session")
def perturbed_corpus():  # type: ignore[no-untyped-def]
    """(text, sigma, vocabulary id): gensim's Lee corpus perturbed word by word with the page's
    mechanism (Gaussian, the shipped vocabulary), one record per line."""
    from pathlib import Path

    gensim = pytest.importorskip("gensim")
    from gaussdp.service.finetune import vocabulary_id
    from gaussdp.text import GaussianWordMechanism, perturb_text
    from gaussdp.text.corpus import shipped_vocabulary

    lee = Path(gensim.__file__).parent / "test" / "test_data" / "lee_background.cor"
    lines = lee.read_text(encoding="utf-8").splitlines()[:160]
    vocab = shipped_vocabulary()
    sigma = 0.5
    out = perturb_text("\n".join(lines), GaussianWordMechanism(vocab, sigma=sigma))
    return out.text, sigma, vocabulary_id(vocab)


@pytest.fixture
def ft_tools():  # type: ignore[no-untyped-def]
    """The helpers above, for test modules (conftest functions are not importable)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        start_ft_server=start_ft_server, subprocess_env=subprocess_env, free_port=_free_port
    )
