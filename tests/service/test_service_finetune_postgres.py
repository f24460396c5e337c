"""Two `gaussdp worker` processes on one PostgreSQL ledger and N queued jobs: each job runs exactly
once (claims with SELECT ... FOR UPDATE SKIP LOCKED)."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
pytest.importorskip("peft")
psycopg = pytest.importorskip("psycopg")

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

PG = "postgresql://postgres@127.0.0.1:5432/test"
N_JOBS = 4


def test_two_workers_run_each_queued_job_exactly_once(tmp_path, tiny_model, perturbed_corpus):  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient
    from ftserver import subprocess_env

    from gaussdp.budget import Ledger
    from gaussdp.service.app import create_app
    from gaussdp.service.jobs import JobStore
    from gaussdp.service.keys import create_api_key

    schema = "gdp_ft_" + secrets.token_hex(4)
    url = f"{PG}?schema={schema}"
    data = tmp_path / "data"
    text, sigma, _ = perturbed_corpus
    workers: list[subprocess.Popen] = []
    try:
        with Ledger(url) as ledger:
            h = {"Authorization": f"Bearer {create_api_key(ledger.store, 'pg')}"}
            app = create_app(ledger=ledger, data_dir=str(data), model_paths={"tiny": str(tiny_model)})
            with TestClient(app) as c:
                lines = "\n".join(text.split("\n")[:40])
                corpus = c.post(
                    "/v1/corpora", params={"name": "lee", "mechanism": "gaussian", "sigma": sigma},
                    content=lines.encode(), headers=h,
                ).json()  # fmt: skip
                c.post("/v1/sessions", json={"epsilon": 200.0, "delta": 1e-5, "session_id": "s"}, headers=h)
                ids = []
                for _ in range(N_JOBS):
                    r = c.post(
                        "/v1/finetune-jobs",
                        json={"corpus_id": corpus["id"], "model": "tiny", "session_id": "s",
                              "noise_multiplier": 2.0, "batch_size": 20, "max_seq_len": 8},
                        headers=h,
                    )  # fmt: skip
                    assert r.status_code == 201, r.text
                    ids.append(r.json()["id"])
        cmd = [
            sys.executable, "-m", "gaussdp.cli", "worker", "--db", url, "--data-dir", str(data),
            "--model", f"tiny={tiny_model}", "--poll-s", "0.2",
        ]  # fmt: skip
        logs = [tmp_path / f"worker{i}.log" for i in range(2)]
        for log in logs:
            workers.append(
                subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=subprocess_env())
            )
        store = JobStore(url)
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                rows = [store.job(None, i) for i in ids]
                if all(r.state in ("succeeded", "failed", "cancelled") for r in rows):
                    break
                assert all(w.poll() is None for w in workers), [log.read_text()[-2000:] for log in logs]
                time.sleep(0.5)
            rows = [store.job(None, i) for i in ids]
        finally:
            store.close()
        assert [r.state for r in rows] == ["succeeded"] * N_JOBS, [(r.state, r.error) for r in rows]
        assert [r.attempts for r in rows] == [1] * N_JOBS
        for w in workers:
            w.terminate()
            w.wait(timeout=30)
        started = [
            line.split("job ")[1].split(" ")[0]
            for log in logs
            for line in log.read_text().splitlines()
            if "): started" in line
        ]
        assert sorted(started) == sorted(ids), started  # each job started exactly once, in all
        assert all(r.worker and r.adapter_path for r in rows)
        print("jobs per worker:", {w: sum(r.worker == w for r in rows) for w in {r.worker for r in rows}})
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        with psycopg.connect(PG, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
