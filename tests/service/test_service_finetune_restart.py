"""A crash (SIGKILL of `gaussdp serve` and its fine-tuning worker) during a running job, under the
old rule (`--on-interrupt fail`): after the restart the job is failed, never re-run; its charge
stays; other rows are unchanged. (The default, resuming, is tests/service/test_service_finetune_resume.py.)"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
pytest.importorskip("peft")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

OLD_RULE = ("--on-interrupt", "fail")


def _wait(predicate, timeout: float = 180.0, what: str = ""):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_job_interrupted_by_a_crash_is_failed_not_rerun(tmp_path, tiny_model, perturbed_corpus):  # type: ignore[no-untyped-def]
    from ftserver import start_ft_server

    from gaussdp.budget import Ledger
    from gaussdp.service.jobs import JobStore
    from gaussdp.service.keys import create_api_key

    text, sigma, _ = perturbed_corpus
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    with Ledger(db) as ledger:
        h = {"Authorization": f"Bearer {create_api_key(ledger.store, 'crash')}"}
    server = start_ft_server(
        db, tmp_path / "data", tiny_model, tmp_path / "server.log", lease_s=600.0, extra_args=OLD_RULE
    )
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as c:
            corpus = c.post(
                "/v1/corpora", params={"name": "lee", "mechanism": "gaussian", "sigma": sigma},
                content=text.encode(), headers=h,
            ).json()  # fmt: skip
            c.post("/v1/sessions", json={"epsilon": 100.0, "delta": 1e-5, "session_id": "s"}, headers=h)
            long_job = {
                "corpus_id": corpus["id"], "model": "tiny", "session_id": "s", "noise_multiplier": 2.0,
                "epochs": 50, "batch_size": 8, "max_seq_len": 16,
            }  # fmt: skip
            job = c.post("/v1/finetune-jobs", json=long_job, headers=h).json()
            assert job["state"] == "queued", job
            # a second job, cancelled while queued (the one worker is busy): a row that must not change
            other = c.post("/v1/finetune-jobs", json=long_job, headers=h).json()
            c.post(f"/v1/finetune-jobs/{other['id']}/cancel", headers=h)
            _wait(
                lambda: c.get(f"/v1/finetune-jobs/{job['id']}", headers=h).json()["step"] >= 1,
                what="the job to be running",
            )
            spent_before = c.get("/v1/sessions/s", headers=h).json()["spent"]
            corpus_before = c.get(f"/v1/corpora/{corpus['id']}", headers=h).json()
            other_before = c.get(f"/v1/finetune-jobs/{other['id']}", headers=h).json()
            assert other_before["state"] == "cancelled"
    finally:
        server.kill()  # SIGKILL: the server and its worker (one process group), mid-step

    store = JobStore(db)
    try:
        assert store.job(None, job["id"]).state == "running"  # as the crash left it
    finally:
        store.close()
    server = start_ft_server(
        db, tmp_path / "data", tiny_model, tmp_path / "server2.log", lease_s=600.0, extra_args=OLD_RULE
    )
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as c:
            after = c.get(f"/v1/finetune-jobs/{job['id']}", headers=h).json()
            assert after["state"] == "failed", after
            assert "interrupted" in after["error"]
            assert c.get("/v1/sessions/s", headers=h).json()["spent"] == spent_before  # the charge stays
            assert c.get(f"/v1/corpora/{corpus['id']}", headers=h).json() == corpus_before
            assert c.get(f"/v1/finetune-jobs/{other['id']}", headers=h).json() == other_before
            time.sleep(3)  # the new worker polls the queue: it must not take the failed job again
            again = c.get(f"/v1/finetune-jobs/{job['id']}", headers=h).json()
            assert again == after
    finally:
        server.stop()
    store = JobStore(db)
    try:
        assert store.job(None, job["id"]).attempts == 1  # run once, never re-run
    finally:
        store.close()
