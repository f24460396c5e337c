"""``gaussdp info``: versions, extras, noise back ends (C kernel built or not), accountants; --json."""

from __future__ import annotations

import importlib.metadata
import json
import sys

import pytest

typer_testing = pytest.importorskip("typer.testing")


@pytest.fixture(scope="module")
def app():
    from gaussdp.cli import build_app

    return build_app()


def _info(app, *args: str):
    res = typer_testing.CliRunner().invoke(app, ["info", *args])
    assert res.exit_code == 0, res.output
    return res


def test_info_json_reports_versions_extras_noise_and_accountants(app) -> None:
    import gaussdp

    data = json.loads(_info(app, "--json").stdout)
    assert data["gaussdp"] == gaussdp.__version__
    assert data["packages"]["numpy"] == importlib.metadata.version("numpy")
    assert data["extras"]["cli"] == {"installed": True, "missing": []}  # we are running the CLI
    names = [a["name"] for a in data["accountants"]]
    assert {"pld", "rdp", "advanced", "basic", "gdp"} == set(names)
    assert {a["name"]: a["upper_bound"] for a in data["accountants"]}["gdp"] is False
    try:
        import gaussdp._gauss

        built = True
    except ImportError:
        built = False
    assert data["noise"]["c_kernel"]["built"] is built


def test_info_says_in_one_line_when_the_c_kernel_is_not_built(app, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "gaussdp._gauss", None)  # as where it could not be compiled
    data = json.loads(_info(app, "--json").stdout)
    assert data["noise"]["c_kernel"]["built"] is False
    assert "torch's generator" in data["noise"]["torch_default_noise"] or not data["noise"]["torch_generator"]
    lines = [ln for ln in _info(app).stdout.splitlines() if ln.startswith("noise, C kernel")]
    assert len(lines) == 1 and "NOT built" in lines[0], lines


def test_info_reports_the_shake_fallback_without_cryptography(app, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cryptography.hazmat.primitives.ciphers", None)
    data = json.loads(_info(app, "--json").stdout)
    assert data["noise"]["core_secure_stream"] == "SHAKE-256"
    assert "cryptography is not installed" in data["noise"]["core_secure_note"]


def test_info_reports_a_missing_extra(app, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tenseal", None)
    data = json.loads(_info(app, "--json").stdout)
    assert data["extras"]["he"] == {"installed": False, "missing": ["tenseal"]}
    assert "he (missing tenseal)" in _info(app).stdout
