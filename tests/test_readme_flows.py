"""README's service flows, run as written: the ``console`` commands, then the ``python`` block.

Each flow is a ``<!-- readme-flow: NAME -->`` marker followed by one ``console`` block (``$ ``
commands, run in order in a fresh directory; ``gaussdp serve`` is started in the background and
stopped at the end) and one ``python`` block, run with two substitutions a reader makes too: the
API key printed by ``gaussdp keys create`` for ``gdp_...``, and the server's port for 8000. The
data owner's ``notes.txt`` is real text: gensim's Lee corpus (news articles shipped with gensim).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")

pytestmark = pytest.mark.slow


def _flow(name: str) -> tuple[list[str], str]:
    start = README.index(f"<!-- readme-flow: {name} -->")
    console = re.search(r"```console\n(.*?)```", README[start:], flags=re.S)
    python = re.search(r"```python\n(.*?)```", README[start:], flags=re.S)
    assert console and python, f"flow {name}: a console block and a python block"
    commands = [
        line[2:].split("  #")[0].strip() for line in console.group(1).splitlines() if line.startswith("$ ")
    ]
    return commands, python.group(1)


def _env() -> dict[str, str]:
    import gaussdp

    env = {k: v for k, v in os.environ.items() if not k.startswith("GAUSSDP_")}
    src = str(Path(gaussdp.__file__).resolve().parents[1])
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["COLUMNS"] = "200"
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gaussdp(command: str) -> list[str]:
    argv = shlex.split(command)
    assert argv[0] == "gaussdp", command
    return [sys.executable, "-m", "gaussdp.cli", *argv[1:]]


def _run_flow(name: str, cwd: Path, timeout_s: float) -> str:
    pytest.importorskip("gaussdp.client")
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    commands, code = _flow(name)
    env, port, key = _env(), _port(), None
    server = None
    log = open(cwd / "serve.log", "wb")
    try:
        for command in commands:
            argv = _gaussdp(command)
            if argv[3] == "serve":
                server = subprocess.Popen(
                    [*argv, "--port", str(port)],
                    cwd=cwd,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                continue
            done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
            if argv[3:5] == ["keys", "create"]:
                key = re.search(r"gdp_[A-Za-z0-9_\-]+", done.stdout).group(0)  # type: ignore[union-attr]
        assert server is not None and key is not None
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, (cwd / "serve.log").read_text()[-3000:]
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                assert time.monotonic() < deadline, "gaussdp serve did not listen"
                time.sleep(0.3)
        script = code.replace('"gdp_..."', repr(key)).replace("127.0.0.1:8000", f"127.0.0.1:{port}")
        ran = subprocess.run(
            [sys.executable, "-c", script],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        assert ran.returncode == 0, ran.stderr[-3000:] + (cwd / "serve.log").read_text()[-3000:]
        return ran.stdout
    finally:
        if server is not None:
            try:
                os.killpg(server.pid, signal.SIGTERM)
                server.wait(timeout=30)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(timeout=30)
        log.close()


def test_readme_inference_flow(tmp_path: Path) -> None:
    pytest.importorskip("openai")  # the flow shows the official OpenAI client too
    out = _run_flow("inference", tmp_path, timeout_s=300)
    assert re.search(r"openai: .* \(\d+ chunks\)", out), out  # the OpenAI client streamed
    spent = float(re.search(r"spent epsilon ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert 0 < spent <= 8.0, out


def test_readme_finetune_flow(tmp_path: Path) -> None:
    gensim = pytest.importorskip("gensim")
    lee = Path(gensim.__file__).parent / "test" / "test_data" / "lee_background.cor"
    (tmp_path / "notes.txt").write_text(
        "\n".join(lee.read_text(encoding="utf-8").splitlines()[:200]) + "\n", encoding="utf-8"
    )
    out = _run_flow("finetune", tmp_path, timeout_s=600)
    printed = float(re.search(r"succeeded epsilon ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    import json

    privacy = json.loads((tmp_path / "adapter" / "gaussdp_privacy.json").read_text(encoding="utf-8"))
    central = privacy["central_dp"]
    assert central["epsilon"] <= 4.0 and round(central["epsilon"], 3) == printed  # the card's = the job's
    assert central["delta"] == 1e-5 and central["accountant"] == "pld"
    assert privacy["local_dp"]["mechanism"] == "gaussian" and privacy["local_dp"]["sigma"] == 0.5
    card = (tmp_path / "adapter" / "README.md").read_text(encoding="utf-8")
    assert f"{central['noise_multiplier']:.4g}" in card or "noise multiplier" in card.lower()
    # the adapter loads with peft onto the base model the service trained
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base-lm", local_files_only=True)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert any("lora_" in n for n, _ in model.named_parameters())


def test_readme_text_page_flow(tmp_path: Path) -> None:
    """`gaussdp serve --text-vocab` serves the vocabulary it names on the /text page."""
    gensim = pytest.importorskip("gensim")
    lee = Path(gensim.__file__).parent / "test" / "test_data" / "lee_background.cor"
    (tmp_path / "notes.txt").write_text(lee.read_text(encoding="utf-8"), encoding="utf-8")
    out = _run_flow("text-page", tmp_path, timeout_s=120)
    n = int(re.search(r"page vocabulary (\d+) words", out).group(1))  # type: ignore[union-attr]
    from gaussdp.text.corpus import shipped_vocabulary

    assert n != len(shipped_vocabulary().words), out  # not the demo vocabulary
