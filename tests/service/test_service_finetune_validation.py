"""Issue 32's validation metric over HTTP, against a real `gaussdp serve --data-dir`: a base trained
briefly from a config on gensim's Lee corpus, DP-LoRA on the training documents, and a validation
corpus of held-out documents declared public: its loss is on the job while it runs and on the
card, it falls, and it costs nothing (the charge is the plan's alone)."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("gensim")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow


def test_a_public_validation_corpus_shows_a_falling_loss_on_the_job_and_the_card(tmp_path):  # type: ignore[no-untyped-def]
    from ftserver import start_ft_server

    from gaussdp.budget import Ledger
    from gaussdp.inference.tiny_lm import corpus_documents, held_out_split, train_tiny_lm
    from gaussdp.service.keys import create_api_key

    base = train_tiny_lm(tmp_path / "base", vocab_size=2000, n_embd=64, steps=60)  # trained briefly
    assert base.perplexity_after < base.perplexity_before / 4
    train, held = held_out_split(corpus_documents())
    db = f"sqlite:///{tmp_path / 'ledger.db'}"
    with Ledger(db) as ledger:
        h = {"Authorization": f"Bearer {create_api_key(ledger.store, 'val')}"}
    server = start_ft_server(db, tmp_path / "data", base.path, tmp_path / "server.log")
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as c:

            def upload(name: str, docs: list[str]) -> str:
                text = "\n".join(" ".join(d.split()) for d in docs) + "\n"
                r = c.post("/v1/corpora", params={"name": name}, content=text.encode(), headers=h)
                assert r.status_code == 201, r.text
                return str(r.json()["id"])

            private, public = upload("lee-train", train), upload("lee-held-out", held)
            c.post("/v1/sessions", json={"epsilon": 50.0, "delta": 1e-5, "session_id": "s"}, headers=h)
            spec = {
                "corpus_id": private, "model": "tiny", "session_id": "s", "noise_multiplier": 1.0,
                "epochs": 10, "batch_size": 64, "max_seq_len": 16, "learning_rate": 0.05,
                "clip_norm": 0.05, "lora": {"rank": 4, "target_modules": ["c_attn", "c_proj", "c_fc"]},
                "validation_corpus_id": public,
            }  # fmt: skip
            # its loss is released without noise: the owner must declare the corpus public
            r = c.post("/v1/finetune-jobs", json=spec, headers=h)
            assert r.status_code == 422 and "validation_public" in r.text, r.text
            assert c.get("/v1/sessions/s", headers=h).json()["spent"]["epsilon"] == 0.0
            job = c.post("/v1/finetune-jobs", json={**spec, "validation_public": True}, headers=h).json()
            assert job["state"] == "queued", job
            seen: set[float] = set()
            deadline = time.monotonic() + 300
            while (j := c.get(f"/v1/finetune-jobs/{job['id']}", headers=h).json())["state"] in (
                "queued",
                "running",
            ):
                if j["validation_loss"] is not None:
                    seen.add(j["validation_loss"])  # progress shows it while the job runs
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert j["state"] == "succeeded", j
            # not charged: the session paid the plan's epsilon, nothing more
            assert c.get("/v1/sessions/s", headers=h).json()["spent"]["epsilon"] == j["epsilon"]
    finally:
        server.stop()
    adapter = tmp_path / "data" / "tenants" / "t-val" / "adapters" / job["id"]
    card = json.loads((adapter / "gaussdp_privacy.json").read_text())
    losses = card["validation"]["losses"]
    assert card["validation"]["declared_public"] is True and card["validation"]["records"] == len(held)
    assert losses[0][0] == 0 and losses[-1][0] == j["steps"]
    assert losses[-1][1] == pytest.approx(j["validation_loss"])
    print("validation losses", [(st, round(x, 4)) for st, x in losses])
    assert losses[-1][1] < losses[0][1], losses  # the validation loss falls
    assert len(seen) >= 1
    readme = (adapter / "README.md").read_text()
    assert "## Validation" in readme and f"{losses[-1][1]:.4f} at step {j['steps']}" in readme
