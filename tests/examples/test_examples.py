"""Smoke tests of the example gallery: each script runs on small data and prints epsilon and accuracy.

Fast settings through each script's own options (one epoch, a few hundred records); the printed
epsilon must be a real spend within the target and the accuracy a fraction. Accuracy bars are not
asserted: a single noisy run on a few hundred records is too variable for one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

pytest.importorskip("torch")
pytest.importorskip("sklearn")


def run(script: str, *args: str, timeout: int = 300) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_training(out: dict[str, object], target: float) -> None:
    eps, acc = float(out["epsilon"]), float(out["test_accuracy"])  # type: ignore[arg-type]
    assert 0.5 * target < eps <= target * (1 + 1e-6)  # the target is spent, never exceeded
    assert float(out["noise_multiplier"]) > 0  # type: ignore[arg-type]
    assert 0.0 <= acc <= 1.0


@pytest.mark.slow
def test_digits_cnn() -> None:
    out = run("digits_cnn.py", "--epochs", "1", "--limit", "400", "--epsilon", "2")
    check_training(out, 2.0)


@pytest.mark.slow
def test_digits_groupnorm_cnn_refuses_batchnorm_then_trains_groupnorm() -> None:
    out = run("digits_groupnorm_cnn.py", "--epochs", "1", "--limit", "400", "--epsilon", "2")
    check_training(out, 2.0)
    assert out["problems_found"] == 2 and out["groupnorm_layers"] == 2


@pytest.mark.slow
def test_text_attention_classifier() -> None:
    pytest.importorskip("gensim")
    out = run("text_attention_classifier.py", "--epochs", "1", "--per-class", "150", "--epsilon", "4")
    check_training(out, 4.0)
    assert out["train_records"] == 240


@pytest.mark.slow
def test_service_client_against_a_server_it_starts() -> None:
    pytest.importorskip("fastapi")
    out = run("service_client.py", "--contributors", "30", "--test", "50", "--epsilon", "4")
    assert out["contributors"] == 30
    assert 3.99 < float(out["epsilon_per_contributor"]) <= 4.0  # type: ignore[arg-type]
    assert (out["second_request_status"], out["second_request_error"]) == (409, "budget_exhausted")
    assert 0.0 <= float(out["test_accuracy"]) <= 1.0  # type: ignore[arg-type]
