"""``gaussdp federated-demo``: runs, prints epsilon per round, writes the PNG and the ledger."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")


def test_federated_demo_command(tmp_path) -> None:
    from typer.testing import CliRunner

    from gaussdp.cli import build_app

    result = CliRunner().invoke(
        build_app(),
        ["federated-demo", "--rounds", "3", "--accountant", "rdp", "--out-dir", str(tmp_path)],
    )
    assert result.exit_code == 0, result.output
    eps = [float(x) for x in re.findall(r"epsilon\s+(\d+\.\d+)\s*$", result.output, flags=re.M)]
    assert len(eps) == 3 and eps == sorted(eps)
    assert "resumes at round 4" in result.output
    assert (tmp_path / "federated.png").stat().st_size > 1000
    assert (tmp_path / "federated_ledger.db").exists()


def test_federated_demo_stops_at_the_budget(tmp_path) -> None:
    from gaussdp.cli.federated import run_demo

    res = run_demo(rounds=40, target_epsilon=2.0, accountant="rdp", out_dir=tmp_path, plot=False)
    assert res.stopped is not None and "stopping before round" in res.stopped
    assert res.epsilon <= 2.0 and len(res.rounds) < 40
