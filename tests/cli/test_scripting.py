"""The CLI for scripts: --version, --json on every command with figures, exit codes, no wrapping when
piped, choices for enumerated options, read-only commands that never create files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

typer_testing = pytest.importorskip("typer.testing")

SRC = str(Path(__file__).resolve().parents[2] / "src")


def gaussdp(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh process, stdout and stderr piped (not a terminal)."""
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("COLUMNS", None)
    cmd = [sys.executable, "-m", "gaussdp.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def test_version() -> None:
    import gaussdp as pkg

    res = gaussdp("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"gaussdp {pkg.__version__}"


def test_help_documents_the_exit_codes() -> None:
    res = gaussdp("--help")
    text = " ".join(res.stdout.split())
    for code in ("1 internal error", "2 bad arguments", "3 refused by the privacy budget"):
        assert code in text


def test_account_json_pipes_into_json_load() -> None:
    # the acceptance line of issue 22, through a real shell pipe
    cmd = (
        f"PYTHONPATH={SRC} {sys.executable} -m gaussdp.cli account --noise-multiplier 1.1 "
        f"--sample-rate 0.004267 --steps 14063 --accountant rdp --json | {sys.executable} -c "
        '\'import json,sys; d = json.load(sys.stdin); print(d["epsilon"], d["accountant"])\''
    )
    res = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=300, check=True)
    eps, name = res.stdout.split()
    assert 2.55 < float(eps) < 2.65 and name == "rdp"  # Abadi et al.'s MNIST run, as in test_accounting_cli


@pytest.mark.parametrize(
    ("args", "keys"),
    [
        (
            ("account", "--target-epsilon", "2", "--sample-rate", "0.01", "--steps", "100"),
            {"epsilon", "target_epsilon", "noise_multiplier"},
        ),
        (("calibrate", "--epsilon", "1", "--delta", "1e-5"), {"sigma", "true_epsilon", "true_delta"}),
        (("audit", "--samples", "2000", "--alpha", "0.05"), {"epsilon_lower_bound", "refuted"}),
        (("info",), {"noise", "accountants", "extras"}),
    ],
)
def test_commands_with_figures_print_json(args: tuple[str, ...], keys: set[str]) -> None:
    res = gaussdp(*args, "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert keys <= set(data)


def test_calibrate_json_figures_match_the_library() -> None:
    from gaussdp.calibration import sigma_for

    data = json.loads(gaussdp("calibrate", "--epsilon", "1", "--delta", "1e-5", "--json").stdout)
    assert data["sigma"] == sigma_for(epsilon=1.0, delta=1e-5)
    assert data["true_epsilon"] == pytest.approx(1.0, rel=1e-6)


def test_sanitize_json(tmp_path: Path) -> None:
    x = np.random.default_rng(0).normal(size=(50, 4)).astype(np.float32)
    np.save(tmp_path / "in.npy", x)
    res = gaussdp(
        "sanitize", str(tmp_path / "in.npy"), str(tmp_path / "out.npy"),
        "--epsilon", "1", "--delta", "1e-5", "--clip-norm", "1", "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["rows"] == 50 and data["cols"] == 4 and data["private"] is True
    assert (tmp_path / "out.npy").is_file()


def test_bad_option_value_exits_2_with_choices_on_stderr() -> None:
    res = gaussdp("account", "--noise-multiplier", "1", "--accountant", "gdp")
    assert res.returncode == 2 and res.stdout == ""
    # typer draws this usage error in a box; compare the words
    words = " ".join(res.stderr.replace("│", " ").split())
    assert "'gdp' is not one of 'pld', 'rdp', 'advanced', 'basic'" in words


def test_out_of_range_parameter_exits_2_on_stderr() -> None:
    res = gaussdp("calibrate", "--epsilon", "-1", "--delta", "1e-5", "--json")
    assert res.returncode == 2 and res.stdout == ""
    assert "error:" in res.stderr and "epsilon" in res.stderr


def test_exit_codes_internal_1_and_budget_refused_3(monkeypatch: pytest.MonkeyPatch) -> None:
    import typer

    from gaussdp.cli import _guard_all
    from gaussdp.errors import BudgetExhausted

    app = typer.Typer()

    @app.command()
    def refuse() -> None:
        raise BudgetExhausted("principal 'alice' would spend epsilon 1.2 > budget 1")

    @app.command()
    def crash() -> None:
        raise RuntimeError("boom")

    _guard_all(app)
    runner = typer_testing.CliRunner()
    res = runner.invoke(app, ["refuse"])
    assert res.exit_code == 3 and "budget refused" in res.stderr and res.stdout == ""
    res = runner.invoke(app, ["crash"])
    assert res.exit_code == 1 and "internal error: RuntimeError: boom" in res.stderr


def test_real_command_internal_error_exits_1(monkeypatch: pytest.MonkeyPatch) -> None:
    import gaussdp.accounting
    from gaussdp.cli import build_app

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("accountant exploded")

    monkeypatch.setattr(gaussdp.accounting, "accountant", broken)
    res = typer_testing.CliRunner().invoke(build_app(), ["account", "--noise-multiplier", "1"])
    assert res.exit_code == 1 and "accountant exploded" in res.stderr


def test_piped_output_is_not_wrapped() -> None:
    res = gaussdp("account", "--noise-multiplier", "1.1", "--sample-rate", "0.004267", "--steps", "1000")
    lines = res.stdout.splitlines()
    assert len(lines) == 1 and len(lines[0]) > 80, res.stdout


def _make_ledger(url: str) -> None:
    from gaussdp.budget import Budget, Ledger
    from gaussdp.mechanism import GaussianMechanism

    with Ledger(url) as ledger:
        ledger.open("alice", Budget(epsilon=1.0, delta=1e-5))
        ledger.charge("alice", GaussianMechanism(epsilon=0.3, delta=1e-6, sensitivity=1.0).event)


@pytest.mark.parametrize("command", [("ledger", "show"), ("keys", "list")])
def test_read_only_commands_never_create_a_database(tmp_path: Path, command: tuple[str, ...]) -> None:
    for url in ("sqlite:///missing.db", f"sqlite:///{tmp_path / 'abs-missing.db'}"):
        res = gaussdp(*command, "--db", url, cwd=tmp_path)
        assert res.returncode == 2, (res.stdout, res.stderr)
        assert "no SQLite ledger" in res.stderr
        assert list(tmp_path.iterdir()) == []


def test_ledger_show_reads_a_closed_ledger_without_creating_files(tmp_path: Path) -> None:
    _make_ledger(f"sqlite:///{tmp_path / 'l.db'}")
    before = sorted(p.name for p in tmp_path.iterdir())
    res = gaussdp("ledger", "show", "--db", "sqlite:///l.db", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    (row,) = json.loads(res.stdout)["principals"]
    assert row["principal"] == "alice" and row["charges"] == 1
    assert 0 < row["spent"]["epsilon"] < 1.0 and row["budget"] == {"epsilon": 1.0, "delta": 1e-5}
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_ledger_show_sees_charges_of_a_ledger_open_in_another_connection(tmp_path: Path) -> None:
    from gaussdp.budget import Budget, Ledger
    from gaussdp.mechanism import GaussianMechanism

    url = f"sqlite:///{tmp_path / 'live.db'}"
    with Ledger(url) as live:  # a running service holds the WAL database open
        live.open("bob", Budget(epsilon=2.0, delta=1e-5))
        live.charge("bob", GaussianMechanism(epsilon=0.5, delta=1e-6, sensitivity=1.0).event)
        res = gaussdp("ledger", "show", "--db", url, "--json")
        assert res.returncode == 0, res.stderr
        (row,) = json.loads(res.stdout)["principals"]
        assert row["principal"] == "bob" and row["charges"] == 1


def test_ledger_show_refuses_a_file_that_is_not_a_ledger(tmp_path: Path) -> None:
    import sqlite3

    with sqlite3.connect(tmp_path / "other.db") as conn:
        conn.execute("CREATE TABLE t (x)")
    res = gaussdp("ledger", "show", "--db", f"sqlite:///{tmp_path / 'other.db'}")
    assert res.returncode == 2 and "not a gaussdp ledger" in res.stderr


def test_perturb_text_json_and_choices(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("the dog ran to london and the cat sat\n")
    res = gaussdp("perturb-text", "in.txt", "out.txt", "--sigma", "0.5", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["words"] == 9 and data["mechanism"] == "gaussian"
    assert (tmp_path / "out.txt").is_file()
    bad = gaussdp("perturb-text", "in.txt", "out2.txt", "--unknown", "keep", cwd=tmp_path)
    assert bad.returncode == 2 and not (tmp_path / "out2.txt").exists()


def test_vocab_stats_json_matches_the_library() -> None:
    from gaussdp.text.corpus import shipped_vocabulary
    from gaussdp.text.mechanisms import GaussianWordMechanism

    vocabulary = shipped_vocabulary()
    path = Path(__import__("gaussdp").__file__).parent / "data" / "text_vocab_demo.npz"
    res = gaussdp("vocab", "stats", str(path), "--sigma", "0.5", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["words"] == len(vocabulary) and data["dim"] == vocabulary.dim
    mech = GaussianWordMechanism(vocabulary, sigma=0.5, delta=1e-5)
    by = {g["distance_of"]: g for g in data["guarantees"]}
    expected = mech.word_guarantee(vocabulary.box_diameter).epsilon
    assert by["box diagonal"]["epsilon"] == pytest.approx(expected)


def test_federated_demo_json(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    res = gaussdp("federated-demo", "--rounds", "2", "--out-dir", str(tmp_path), "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    nums = [r["round"] for r in data["rounds"]]
    assert 1 <= len(nums) <= 2 and nums == sorted(nums)
    assert data["rounds"] and data["epsilon"] == data["rounds"][-1]["epsilon"]
    assert 0 < data["epsilon"] <= data["epsilon_budget"]
    assert "round" in res.stderr  # progress of each round on stderr, stdout kept for the document


def test_dp_sgd_json() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("sklearn")
    res = gaussdp("dp-sgd", "--epsilon", "4", "--epochs", "1", "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert 0 < data["epsilon"] <= 4.0 + 1e-6 and 0.0 <= data["accuracy"] <= 1.0
    assert data["noise_multiplier"] > 0


def test_inference_report_json(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    png = tmp_path / "r.png"
    res = gaussdp(
        "inference-report", "--epsilons", "1,100", "--clip-norms", "0.5", "--n-prompts", "2",
        "--prompt-len", "6", "--out", str(png), "--json",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [p["epsilon_per_token"] for p in data["points"]] == pytest.approx([1.0, 100.0])
    assert all(p["clip_norm"] == 0.5 for p in data["points"])
    assert png.is_file() and "0.00527" in res.stderr  # the human report went to stderr


def test_piped_output_keeps_lines_whole_but_rules_readable() -> None:
    """Off a terminal text never wraps, while a section rule is RULE_WIDTH columns, not PIPE_WIDTH."""
    import io

    pytest.importorskip("rich")
    from gaussdp.cli._output import PIPE_WIDTH, RULE_WIDTH, make_console

    buf = io.StringIO()
    console = make_console(file=buf)
    console.rule("section")
    console.print("word " * 100)
    rule, text = buf.getvalue().splitlines()[:2]
    assert len(rule) == RULE_WIDTH < PIPE_WIDTH and "section" in rule
    assert text.strip() == ("word " * 100).strip()  # one line, not wrapped at 80 columns
