"""A real ``gaussdp serve --data-dir`` (or ``gaussdp worker``) in a subprocess, for the fine-tuning tests.

A plain module (not conftest): test modules import it by name, and a second ``conftest`` module
(tests/conftest.py) would shadow ``from conftest import ...``.
"""

from __future__ import annotations

from dataclasses import dataclass


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


def start_ft_server(
    db, data_dir, model_dir, log_path, *, lease_s=60.0, workers=1, timeout=120.0, extra_args=()
) -> FtServer:  # type: ignore[no-untyped-def]
    """Start `gaussdp serve --data-dir ... --model tiny=...` and wait until /healthz answers."""
    import subprocess
    import sys
    import time

    import httpx

    port = _free_port()
    cmd = [
        sys.executable, "-m", "gaussdp.cli", "serve", "--db", db, "--port", str(port),
        "--data-dir", str(data_dir), "--model", f"tiny={model_dir}",
        "--finetune-workers", str(workers), "--finetune-lease-s", str(lease_s), *extra_args,
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
