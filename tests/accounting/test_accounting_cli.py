"""``gaussdp account`` prints epsilon (or the noise for a target) with the accountant named."""

from __future__ import annotations

import re

import pytest

typer_testing = pytest.importorskip("typer.testing")


@pytest.fixture(scope="module")
def app():
    from gaussdp.cli import build_app

    return build_app()


def test_account_prints_epsilon_and_accountant(app):
    res = typer_testing.CliRunner().invoke(
        app,
        [
            "account",
            "--noise-multiplier",
            "1.1",
            "--sample-rate",
            "0.004267",
            "--steps",
            "14063",
            "--delta",
            "1e-5",
            "--accountant",
            "rdp",
        ],
    )
    assert res.exit_code == 0, res.output
    eps = float(re.search(r"epsilon = ([0-9.]+)", res.output).group(1))
    assert 2.55 < eps < 2.65 and "accountant=rdp" in res.output


def test_account_target_epsilon_prints_noise(app):
    res = typer_testing.CliRunner().invoke(
        app, ["account", "--sample-rate", "0.01", "--steps", "100", "--target-epsilon", "2"]
    )
    assert res.exit_code == 0, res.output
    assert "noise multiplier =" in res.output and "accountant=pld" in res.output


def test_account_bad_input_is_a_clear_error(app):
    res = typer_testing.CliRunner().invoke(app, ["account", "--noise-multiplier", "1", "--delta", "2"])
    assert res.exit_code == 2 and "delta" in res.output


def test_account_plot(app, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr("gaussdp.cli.accounting._ALL", ("pld", "rdp", "gdp"))  # keep the test fast
    out = tmp_path / "eps.png"
    res = typer_testing.CliRunner().invoke(
        app,
        [
            "account",
            "--noise-multiplier",
            "1.0",
            "--sample-rate",
            "0.01",
            "--steps",
            "30",
            "--plot",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
