"""The job queue in the ledger's database (gaussdp.service.jobs): atomic claims, leases, cancel."""

from __future__ import annotations

import threading
import time

import pytest

from gaussdp.budget import Ledger
from gaussdp.service.jobs import JobRow, JobStore


def _job(job_id: str, state: str = "queued", model: str = "tiny", created: float | None = None) -> JobRow:
    return JobRow(
        job_id, "t", "corpus_x", model, "t/s", {"k": 1}, {"type": "gaussian", "noise_multiplier": 1.0},
        1.0, 1e-5, None, state, 0, 10, 0.0, None, None, False, None, 0, None,
        time.time() if created is None else created, None, None, None,
    )  # fmt: skip


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request, tmp_path):  # type: ignore[no-untyped-def]
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'ledger.db'}"
    else:
        url = str(request.getfixturevalue("fresh_pg_url"))
    with Ledger(url):  # migrates
        pass
    s = JobStore(url)
    yield s
    s.close()


@pytest.fixture
def fresh_pg_url():  # type: ignore[no-untyped-def]
    import secrets

    import psycopg

    schema = "gdp_jobs_" + secrets.token_hex(4)
    yield f"postgresql://postgres@127.0.0.1:5432/test?schema={schema}"
    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/test", autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def test_concurrent_claims_take_each_job_once(store: JobStore) -> None:
    ids = [f"job_{i:03d}" for i in range(30)]
    for i, job_id in enumerate(ids):
        store.add_job(_job(job_id, created=1000.0 + i))
    store.add_job(_job("job_other_model", model="big"))
    store.add_job(_job("job_charging", state="charging"))
    taken: list[str] = []
    lock = threading.Lock()

    def claimer(name: str) -> None:
        while True:
            job = store.claim(name, ["tiny"])
            if job is None:
                return
            with lock:
                taken.append(job.id)

    threads = [threading.Thread(target=claimer, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken) == ids  # each exactly once; never another model's, never an uncharged one
    assert store.job(None, "job_other_model").state == "queued"
    assert store.job(None, "job_charging").state == "charging"
    assert all(store.job(None, i).attempts == 1 for i in ids)


def test_an_abandoned_job_is_failed_never_requeued(store: JobStore) -> None:
    store.add_job(_job("job_a"))
    job = store.claim("otherhost:1:ab", ["tiny"])
    assert job is not None and job.state == "running"
    assert store.fail_abandoned(lease_s=60.0) == []  # heartbeat fresh, worker on another host
    time.sleep(0.05)
    assert store.fail_abandoned(lease_s=0.01) == ["job_a"]
    row = store.job("t", "job_a")
    assert row.state == "failed" and "interrupted" in (row.error or "")
    assert store.claim("w2", ["tiny"]) is None
    assert not store.finish("job_a", "otherhost:1:ab", "succeeded")  # the old worker lost it


def test_a_dead_local_worker_fails_its_job_at_once(store: JobStore) -> None:
    import socket
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # a pid that no longer exists
    store.add_job(_job("job_b"))
    assert store.claim(f"{socket.gethostname()}:{proc.pid}:xx", ["tiny"]) is not None
    assert store.fail_abandoned(lease_s=3600.0) == ["job_b"]


def test_cancel_queued_at_once_running_at_next_step(store: JobStore) -> None:
    store.add_job(_job("job_q", created=1.0))
    store.add_job(_job("job_r", created=0.0))
    running = store.claim("w", ["tiny"])
    assert running is not None and running.id == "job_r"
    assert store.request_cancel("t", "job_q").state == "cancelled"
    assert store.claim("w", ["tiny"]) is None
    assert not store.heartbeat("job_r", "w")
    assert store.request_cancel("t", "job_r").state == "running"
    assert store.progress("job_r", "w", step=1, steps=10, epsilon_so_far=0.1, loss=2.0)  # stop now
    assert store.request_cancel("other-tenant", "job_r") is None
    assert store.finish("job_r", "w", "cancelled")
    assert store.job("t", "job_r").state == "cancelled"


def test_lists_are_bounded_to_the_newest_rows(store: JobStore) -> None:
    """A tenant with many corpora and jobs gets the newest ``limit`` of each, oldest first."""
    from gaussdp.service.jobs import CorpusRow

    for i in range(12):
        store.add_job(_job(f"job_{i:02d}", created=1000.0 + i))
        store.add_corpus(
            CorpusRow(f"corpus_{i:02d}", "t", "c", "lines", 1, 1, "ab", None, "/nowhere", 1000.0 + i)
        )
    assert [j.id for j in store.jobs("t", 3)] == ["job_09", "job_10", "job_11"]
    assert [c.id for c in store.corpora("t", 3)] == ["corpus_09", "corpus_10", "corpus_11"]
    assert len(store.jobs("t")) == len(store.corpora("t")) == 12  # no limit: the store's own callers


def test_quotas_hold_under_concurrent_inserts_and_store_nothing_past_them(store: JobStore) -> None:
    from gaussdp.service.jobs import CorpusRow, QuotaExceeded

    def corpus(i: int, size: int) -> CorpusRow:
        return CorpusRow(f"corpus_{i}", "t", "c", "lines", size, 1, "0" * 64, None, f"/x/{i}", time.time())

    outcomes: list[str] = []
    lock = threading.Lock()

    def add(i: int) -> None:
        try:
            store.add_corpus(corpus(i, 10), max_count=3, max_bytes=1000)
            result = "stored"
        except QuotaExceeded as exc:
            result = str(exc)
        with lock:
            outcomes.append(result)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("stored") == 3 and len(store.corpora("t")) == 3
    assert all("max_corpora_per_tenant=3" in o for o in outcomes if o != "stored")
    assert store.corpus_usage("t") == (3, 30)
    with pytest.raises(QuotaExceeded, match="max_corpus_bytes_per_tenant=50"):
        store.add_corpus(corpus(99, 25), max_count=10, max_bytes=50)
    assert store.corpus_usage("t") == (3, 30) and store.corpus_usage("other") == (0, 0)
    # unfinished jobs: charging, queued and running count; finished ones do not
    store.add_job(_job("job_1", state="running"), max_active=2)
    store.add_job(_job("job_2", state="charging"), max_active=2)
    with pytest.raises(QuotaExceeded, match="max_jobs_per_tenant=2"):
        store.add_job(_job("job_3"), max_active=2)
    assert store.job("t", "job_3") is None
    store.add_job(_job("job_done", state="succeeded"))
    store.drop_uncharged("job_2")
    store.add_job(_job("job_3"), max_active=2)
    assert store.job("t", "job_3") is not None
