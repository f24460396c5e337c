"""``gaussdp finetune``: plan printed before training, adapter and card written (in a fresh process),
--json for scripts, exit code 2 and nothing written on bad arguments (in process: each fresh process
pays seconds of torch/transformers imports)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")


def gaussdp(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "gaussdp.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def cli(*args: str) -> tuple[int, str, str]:
    """Run the CLI in this process: ``(exit code, stdout, stderr)``."""
    typer_testing = pytest.importorskip("typer.testing")
    from gaussdp.cli import build_app

    r = typer_testing.CliRunner().invoke(build_app(), list(args))
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture(scope="module")
def corpus(lee_lines, tmp_path_factory):
    p = tmp_path_factory.mktemp("corpus") / "lee.txt"
    p.write_text("\n".join(lee_lines[:40]) + "\n", encoding="utf-8")
    return p


@pytest.mark.slow  # a fresh process imports torch, transformers and peft: 10-30 s on a shared machine
def test_finetune_prints_the_plan_then_writes_the_adapter(tiny_model_dir, corpus, tmp_path):
    from gaussdp.finetune import ADAPTER_FILES, FinetuneConfig, epsilon_text, plan_finetune

    out = tmp_path / "adapter"
    local = tmp_path / "local_dp.json"
    local.write_text(json.dumps({"mechanism": "gaussian", "sigma": 0.5}))
    res = gaussdp(
        "finetune", str(corpus), "--model", str(tiny_model_dir), "--epsilon", "6", "--delta", "1e-4",
        "--out", str(out), "--batch-size", "20", "--max-seq-len", "16", "--local-dp", str(local),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    plan = plan_finetune(
        FinetuneConfig(target_epsilon=6.0, delta=1e-4, batch_size=20, max_seq_len=16), n_records=40
    )
    lines = res.stdout.splitlines()
    assert lines[0].startswith("plan: 40 records, 1 epoch(s) = 2 steps")
    assert f"epsilon = {epsilon_text(plan.epsilon)} at delta = 0.0001 (pld accountant" in lines[2]
    assert f"model card: {out / 'README.md'}" in res.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(ADAPTER_FILES)
    info = json.loads((out / "gaussdp_privacy.json").read_text())
    assert info["central_dp"]["epsilon"] == plan.epsilon and info["local_dp"] == {
        "mechanism": "gaussian",
        "sigma": 0.5,
    }
    assert info["corpus_name"] == "lee.txt"


def test_finetune_json(tiny_model_dir, corpus, tmp_path):
    code, stdout, stderr = cli(
        "finetune", str(corpus), "--model", str(tiny_model_dir), "--noise-multiplier", "1.5",
        "--delta", "1e-5", "--out", str(tmp_path / "a"), "--batch-size", "40", "--max-seq-len", "16",
        "--epochs", "2", "--rank", "2", "--target-modules", "c_attn", "--json",
    )  # fmt: skip
    assert code == 0, stderr
    d = json.loads(stdout)
    assert d["steps"] == d["plan"]["steps"] == 2 and d["plan"]["noise_multiplier"] == 1.5
    assert d["epsilon"] == d["plan"]["epsilon"] and d["private"] is True
    assert Path(d["model_card"]).is_file()
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["r"] == 2 and cfg["target_modules"] == ["c_attn"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--epsilon", "4", "--delta", "2"), "delta"),
        (("--epsilon", "4", "--noise-multiplier", "1", "--delta", "1e-5"), "exactly one of"),
        (("--delta", "1e-5"), "exactly one of"),
        (("--epsilon", "4", "--delta", "1e-5", "--rank", "0"), "lora_rank"),
        (("--epsilon", "4", "--delta", "1e-5", "--clip-norm", "nan"), "clip_norm"),
    ],
)
def test_bad_arguments_exit_2_and_write_nothing(tiny_model_dir, corpus, tmp_path, args, named):
    out = tmp_path / "never"
    code, _, stderr = cli("finetune", str(corpus), "--model", str(tiny_model_dir), "--out", str(out), *args)
    assert code == 2 and named in " ".join(stderr.split()) and not out.exists()


def test_bad_local_dp_declaration_exits_2_before_training(tiny_model_dir, corpus, tmp_path):
    local = tmp_path / "local.json"
    local.write_text('["gaussian"]')
    out = tmp_path / "never"
    code, _, stderr = cli(
        "finetune", str(corpus), "--model", str(tiny_model_dir), "--epsilon", "4", "--delta", "1e-5",
        "--out", str(out), "--local-dp", str(local),
    )  # fmt: skip
    assert code == 2 and "local_dp must be a dict" in stderr and "plan:" not in stderr and not out.exists()


def test_bad_corpus_and_model_exit_2(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    common = ("--epsilon", "4", "--delta", "1e-5", "--out", str(tmp_path / "o"))
    code, _, stderr = cli("finetune", str(bad), "--model", str(tiny_model_dir), *common)
    assert code == 2 and "line 2" in stderr
    good = tmp_path / "good.txt"
    good.write_text("a line\n")
    code, _, stderr = cli("finetune", str(good), "--model", str(tmp_path / "nomodel"), *common)
    assert code == 2 and "model_path" in stderr and not (tmp_path / "o").exists()
