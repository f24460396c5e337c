"""Fine-tuning over HTTP (issue 19) against a real `gaussdp serve --data-dir` subprocess with its worker:
perturbed corpus in, DP-LoRA job charged before training, private adapter out; and tenancy."""

from __future__ import annotations

import io
import json
import zipfile

import pytest

pytest.importorskip("fastapi")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rig(tmp_path_factory, tiny_model):  # type: ignore[no-untyped-def]
    """One server for the module: tenants a and b, each with a key."""
    from types import SimpleNamespace

    from ftserver import start_ft_server

    from gaussdp.budget import Ledger
    from gaussdp.service.keys import create_api_key

    root = tmp_path_factory.mktemp("ft-service")
    db = f"sqlite:///{root / 'ledger.db'}"
    with Ledger(db) as ledger:
        key_a = create_api_key(ledger.store, "tenant-a")
        key_b = create_api_key(ledger.store, "tenant-b")
    server = start_ft_server(db, root / "data", tiny_model, root / "server.log")
    try:
        yield SimpleNamespace(
            server=server,
            db=db,
            root=root,
            model=tiny_model,
            a={"Authorization": f"Bearer {key_a}"},
            b={"Authorization": f"Bearer {key_b}"},
        )
    finally:
        server.stop()


def _sse(client, url: str, headers: dict[str, str], timeout: float = 240.0) -> list[tuple[str, dict]]:  # type: ignore[no-untyped-def]
    """Read a server-sent event stream to its end: [(event, data), ...]."""
    events: list[tuple[str, dict]] = []
    name = "message"
    with client.stream("GET", url, headers=headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: ") :])))
    return events


def _upload(client, headers, text: str, **params):  # type: ignore[no-untyped-def]
    return client.post(
        "/v1/corpora", params=params, content=text.encode(), headers={**headers, "Content-Type": "text/plain"}
    )


def test_end_to_end_perturbed_corpus_to_private_adapter(rig, perturbed_corpus, tmp_path):  # type: ignore[no-untyped-def]
    from gaussdp.accounting import accountant, event_from_dict

    text, sigma, vocab_id = perturbed_corpus
    with httpx.Client(base_url=rig.server.url, timeout=60.0) as c:
        assert c.get("/v1/models", headers=rig.a).json() == [{"name": "tiny"}]
        r = _upload(c, rig.a, text, name="lee", mechanism="gaussian", sigma=sigma, vocabulary=vocab_id)
        assert r.status_code == 201, r.text
        corpus = r.json()
        assert corpus["records"] == len([ln for ln in text.split("\n") if ln.strip()])
        per_word = corpus["local_dp"].pop("epsilon_per_word")
        assert corpus["local_dp"] == {
            "mechanism": "gaussian",
            "sigma": sigma,
            "epsilon": None,
            "vocabulary": vocab_id,
        }
        # the per-word guarantee of the declared sigma on the server's vocabulary, both distances
        from gaussdp.calibration import epsilon_for

        for label in ("nearest_neighbour", "worst_case"):
            g = per_word[label]
            assert g["epsilon"] == pytest.approx(
                epsilon_for(sigma=sigma, delta=g["delta"], sensitivity=g["distance"]), rel=1e-9
            )
        assert per_word["nearest_neighbour"]["epsilon"] < per_word["worst_case"]["epsilon"]
        assert corpus["bytes"] == len(text.encode())
        # raw (unperturbed) text declared as perturbed is refused, naming the line
        raw = "the and in\nHello, Zyxwvut qqqq!\n"
        r = _upload(c, rig.a, raw, mechanism="gaussian", sigma=sigma)
        assert r.status_code == 422 and "line 2" in r.json()["detail"], r.text
        assert "Zyxwvut" not in r.text.lower() and "zyxwvut" not in r.text

        r = c.post("/v1/sessions", json={"epsilon": 50.0, "delta": 1e-5, "session_id": "ft"}, headers=rig.a)
        assert r.status_code == 201, r.text
        job_req = {
            "corpus_id": corpus["id"], "model": "tiny", "session_id": "ft", "noise_multiplier": 1.0,
            "epochs": 1, "batch_size": 40, "learning_rate": 1e-2, "max_seq_len": 16, "clip_norm": 1.0,
            "lora": {"rank": 2, "alpha": 4},
        }  # fmt: skip
        r = c.post("/v1/finetune-jobs", json=job_req, headers=rig.a)
        assert r.status_code == 201, r.text
        job = r.json()
        assert job["state"] == "queued" and job["steps"] >= 2
        # charged before training: the session already shows the whole plan's epsilon
        spent = c.get("/v1/sessions/ft", headers=rig.a).json()["spent"]["epsilon"]
        assert spent == pytest.approx(job["epsilon"], rel=1e-9)

        events = _sse(c, f"/v1/finetune-jobs/{job['id']}/events", rig.a)
        assert events[-1][0] == "end" and events[-1][1]["state"] == "succeeded", events[-1]
        states = [d["state"] for _, d in events]
        assert "running" in states or len(events) >= 1
        final = c.get(f"/v1/finetune-jobs/{job['id']}", headers=rig.a).json()
        assert final["state"] == "succeeded" and final["step"] == final["steps"] == job["steps"]
        assert final["loss"] is None  # computed without noise: never released
        assert final["epsilon_so_far"] == pytest.approx(job["epsilon"], rel=1e-6)

        r = c.get(f"/v1/finetune-jobs/{job['id']}/adapter", headers=rig.a)
        assert r.status_code == 200 and r.headers["content-type"] == "application/zip"
        session_after = c.get("/v1/sessions/ft", headers=rig.a).json()
    names = set(zipfile.ZipFile(io.BytesIO(r.content)).namelist())
    for needed in ("adapter_config.json", "adapter_model.safetensors", "README.md", "gaussdp_privacy.json"):
        assert needed in names, names
    out = tmp_path / "adapter"
    zipfile.ZipFile(io.BytesIO(r.content)).extractall(out)
    card = json.loads((out / "gaussdp_privacy.json").read_text())

    # the epsilon in the card == the ledger's charge == the accountant's value for the plan's event
    jobs_row = _job_row(rig.db, job["id"])
    event = event_from_dict(jobs_row.event)
    expected = accountant("pld").compose(event).epsilon(1e-5)
    assert _card_epsilon(card) == pytest.approx(expected, rel=1e-9)
    assert session_after["spent"]["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert job["epsilon"] == pytest.approx(expected, rel=1e-9)
    print(
        f"steps={job['steps']} card epsilon={_card_epsilon(card)!r} "
        f"ledger spent={session_after['spent']['epsilon']!r} pld accountant={expected!r} (delta=1e-5)"
    )
    readme = (out / "README.md").read_text()
    assert "perturbed" in readme.lower() or card.get("local_dp")
    # both guarantees with their numbers: the central epsilon and the local per-word epsilons
    assert "None" not in readme
    assert "per-word epsilon, a word vs its typical nearest neighbour" in readme
    assert "per-word epsilon, a word vs any word of the vocabulary (worst case)" in readme

    base = transformers.AutoModelForCausalLM.from_pretrained(rig.model, local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(rig.model, local_files_only=True)
    model = peft.PeftModel.from_pretrained(base, out).eval()
    ids = tok("the", return_tensors="pt")
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id or 0)
    assert gen.shape[1] > ids["input_ids"].shape[1]


def _job_row(db: str, job_id: str):  # type: ignore[no-untyped-def]
    from gaussdp.service.jobs import JobStore

    store = JobStore(db)
    try:
        return store.job(None, job_id)
    finally:
        store.close()


def _card_epsilon(card: dict) -> float:
    for path in (("epsilon",), ("central_dp", "epsilon"), ("privacy", "epsilon"), ("dp", "epsilon")):
        d = card
        for k in path:
            d = d.get(k) if isinstance(d, dict) else None
        if isinstance(d, int | float):
            return float(d)
    raise AssertionError(f"no epsilon in the card {card}")


def test_budget_refusal_queues_nothing_and_charges_nothing(rig, perturbed_corpus):  # type: ignore[no-untyped-def]
    text, sigma, _ = perturbed_corpus
    with httpx.Client(base_url=rig.server.url, timeout=60.0) as c:
        corpus = _upload(c, rig.a, text, name="lee2", mechanism="gaussian", sigma=sigma).json()
        c.post("/v1/sessions", json={"epsilon": 0.5, "delta": 1e-5, "session_id": "poor"}, headers=rig.a)
        before = c.get("/v1/finetune-jobs", headers=rig.a).json()
        r = c.post(
            "/v1/finetune-jobs",
            json={"corpus_id": corpus["id"], "model": "tiny", "session_id": "poor", "noise_multiplier": 0.6,
                  "epochs": 3, "batch_size": 40},
            headers=rig.a,
        )  # fmt: skip
        assert r.status_code == 409 and r.json()["error"] == "budget_exhausted", r.text
        assert c.get("/v1/finetune-jobs", headers=rig.a).json() == before
        assert c.get("/v1/sessions/poor", headers=rig.a).json()["spent"]["epsilon"] == 0.0
        # a delta other than the session's is refused, as is an unknown model
        r = c.post(
            "/v1/finetune-jobs",
            json={"corpus_id": corpus["id"], "model": "tiny", "session_id": "poor", "noise_multiplier": 5.0,
                  "delta": 1e-6},
            headers=rig.a,
        )  # fmt: skip
        assert r.status_code == 422 and "delta" in r.text
        r = c.post(
            "/v1/finetune-jobs",
            json={"corpus_id": corpus["id"], "model": "gpt2", "session_id": "poor", "noise_multiplier": 5.0},
            headers=rig.a,
        )
        assert r.status_code == 422 and "model" in r.text
        # what training would refuse (longer sequences than the model's positions): refused uncharged
        r = c.post(
            "/v1/finetune-jobs",
            json={"corpus_id": corpus["id"], "model": "tiny", "session_id": "poor", "noise_multiplier": 50.0,
                  "max_seq_len": 4096},
            headers=rig.a,
        )  # fmt: skip
        assert r.status_code == 422 and "max_seq_len" in r.text, r.text
        assert c.get("/v1/finetune-jobs", headers=rig.a).json() == before
        assert c.get("/v1/sessions/poor", headers=rig.a).json()["spent"]["epsilon"] == 0.0


def test_tiny_noise_is_refused_at_its_true_cost_never_undercharged(rig, perturbed_corpus):  # type: ignore[no-untyped-def]
    # Issue 28: noise_multiplier 0.02 (batch 8) was planned at epsilon 1.10 by an overflowing PLD, charged
    # 1.104 and trained; one step alone costs more than 1000. Now its true cost is far above any session
    # budget: refused with 409, nothing queued or charged; at 1e-4 the cost exceeds 1e6: 422, never 500.
    from gaussdp.accounting._profiles import subsampled_epsilon

    text, sigma, _ = perturbed_corpus
    with httpx.Client(base_url=rig.server.url, timeout=60.0) as c:
        corpus = _upload(c, rig.a, text, name="lee-tiny", mechanism="gaussian", sigma=sigma).json()
        session = {"epsilon": 8.0, "delta": 1e-5, "session_id": "tiny-noise"}
        c.post("/v1/sessions", json=session, headers=rig.a)
        before = c.get("/v1/finetune-jobs", headers=rig.a).json()
        job = {"corpus_id": corpus["id"], "model": "tiny", "session_id": "tiny-noise", "batch_size": 8}
        r = c.post("/v1/finetune-jobs", json={**job, "noise_multiplier": 0.02}, headers=rig.a)
        assert r.status_code == 409 and r.json()["error"] == "budget_exhausted", r.text
        # what it would have cost: at least one step's exact epsilon, far above the session's 8
        one_step = subsampled_epsilon(0.02, 8 / corpus["records"], 1e-5)
        assert one_step > 100.0
        assert (
            "'noise_multiplier': 0.02" in r.json()["detail"] and "nothing was charged" in r.json()["detail"]
        )
        r = c.post("/v1/finetune-jobs", json={**job, "noise_multiplier": 1e-4}, headers=rig.a)
        assert r.status_code == 422 and "exceeds" in r.text, r.text
        assert c.get("/v1/finetune-jobs", headers=rig.a).json() == before
        assert c.get("/v1/sessions/tiny-noise", headers=rig.a).json()["spent"]["epsilon"] == 0.0


def test_tenants_never_see_each_others_corpora_jobs_or_adapters(rig, perturbed_corpus):  # type: ignore[no-untyped-def]
    text, sigma, _ = perturbed_corpus
    with httpx.Client(base_url=rig.server.url, timeout=60.0) as c:
        corpus = _upload(c, rig.a, text, name="a-only", mechanism="gaussian", sigma=sigma).json()
        c.post("/v1/sessions", json={"epsilon": 50.0, "delta": 1e-5, "session_id": "ten"}, headers=rig.a)
        c.post("/v1/sessions", json={"epsilon": 50.0, "delta": 1e-5, "session_id": "ten"}, headers=rig.b)
        job = c.post(
            "/v1/finetune-jobs",
            json={"corpus_id": corpus["id"], "model": "tiny", "session_id": "ten", "noise_multiplier": 1.0,
                  "batch_size": 80, "max_seq_len": 8},
            headers=rig.a,
        ).json()  # fmt: skip
        assert "id" in job, job
        missing_corpus, missing_job = "corpus_doesnotexist0", "job_doesnotexist0000"

        def both(method: str, template: str, real: str, fake: str, **kw):  # type: ignore[no-untyped-def]
            r_real = c.request(method, template.format(real), headers=rig.b, **kw)
            r_fake = c.request(method, template.format(fake), headers=rig.b, **kw)
            assert r_real.status_code == 404, (method, template, r_real.status_code, r_real.text)
            assert (r_real.status_code, r_real.content) == (r_fake.status_code, r_fake.content), template

        both("GET", "/v1/corpora/{}", corpus["id"], missing_corpus)
        both("DELETE", "/v1/corpora/{}", corpus["id"], missing_corpus)
        both("GET", "/v1/finetune-jobs/{}", job["id"], missing_job)
        both("GET", "/v1/finetune-jobs/{}/events", job["id"], missing_job)
        both("GET", "/v1/finetune-jobs/{}/adapter", job["id"], missing_job)
        both("POST", "/v1/finetune-jobs/{}/cancel", job["id"], missing_job)
        # training on A's corpus with B's own session and key: the corpus is missing for B
        r_real = c.post(
            "/v1/finetune-jobs",
            json={"corpus_id": corpus["id"], "model": "tiny", "session_id": "ten", "noise_multiplier": 1.0},
            headers=rig.b,
        )
        r_fake = c.post(
            "/v1/finetune-jobs",
            json={"corpus_id": missing_corpus, "model": "tiny", "session_id": "ten", "noise_multiplier": 1.0},
            headers=rig.b,
        )
        assert r_real.status_code == 404 and r_real.content == r_fake.content
        assert c.get("/v1/sessions/ten", headers=rig.b).json()["spent"]["epsilon"] == 0.0
        # lists hold only one's own
        assert corpus["id"] not in {x["id"] for x in c.get("/v1/corpora", headers=rig.b).json()}
        assert job["id"] not in {x["id"] for x in c.get("/v1/finetune-jobs", headers=rig.b).json()}
        # and A still has everything (B's DELETE and cancel did nothing)
        assert c.get(f"/v1/corpora/{corpus['id']}", headers=rig.a).status_code == 200
        assert c.get(f"/v1/finetune-jobs/{job['id']}", headers=rig.a).json()["cancel_requested"] is False
        # A may delete its own
        c.post(f"/v1/finetune-jobs/{job['id']}/cancel", headers=rig.a)


def test_cancel_a_running_job_keeps_its_charge(rig, perturbed_corpus):  # type: ignore[no-untyped-def]
    import time

    text, sigma, _ = perturbed_corpus
    with httpx.Client(base_url=rig.server.url, timeout=60.0) as c:
        corpus = _upload(c, rig.a, text, name="to-cancel", mechanism="gaussian", sigma=sigma).json()
        c.post("/v1/sessions", json={"epsilon": 100.0, "delta": 1e-5, "session_id": "cx"}, headers=rig.a)
        job = c.post(
            "/v1/finetune-jobs",
            json={"corpus_id": corpus["id"], "model": "tiny", "session_id": "cx", "noise_multiplier": 2.0,
                  "epochs": 50, "batch_size": 8, "max_seq_len": 8},
            headers=rig.a,
        ).json()  # fmt: skip
        deadline = time.monotonic() + 120
        while c.get(f"/v1/finetune-jobs/{job['id']}", headers=rig.a).json()["step"] < 1:
            assert time.monotonic() < deadline, "the job never ran"
            time.sleep(0.2)
        assert c.get(f"/v1/finetune-jobs/{job['id']}/adapter", headers=rig.a).status_code == 409
        r = c.post(f"/v1/finetune-jobs/{job['id']}/cancel", headers=rig.a)
        assert r.status_code == 202 and r.json()["cancel_requested"] is True
        events = _sse(c, f"/v1/finetune-jobs/{job['id']}/events", rig.a)
        assert events[-1][0] == "end" and events[-1][1]["state"] == "cancelled", events[-1]
        assert events[-1][1]["step"] < job["steps"]
        spent = c.get("/v1/sessions/cx", headers=rig.a).json()["spent"]["epsilon"]
        assert spent == pytest.approx(job["epsilon"], rel=1e-9)  # the whole charge stays
        r = c.get(f"/v1/finetune-jobs/{job['id']}/adapter", headers=rig.a)
        assert r.status_code == 409 and r.json()["error"] == "job_not_succeeded"


def _vm_hwm_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def _raw_request(url: str, head: str):  # type: ignore[no-untyped-def]
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    s = socket.create_connection((parts.hostname, parts.port), timeout=30)
    s.sendall(head.encode())
    return s


def _status_of(data: bytes) -> int:
    return int(data.split(b" ", 2)[1])


def _whole_answer(s, first: bytes = b"") -> bytes:  # type: ignore[no-untyped-def]
    """Read one HTTP response (headers and its Content-Length body) from socket ``s``."""
    data = first
    s.settimeout(30)
    while b"\r\n\r\n" not in data:
        more = s.recv(65536)
        if not more:
            return data
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(v)
            for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n"))
            if k.lower() == b"content-length"
        ),
        0,
    )
    while len(body) < length:
        more = s.recv(65536)
        if not more:
            break
        body += more
    return head + b"\r\n\r\n" + body


def _no_leftovers(rig) -> None:  # type: ignore[no-untyped-def]
    parts = list((rig.root / "data").rglob("*.part"))
    assert parts == [], parts


def test_oversized_upload_is_refused_before_it_is_read(rig):  # type: ignore[no-untyped-def]
    """25 MB: 413 as soon as the headers arrive (Content-Length), and as soon as the streamed count
    passes 20,000,000 bytes (chunked); the server's peak memory does not grow with the body."""
    pid = rig.server.proc.pid
    hwm0 = _vm_hwm_kib(pid)
    auth = rig.a["Authorization"]
    with httpx.Client(base_url=rig.server.url) as c:
        n_before = len(c.get("/v1/corpora", headers=rig.a).json())
    # Content-Length: answered with no byte of the body sent
    s = _raw_request(
        rig.server.url,
        f"POST /v1/corpora?name=big HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n"
        "Content-Type: text/plain\r\nContent-Length: 25000000\r\n\r\n",
    )
    answer = _whole_answer(s)
    s.close()
    assert _status_of(answer) == 413, answer
    assert b"20000000" in answer
    # chunked (no Content-Length): cut off once past the limit, long before 25 MB were sent
    s = _raw_request(
        rig.server.url,
        f"POST /v1/corpora?name=big HTTP/1.1\r\nHost: x\r\nAuthorization: {auth}\r\n"
        "Content-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n",
    )
    line = b"the and in with at saw we near to\n" * 30000  # ~1 MB of vocabulary words
    chunk = f"{len(line):x}\r\n".encode() + line + b"\r\n"
    sent, answer = 0, b""
    s.settimeout(0.05)
    try:
        while sent < 25_000_000:
            s.sendall(chunk)
            sent += len(line)
            try:
                answer = s.recv(65536)
            except TimeoutError:
                continue
            if answer:
                break
        answer = _whole_answer(s, answer)
    except (BrokenPipeError, ConnectionResetError):
        answer = _whole_answer(s, answer)
    finally:
        s.close()
    assert answer and _status_of(answer) == 413, answer
    assert b"20000000" in answer
    assert sent < 25_000_000, sent  # the server stopped it: the rest was never sent
    grew_mib = (_vm_hwm_kib(pid) - hwm0) / 1024
    print(f"chunked: 413 after {sent} bytes sent; server VmHWM {hwm0} KiB -> grew {grew_mib:.2f} MiB")
    assert grew_mib < 15, f"server peak memory grew by {grew_mib:.1f} MiB"
    with httpx.Client(base_url=rig.server.url) as c:
        assert len(c.get("/v1/corpora", headers=rig.a).json()) == n_before
    _no_leftovers(rig)


def test_a_19_9_mb_corpus_is_accepted(rig):  # type: ignore[no-untyped-def]
    line = "the and in with at saw we near to went after because was her our that\n"
    text = line * (19_900_000 // len(line))
    assert 19_800_000 < len(text.encode()) <= 19_900_000
    with httpx.Client(base_url=rig.server.url, timeout=120.0) as c:
        r = _upload(c, rig.a, text, name="big-ok", mechanism="gaussian", sigma=0.5)
        assert r.status_code == 201, r.text[:500]
        out = r.json()
        assert out["bytes"] == len(text) and out["records"] == text.count("\n")
        import hashlib

        assert out["sha256"] == hashlib.sha256(text.encode()).hexdigest()
        assert c.delete(f"/v1/corpora/{out['id']}", headers=rig.a).status_code == 204
        assert c.get(f"/v1/corpora/{out['id']}", headers=rig.a).status_code == 404
    _no_leftovers(rig)
