"""``gaussdp audit``: consistent for the default release, refutes a broken one."""

from __future__ import annotations

from typer.testing import CliRunner

from gaussdp.cli import build_app


def test_audit_command():
    runner = CliRunner()
    app = build_app()
    ok = runner.invoke(app, ["audit", "--samples", "100000"])
    assert ok.exit_code == 0, ok.output
    assert "consistent" in ok.output
    naive = runner.invoke(app, ["audit", "--path", "naive", "--samples", "100000"])
    assert naive.exit_code == 0 and "refuted" in naive.output
    bad = runner.invoke(app, ["audit", "--delta", "2"])
    assert bad.exit_code == 2 and "delta" in bad.output
