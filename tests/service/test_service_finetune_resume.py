"""A crash (SIGKILL of `gaussdp serve` and its fine-tuning worker, a real subprocess) at step k of n:
after the restart the job resumes from its last checkpoint and completes with n steps in all,
charged once; the card's epsilon == the ledger's charge == the accountant's; the steps released
after the checkpoint are lost (counted, never run again): no step is applied twice."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
torch = pytest.importorskip("torch")
pytest.importorskip("peft")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

EVERY = 5


def _wait(predicate, timeout: float = 180.0, what: str = ""):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _freeze_between_checkpoints(server, db: str, job_id: str, ckpt: Path) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """SIGSTOP the server and its worker at a moment when the row reports more steps than the last
    checkpoint holds; returns (row step k, checkpoint's released c), k > c."""
    from gaussdp.service.jobs import JobStore

    store = JobStore(db)
    try:
        for _ in range(400):
            os.killpg(server.proc.pid, signal.SIGSTOP)
            k = store.job(None, job_id).step
            c = int(torch.load(ckpt, weights_only=True)["released"]) if ckpt.is_file() else 0
            if k > c >= EVERY:
                return k, c
            os.killpg(server.proc.pid, signal.SIGCONT)
            time.sleep(0.02)
    finally:
        store.close()
    raise AssertionError("never caught the job between two checkpoints")


def test_a_job_killed_at_step_k_resumes_and_completes_its_n_steps_charged_once(
    tmp_path, tiny_model, perturbed_corpus
):  # type: ignore[no-untyped-def]
    from ftserver import start_ft_server

    from gaussdp.accounting import accountant as make_accountant
    from gaussdp.accounting.events import event_from_dict
    from gaussdp.budget import Ledger
    from gaussdp.service.keys import create_api_key
    from gaussdp.service.worker import checkpoint_path

    text, sigma, _ = perturbed_corpus
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    data = tmp_path / "data"
    with Ledger(db) as ledger:
        h = {"Authorization": f"Bearer {create_api_key(ledger.store, 'crash')}"}
    args = ("--checkpoint-every", str(EVERY))
    server = start_ft_server(db, data, tiny_model, tmp_path / "s1.log", lease_s=600.0, extra_args=args)
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as c:
            corpus = c.post(
                "/v1/corpora", params={"name": "lee", "mechanism": "gaussian", "sigma": sigma},
                content=text.encode(), headers=h,
            ).json()  # fmt: skip
            c.post("/v1/sessions", json={"epsilon": 100.0, "delta": 1e-5, "session_id": "s"}, headers=h)
            spec = {
                "corpus_id": corpus["id"], "model": "tiny", "session_id": "s", "noise_multiplier": 2.0,
                "epochs": 6, "batch_size": 8, "max_seq_len": 16,
            }  # fmt: skip
            job = c.post("/v1/finetune-jobs", json=spec, headers=h).json()
            assert job["state"] == "queued", job
            n = job["steps"]
            spent_before = c.get("/v1/sessions/s", headers=h).json()["spent"]
            ckpt = checkpoint_path(data, "crash", job["id"])
            _wait(lambda: ckpt.is_file(), what="the first checkpoint")
            k, ck = _freeze_between_checkpoints(server, db, job["id"], ckpt)
            assert k < n
    finally:
        server.kill()  # SIGKILL: the server and its worker (one process group), frozen between checkpoints

    server = start_ft_server(db, data, tiny_model, tmp_path / "s2.log", lease_s=600.0, extra_args=args)
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as c:
            done = _wait(
                lambda: (
                    (j := c.get(f"/v1/finetune-jobs/{job['id']}", headers=h).json())["state"]
                    not in ("queued", "running")
                    and j
                ),
                what="the resumed job to end",
            )
            assert done["state"] == "succeeded", done
            assert (done["step"], done["steps"], done["attempts"]) == (n, n, 2)
            assert done["steps_lost"] == k - ck >= 1  # released after the checkpoint: counted, not re-run
            spent_after = c.get("/v1/sessions/s", headers=h).json()["spent"]
            assert spent_after == spent_before  # charged once, when the job was queued
    finally:
        server.stop()

    card = json.loads(
        (data / "tenants" / "t-crash" / "adapters" / job["id"] / "gaussdp_privacy.json").read_text()
    )
    cd = card["central_dp"]
    assert (cd["steps"], cd["planned_steps"], cd["attempts"]) == (n, n, 2)
    # no step applied twice: the adapter holds Adam's n - lost updates (the optimizer's own count)
    assert (cd["steps_lost"], cd["steps_applied"]) == (k - ck, n - (k - ck))
    assert cd["epsilon"] == done["epsilon"] == spent_before["epsilon"]  # card == job == ledger
    acc = make_accountant(cd["accountant"]).compose(event_from_dict(cd["event"]))
    assert acc.epsilon(cd["delta"]) == pytest.approx(cd["epsilon"], rel=1e-6)  # == accountant
    assert not ckpt.exists()  # the finished job's checkpoint is removed
    readme = (data / "tenants" / "t-crash" / "adapters" / job["id"] / "README.md").read_text()
    assert f"steps lost: {k - ck}" in readme
