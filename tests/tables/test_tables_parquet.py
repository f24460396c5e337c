"""``gaussdp.tables.sanitize_parquet`` and ``gaussdp sanitize IN.parquet``: one process, by row group."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from typer.testing import CliRunner  # noqa: E402

from conftest import embeddings_table  # noqa: E402
from gaussdp.accounting import accountant  # noqa: E402
from gaussdp.budget import Budget, Ledger  # noqa: E402
from gaussdp.calibration import sigma_for  # noqa: E402
from gaussdp.cli import build_app  # noqa: E402
from gaussdp.errors import BudgetExhausted, InvalidParameter, UnsafeInput  # noqa: E402
from gaussdp.mechanism import GaussianMechanism  # noqa: E402
from gaussdp.noise import GRID_SLACK  # noqa: E402
from gaussdp.tables import METADATA_KEY, read_release, sanitize_parquet  # noqa: E402

EPS, DELTA, CLIP = 2.0, 1e-6, 1.0


def _matrix(table, column="embedding") -> np.ndarray:
    col = table.column(column).combine_chunks()
    return np.asarray(col.flatten().to_numpy()).reshape(len(col), -1)


def test_release_keeps_rows_and_columns_and_records_itself(tmp_path):
    x, raw = embeddings_table(tmp_path / "in.parquet", rows=3000, row_group=400)
    report = sanitize_parquet(
        tmp_path / "in.parquet",
        tmp_path / "out.parquet",
        column="embedding",
        epsilon=EPS,
        delta=DELTA,
        clip_norm=CLIP,
        batch_rows=250,
    )
    out = pq.read_table(tmp_path / "out.parquet")
    assert out.schema.remove_metadata().equals(raw.schema.remove_metadata())  # float32 stays float32
    assert out.column("id").equals(raw.column("id")) and out.column("label").equals(raw.column("label"))
    y = _matrix(out)
    norms = np.linalg.norm(x.astype(np.float64), axis=1)
    clipped = x * np.minimum(1.0, CLIP / norms)[:, None]
    r = y.astype(np.float64) - clipped
    sigma = sigma_for(epsilon=EPS, delta=DELTA, sensitivity=CLIP * (1 + GRID_SLACK))
    assert report.sigma == pytest.approx(sigma, rel=1e-12)
    assert abs(r.std() / sigma - 1) < 6 / np.sqrt(2 * r.size)  # 6 standard errors
    big = norms > CLIP  # clipped rows: no residual along their direction
    along = np.einsum("ij,ij->i", r[big], x[big] / norms[big, None])
    assert abs(along.mean()) < 6 * sigma / np.sqrt(big.sum())
    # batches of at most 250 rows within each 400-row row group: 7 x (250 + 150) + 200 = 15 batches
    assert report.rows == 3000 and report.cols == 16 and report.blocks == 15
    assert pq.read_metadata(tmp_path / "out.parquet").num_row_groups == 15
    assert report.n_clipped == int(big.sum()) and report.epsilon <= EPS
    record = read_release(str(tmp_path / "out.parquet"))
    assert record == report.record
    assert record["mechanism"] == "gaussian" and record["neighbouring"] == "add_remove"
    assert record["sigma"] == report.sigma and record["clip_norm"] == CLIP and record["delta"] == DELTA
    assert record["epsilon"] == report.epsilon and record["charge"] is None
    assert METADATA_KEY in pq.read_metadata(tmp_path / "out.parquet").metadata


@pytest.mark.parametrize("kind", ["list64", "large_list32"])
def test_list_columns_keep_their_type(tmp_path, kind):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((500, 8)) * 0.1
    t = {"list64": pa.list_(pa.float64()), "large_list32": pa.large_list(pa.float32())}[kind]
    pq.write_table(pa.table({"e": pa.array(list(x), type=t), "k": np.arange(500)}), tmp_path / "in.parquet")
    sanitize_parquet(
        tmp_path / "in.parquet", tmp_path / "o.parquet", column="e", epsilon=1, delta=1e-5, clip_norm=1
    )
    out = pq.read_table(tmp_path / "o.parquet")
    assert out.schema.field("e").type.value_type == t.value_type
    assert type(out.schema.field("e").type) is type(t)
    assert out.column("k").to_pylist() == list(range(500))


def test_fsspec_urls_in_and_out(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    embeddings_table(tmp_path / "in.parquet", rows=300)
    fs = fsspec.filesystem("memory")
    fs.put(str(tmp_path / "in.parquet"), "/gdp-test/in.parquet")
    try:
        report = sanitize_parquet(
            "memory://gdp-test/in.parquet",
            "memory://gdp-test/out.parquet",
            column="embedding",
            epsilon=1,
            delta=1e-5,
            clip_norm=1,
        )
        assert report.rows == 300
        assert fs.ls("/gdp-test", detail=False) == ["/gdp-test/in.parquet", "/gdp-test/out.parquet"]
        with fs.open("/gdp-test/out.parquet", "rb") as f:
            assert pq.read_table(f).num_rows == 300
    finally:
        fs.rm("/gdp-test", recursive=True)


def _bad_tables():
    ok = np.ones((50, 4), dtype=np.float32) * 0.1
    nan = ok.copy()
    nan[37, 2] = np.nan
    fixed = lambda m: pa.FixedSizeListArray.from_arrays(pa.array(m.reshape(-1)), m.shape[1])  # noqa: E731
    ragged = pa.array([[0.1, 0.2], [0.1, 0.2], [0.1]], type=pa.list_(pa.float32()))
    null_row = pa.array([[0.1, 0.2], None], type=pa.list_(pa.float32()))
    return {
        "missing-column": (pa.table({"other": fixed(ok)}), "has no column 'embedding'"),
        "ragged": (pa.table({"embedding": ragged}), "ragged rows: row 2 has 1 values"),
        "nan": (pa.table({"embedding": fixed(nan)}), "NaN"),
        "strings": (pa.table({"embedding": pa.array(["a", "b"])}), "one embedding per row"),
        "string-lists": (pa.table({"embedding": pa.array([["a"], ["b"]])}), "float32 or float64 values"),
        "int-lists": (pa.table({"embedding": pa.array([[1, 2], [3, 4]])}), "float32 or float64 values"),
        "null-row": (pa.table({"embedding": null_row}), "row 1 is null"),
    }


@pytest.mark.parametrize("kind", list(_bad_tables()))
def test_bad_tables_write_and_charge_nothing(tmp_path, kind):
    table, message = _bad_tables()[kind]
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=20)
    ledger = Ledger("memory://")
    ledger.open("s", Budget(epsilon=10, delta=1e-4))
    with pytest.raises(UnsafeInput, match=message):
        sanitize_parquet(
            tmp_path / "in.parquet",
            tmp_path / "out.parquet",
            column="embedding",
            epsilon=1,
            delta=1e-5,
            clip_norm=1,
            charge=lambda ev: ledger.charge("s", ev),
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.parquet"]  # no output, no partial file
    assert ledger.history("s") == []


def test_parameters_are_checked_by_name(tmp_path):
    embeddings_table(tmp_path / "in.parquet", rows=10)
    common = {"column": "embedding", "epsilon": 1.0, "delta": 1e-5, "clip_norm": 1.0}
    with pytest.raises(InvalidParameter, match="clip_norm"):
        sanitize_parquet(tmp_path / "in.parquet", tmp_path / "o.parquet", **{**common, "clip_norm": -1.0})
    with pytest.raises(InvalidParameter, match="out_path must differ"):
        sanitize_parquet(tmp_path / "in.parquet", tmp_path / "in.parquet", **common)
    (tmp_path / "x.parquet").write_text("id,embedding\n1,2\n")
    with pytest.raises(UnsafeInput, match="not a readable Parquet file"):
        sanitize_parquet(tmp_path / "x.parquet", tmp_path / "o.parquet", **common)


def test_budget_refused_writes_nothing(tmp_path):
    embeddings_table(tmp_path / "in.parquet", rows=100)
    ledger = Ledger("memory://")
    ledger.open("s", Budget(epsilon=0.5, delta=1e-5))
    with pytest.raises(BudgetExhausted):
        sanitize_parquet(
            tmp_path / "in.parquet",
            tmp_path / "out.parquet",
            column="embedding",
            epsilon=1,
            delta=1e-6,
            clip_norm=1,
            charge=lambda ev: ledger.charge("s", ev),
        )
    assert not (tmp_path / "out.parquet").exists() and len(list(tmp_path.iterdir())) == 1


@pytest.fixture(scope="module")
def app():
    return build_app()


def test_cli_parquet_with_a_durable_ledger(app, tmp_path):
    embeddings_table(tmp_path / "in.parquet", rows=500)
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    args = ["sanitize", str(tmp_path / "in.parquet"), str(tmp_path / "out.parquet"), "--column", "embedding"]
    args += ["--epsilon", "1", "--delta", "1e-6", "--clip-norm", "1", "--ledger", db, "--session", "ds-1"]
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 2 and "never opened" in res.output  # the session must exist, or be opened:
    res = CliRunner().invoke(app, [*args, "--budget-epsilon", "1.0", "--budget-delta", "1e-5", "--json"])
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout)
    with Ledger(db) as ledger:
        (charge,) = ledger.history("ds-1")
        assert printed["charge"] == {"principal": "ds-1", "charge_id": charge.charge_id}
        # the charge is the accountant's (pld) value of the release's event at the budget's delta
        event = GaussianMechanism(epsilon=1.0, delta=1e-6, sensitivity=1.0).event
        assert ledger.spent("ds-1").epsilon == pytest.approx(accountant("pld").compose(event).epsilon(1e-5))
    assert read_release(str(tmp_path / "out.parquet"))["charge"] == printed["charge"]
    # the budget (1.0) has no room for a second epsilon-1 release: refused, exit 3, nothing written
    (tmp_path / "out.parquet").unlink()
    res = CliRunner().invoke(app, [*args, "--budget-epsilon", "1.0", "--budget-delta", "1e-5"])
    assert res.exit_code == 3, res.output
    assert not (tmp_path / "out.parquet").exists()


def _cli(app, *args: object):
    return CliRunner().invoke(app, ["sanitize", *map(str, args)])


def test_cli_text_output_and_the_npy_path_charges_too(app, tmp_path):
    embeddings_table(tmp_path / "in.parquet", rows=200)
    flags = ("--epsilon", 1, "--delta", 1e-6, "--clip-norm", 1)
    res = _cli(app, tmp_path / "in.parquet", tmp_path / "o.parquet", "--column", "embedding", *flags)
    assert res.exit_code == 0, res.output
    assert "sanitized 200 rows x 16 of column 'embedding' (local)" in res.output
    assert "other columns unchanged" in res.output and "(add/remove one row)" in res.output
    np.save(tmp_path / "x.npy", np.ones((10, 3), np.float32) * 0.1)
    db = f"sqlite:///{tmp_path / 'l.db'}"
    ledger_flags = ("--ledger", db, "--session", "s", "--budget-epsilon", 3, "--budget-delta", 1e-5)
    res = _cli(app, tmp_path / "x.npy", tmp_path / "y.npy", *flags, *ledger_flags)
    assert res.exit_code == 0, res.output
    assert "charged to session 's'" in res.output
    with Ledger(db) as ledger:
        assert len(ledger.history("s")) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("a,b,c\n0.1,0.2,0.3\n", "is text (it starts 'a,b,c'), not a .npy array: a CSV?"),
        ("0.1,0.2\n0.3,0.4\n", "a CSV?"),
    ],
)
def test_cli_a_csv_named_npy_is_named_as_such(app, tmp_path, content, message):
    (tmp_path / "x.npy").write_text(content)
    res = _cli(app, tmp_path / "x.npy", tmp_path / "y.npy", "--epsilon", 1, "--delta", 1e-6, "--clip-norm", 1)
    assert res.exit_code == 2 and message in res.output
    assert "pickled" not in res.output and not (tmp_path / "y.npy").exists()


def test_memory_is_bounded_by_the_batch_not_the_file(tmp_path):
    """200,000 x 64 float32 (51 MB of embeddings) in 2,048-row batches: Arrow's peak stays a few MB."""
    x, _ = embeddings_table(tmp_path / "in.parquet", rows=200_000, dims=64, row_group=8192)
    code = (
        "import sys, pyarrow as pa\n"
        "from gaussdp.tables import sanitize_parquet\n"
        "sanitize_parquet(sys.argv[1], sys.argv[2], column='embedding', epsilon=1, delta=1e-6,"
        " clip_norm=1, batch_rows=2048)\n"
        "print(pa.default_memory_pool().max_memory())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "in.parquet"), str(tmp_path / "out.parquet")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(Path(__import__("gaussdp").__file__).parents[1])},
    )
    assert done.returncode == 0, done.stderr
    peak = int(done.stdout.split()[-1])
    assert peak < x.nbytes / 3, (peak, x.nbytes)
