"""``gaussdp dp-sgd`` trains on the bundled digits and reports the epsilon it spent."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("torch")
typer_testing = pytest.importorskip("typer.testing")


def test_dp_sgd_command_reports_epsilon_within_target():
    from gaussdp.cli import build_app

    result = typer_testing.CliRunner().invoke(build_app(), ["dp-sgd", "--epsilon", "4", "--epochs", "2"])
    assert result.exit_code == 0, result.output
    m = re.search(r"test accuracy ([0-9.]+), epsilon spent ([0-9.]+)", result.output)
    assert m is not None, result.output
    accuracy, eps = float(m.group(1)), float(m.group(2))
    assert 0 < eps <= 4.0 * (1 + 1e-6)
    assert accuracy > 0.3  # 10 classes: chance is 0.1
