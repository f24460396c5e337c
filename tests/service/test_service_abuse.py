"""The service against hostile clients (issue 29), each attack against ``gaussdp serve`` in a
subprocess, each asserting its bound: memory under unauthenticated WebSocket floods, deep JSON,
one tenant holding its whole share of generation slots, revocation during a stream, CKKS contexts
of one tenant never evicting another's, ``/healthz`` while big corpora and contexts upload, quotas.

The server gets its limits as ``GAUSSDP_*`` variables, so that an older gaussdp (without them)
starts too and fails these tests: ``PYTHONPATH=<old>/src pytest tests/service/test_service_abuse.py``.
"""

from __future__ import annotations

import base64
import json
import random
import threading
import time

import httpx
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")
websockets = pytest.importorskip("websockets")

from hostile import (  # noqa: E402
    HealthProbe,
    HostileTarget,
    first_message,
    open_stream,
    percentile,
    session,
    start_target,
)
from websockets.sync.client import connect  # noqa: E402

pytestmark = pytest.mark.slow  # one server for the module (torch and transformers start-up)

MiB = 1 << 20
SHARE = 4  # generation slots per tenant
LIMITS = {
    "GAUSSDP_MAX_STREAMS": "32",
    "GAUSSDP_MAX_STREAMS_PER_TENANT": str(SHARE),
    # two contexts of rank 4 (11 rotation keys: 17.5 MiB counted each) per tenant, three in all
    "GAUSSDP_CKKS_TENANT_MEMORY_BYTES": str(40 * MiB),
    "GAUSSDP_CKKS_MEMORY_BYTES": str(64 * MiB),
    "GAUSSDP_MAX_CORPORA_PER_TENANT": "3",
    "GAUSSDP_MAX_CORPUS_BYTES_PER_TENANT": str(25_000_000),
    "GAUSSDP_MAX_JOBS_PER_TENANT": "1",
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):  # type: ignore[no-untyped-def]
    server = start_target(tmp_path_factory.mktemp("hostile"), LIMITS)
    try:
        yield server
    finally:
        server.stop()
    assert "Traceback" not in server.log(), server.log()[-4000:]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _healthz_ms(target: HostileTarget) -> float:
    t0 = time.perf_counter()
    assert httpx.get(target.url + "/healthz", timeout=10).status_code == 200
    return (time.perf_counter() - t0) * 1e3


# -- 1. unauthenticated WebSocket floods ------------------------------------------------------------
def _flood(url: str) -> None:
    """One attacker: no key, 34 text frames of 16 MiB of spaces, compressed if the server lets it
    (permessage-deflate makes each about 16 kB on the wire)."""
    payload = " " * (16 * MiB)
    try:
        with connect(url, compression="deflate", max_size=None, open_timeout=10, close_timeout=2) as ws:
            for _ in range(34):
                ws.send(payload)
            ws.recv(timeout=5)
    except (websockets.exceptions.WebSocketException, OSError, TimeoutError):
        pass


def test_rss_growth_under_six_unauthenticated_floods_is_bounded(target) -> None:  # type: ignore[no-untyped-def]
    sid = session(target, target.key("warm"))
    url = f"{target.ws_url}/v1/sessions/{sid}/generate"
    for _ in range(2):  # warm the server's WebSocket path (and its allocator) first
        _flood(url)
    time.sleep(1.0)
    before = target.rss_bytes()
    peak = [before]
    attackers = [threading.Thread(target=_flood, args=(url,)) for _ in range(6)]
    for t in attackers:
        t.start()
    while any(t.is_alive() for t in attackers):
        peak.append(target.rss_bytes())
        time.sleep(0.05)
    for t in attackers:
        t.join()
    time.sleep(1.0)
    after = target.rss_bytes()
    growth = (max(*peak, after) - before) / MiB
    print(f"RSS {before / MiB:.0f} MiB -> peak {max(peak) / MiB:.0f}, after {after / MiB:.0f} MiB")
    assert growth <= 50, f"RSS grew by {growth:.0f} MiB under 6 unauthenticated connections"
    assert _healthz_ms(target) < 1000


# -- 2. deep JSON ------------------------------------------------------------------------------------
def test_deep_json_is_refused_4422_without_a_traceback(target) -> None:  # type: ignore[no-untyped-def]
    key = target.key("deep")
    sid = session(target, key)
    url = f"{target.ws_url}/v1/sessions/{sid}/generate"
    deep = "[" * 50_000  # Python's json would recurse past its limit on this
    with connect(url, additional_headers=_auth(key)) as ws:
        ws.send(deep)
        m = json.loads(ws.recv(timeout=30))
        assert m["type"] == "error" and m["error"] == "json_too_deep", m
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            ws.recv(timeout=10)
        assert ws.close_code == 4422
    # the same mid-stream: the stream ends at once (not 60 s later, "idle", with a dead receive loop)
    ws = open_stream(target, key, sid, max_new_tokens=20, window=1)
    assert [json.loads(ws.recv(timeout=30))["type"] for _ in range(2)] == ["start", "token"]
    t0 = time.monotonic()
    ws.send("[" * 200 + "]" * 200)
    m = json.loads(ws.recv(timeout=30))
    assert m["type"] == "error" and m["error"] == "json_too_deep" and m["tokens_sent"] == 1, m
    with pytest.raises(websockets.exceptions.ConnectionClosed):
        ws.recv(timeout=10)
    assert ws.close_code == 4422 and time.monotonic() - t0 < 5
    ws.close()
    # acks padded to 16 MiB: never read past the message limit (the connection is closed, 1009)
    ws = open_stream(target, key, sid, max_new_tokens=20, window=1)
    assert [json.loads(ws.recv(timeout=30))["type"] for _ in range(2)] == ["start", "token"]
    t0 = time.monotonic()
    with pytest.raises((websockets.exceptions.ConnectionClosed, OSError)):
        for _ in range(10):
            ws.send('{"ack": 1}' + " " * (16 * MiB))
        ws.recv(timeout=10)
    # 1009 "message too big" (1006 when the client was still writing as the server closed)
    assert time.monotonic() - t0 < 5 and ws.close_code in (1006, 1009), ws.close_code
    ws.close()
    assert target.charges("deep", sid) == 2
    # HTTP bodies too, on every route
    r = httpx.post(target.url + "/v1/sessions", content="[" * 100_000, headers=_auth(key), timeout=30)
    assert r.status_code == 422 and r.json()["error"] == "json_too_deep", r.text
    assert "Traceback" not in target.log()


# -- 3. one tenant holding its whole share -----------------------------------------------------------
def test_a_hostile_tenant_holding_its_share_leaves_other_tenants_streaming(target) -> None:  # type: ignore[no-untyped-def]
    key_b, key_a = target.key("hostile-b"), target.key("fair-a")
    sid_b, sid_a = session(target, key_b), session(target, key_a)
    held, refused = [], 0
    for _ in range(32):  # B asks for every slot of the worker, at no privacy cost, and never acks
        try:
            ws = open_stream(target, key_b, sid_b, max_new_tokens=256, window=1, noise_multiplier=1e9)
        except websockets.exceptions.InvalidStatus as exc:  # the upgrade refused: 429
            assert exc.response.status_code == 429, exc
            assert json.loads(exc.response.body)["error"] == "too_many_generations"
            refused += 1
            continue
        m = first_message(ws)
        if m["type"] == "start":
            held.append(ws)
        else:  # an older server refuses after accepting the stream
            assert m.get("error") in ("too_many_generations", "rate_limited", None), m
            refused += 1
            ws.close()
    try:
        assert len(held) == SHARE and refused == 32 - SHARE
        for _ in range(3):
            t0 = time.monotonic()
            ws = open_stream(target, key_a, sid_a, max_new_tokens=2)
            first = json.loads(ws.recv(timeout=30))
            assert first["type"] == "start", first
            token = json.loads(ws.recv(timeout=30))
            latency = time.monotonic() - t0
            assert token["type"] == "token" and latency < 1.0, (token, latency)
            ws.close()
        r = httpx.post(
            f"{target.url}/v1/sessions/{sid_a}/generate",
            json={"model": "tiny", "prompt_ids": [1, 2], "max_new_tokens": 2, "noise_multiplier": 8.0},
            headers=_auth(key_a),
            timeout=30,
        )
        assert r.status_code == 200, r.text
        r = httpx.post(
            f"{target.url}/v1/sessions/{sid_b}/generate",
            json={"model": "tiny", "prompt_ids": [1, 2], "max_new_tokens": 2, "noise_multiplier": 1e9},
            headers=_auth(key_b),
            timeout=30,
        )
        assert r.status_code == 429 and r.json()["error"] == "too_many_generations", r.text
    finally:
        for ws in held:
            ws.close()


# -- 4. revocation ends an open stream ---------------------------------------------------------------
def test_a_revoked_key_s_stream_is_closed_within_a_second_charges_equal_tokens_sent(target) -> None:  # type: ignore[no-untyped-def]
    key = target.key("revoked")
    sid = session(target, key)
    ws = open_stream(target, key, sid, max_new_tokens=60, window=1)
    assert json.loads(ws.recv(timeout=30))["type"] == "start"
    tokens = [json.loads(ws.recv(timeout=30))]  # token 0
    target.revoke(key)
    t0 = time.monotonic()
    while True:  # a client that keeps acknowledging, one token every 50 ms
        try:
            ws.send(json.dumps({"ack": len(tokens)}))
        except websockets.exceptions.ConnectionClosed:
            pass
        m = json.loads(ws.recv(timeout=30))
        if m["type"] != "token":
            break
        tokens.append(m)
        time.sleep(0.05)
    closed_after = time.monotonic() - t0
    assert m["type"] == "error" and m["error"] == "unauthorized", m
    with pytest.raises(websockets.exceptions.ConnectionClosed):
        ws.recv(timeout=10)
    assert ws.close_code == 4401 and closed_after < 1.0, (ws.close_code, closed_after)
    assert m["tokens_sent"] == len(tokens) == target.charges("revoked", sid) < 60
    ws.close()


# -- 5. CKKS contexts: one tenant never evicts another's ----------------------------------------------
def test_one_tenant_s_contexts_never_evict_another_s(target) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("tenseal")
    from gaussdp.inference.ckks import CKKSClient
    from gaussdp.service.loading import load_lora_adapter

    a, _, _ = load_lora_adapter(target.adapter_dir)
    keys = CKKSClient(rank=a.shape[0])
    public = keys.public_context()
    octets = {"Content-Type": "application/octet-stream"}
    key_a, key_b, key_c = target.key("ckks-a"), target.key("ckks-b"), target.key("ckks-c")
    sid_a = session(target, key_a)
    r = httpx.post(
        f"{target.url}/v1/sessions/{sid_a}/ckks-context",
        content=public,
        headers={**_auth(key_a), **octets},
        timeout=60,
    )
    assert r.status_code == 201, r.text
    assert r.json().get("memory_bytes", 0) <= 20 * MiB
    for _ in range(9):  # more than the old shared LRU cache of 8, each for a session of B's
        sid_b = session(target, key_b)
        r = httpx.post(
            f"{target.url}/v1/sessions/{sid_b}/ckks-context",
            content=public,
            headers={**_auth(key_b), **octets},
            timeout=60,
        )
        assert r.status_code == 201, r.text  # B evicts its own least recently used contexts
    noised = np.random.default_rng(0).normal(size=(1, a.shape[1]))
    body = {
        "context_id": keys.context_id,
        "adapter": "ad",
        "ciphertext_b64": base64.b64encode(keys.encrypt(noised)).decode(),
        "rows": 1,
        "clip_norm": 1.0,
        "sigma": 4.0,
    }
    r = httpx.post(
        f"{target.url}/v1/sessions/{sid_a}/ckks-lora-delta", json=body, headers=_auth(key_a), timeout=60
    )
    assert r.status_code == 200, r.text  # A's context is still there
    # the worker's memory is full of A's and B's contexts: C is refused, nobody is evicted
    sid_c = session(target, key_c)
    r = httpx.post(
        f"{target.url}/v1/sessions/{sid_c}/ckks-context",
        content=public,
        headers={**_auth(key_c), **octets},
        timeout=60,
    )
    assert r.status_code == 429 and r.json()["error"] == "capacity_exceeded", r.text
    r = httpx.post(
        f"{target.url}/v1/sessions/{sid_a}/ckks-lora-delta", json=body, headers=_auth(key_a), timeout=60
    )
    assert r.status_code == 200, r.text


# -- 6. /healthz while big corpora and contexts upload -----------------------------------------------
def _perturbed_corpus(n_bytes: int) -> tuple[bytes, str]:
    """Lines of vocabulary words (what the word mechanism outputs), and the vocabulary's id."""
    from gaussdp.service.finetune import vocabulary_id
    from gaussdp.text.corpus import shipped_vocabulary
    from gaussdp.text.tokenize import words

    vocab = shipped_vocabulary()
    clean = sorted(w for w in vocab.words if words(w) == [w])
    rng = random.Random(0)
    lines, size = [], 0
    while size < n_bytes:
        line = " ".join(rng.choices(clean, k=12))
        lines.append(line)
        size += len(line) + 1
    data = ("\n".join(lines) + "\n").encode()[:n_bytes]
    return data[: data.rfind(b"\n") + 1], vocabulary_id(vocab)


def test_healthz_p99_under_100_ms_while_corpora_and_contexts_upload(target) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("tenseal")
    from gaussdp.inference.ckks import CKKSClient

    corpus, vid = _perturbed_corpus(20_000_000)
    public = CKKSClient().public_context()  # every rotation key: the largest real context (8.7 MB)
    junk = b"\x00" * (16 * MiB - 1)  # a 16 MiB upload that is not a context
    errors: list[str] = []

    def upload_corpus(key: str) -> None:
        r = httpx.post(
            target.url + "/v1/corpora",
            params={"name": "big", "mechanism": "gaussian", "sigma": 0.5, "vocabulary": vid},
            content=corpus,
            headers={**_auth(key), "Content-Type": "text/plain"},
            timeout=120,
        )
        if r.status_code != 201:
            errors.append(r.text)

    def upload_contexts(key: str, sid: str) -> None:
        for body, status in ((public, 201), (junk, 422), (public, 201)):
            r = httpx.post(
                f"{target.url}/v1/sessions/{sid}/ckks-context",
                content=body,
                headers={**_auth(key), "Content-Type": "application/octet-stream"},
                timeout=120,
            )
            if r.status_code not in (status, 429):  # 429: the worker's CKKS memory is full
                errors.append(r.text)

    corpus_keys = [target.key(f"corpus-{i}") for i in range(4)]
    context_keys = [target.key(f"context-{i}") for i in range(4)]
    uploaders = [threading.Thread(target=upload_corpus, args=(k,)) for k in corpus_keys]
    uploaders += [
        threading.Thread(target=upload_contexts, args=(k, session(target, k))) for k in context_keys
    ]
    probe = HealthProbe(target.url)
    time.sleep(0.5)
    for t in uploaders:
        t.start()
    for t in uploaders:
        t.join()
    latencies = probe.stop()
    assert not errors, errors
    p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
    print(
        f"/healthz during 4 x 20 MB corpora and 12 context uploads: {len(latencies)} probes, "
        f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {max(latencies):.1f} ms"
    )
    assert len(latencies) >= 20 and p99 < 100, (p50, p99, max(latencies))


# -- 7. quotas ---------------------------------------------------------------------------------------
def test_quota_refusals_are_clear_and_store_nothing(target) -> None:  # type: ignore[no-untyped-def]
    def corpora(key: str) -> list[dict]:
        r = httpx.get(target.url + "/v1/corpora", headers=_auth(key), timeout=30)
        assert r.status_code == 200, r.text
        return list(r.json())

    def stored_files(tenant: str) -> list[str]:
        root = target.root / "data"
        return sorted(p.name for p in root.rglob("*") if p.is_file() and tenant in str(p))

    def upload(key: str, content: object, **headers: str) -> httpx.Response:
        return httpx.post(
            target.url + "/v1/corpora",
            params={"name": "c"},
            content=content,  # type: ignore[arg-type]
            headers={**_auth(key), "Content-Type": "text/plain", **headers},
            timeout=60,
        )

    # the count of corpora
    key = target.key("quota-count")
    for _ in range(3):
        assert upload(key, b"one record\n").status_code == 201
    r = upload(key, b"one record\n")
    assert r.status_code == 429 and r.json()["error"] == "quota_exceeded", r.text
    assert "max_corpora_per_tenant=3" in r.json()["detail"]
    assert len(corpora(key)) == 3 and len(stored_files("quota-count")) == 3

    # their bytes: refused before a byte is read when declared, as soon as passed when chunked
    key = target.key("quota-bytes")
    big = b"some words of a record\n" * 434_783  # 10 MB
    assert upload(key, big).status_code == 201
    assert upload(key, big).status_code == 201
    r = upload(key, big)  # 30 MB > 25 MB, Content-Length declared
    assert r.status_code == 429 and "max_corpus_bytes_per_tenant=25000000" in r.json()["detail"], r.text
    r = upload(key, iter([big[i : i + 65536] for i in range(0, len(big), 65536)]))  # chunked
    assert r.status_code == 429 and r.json()["error"] == "quota_exceeded", r.text
    assert len(corpora(key)) == 2 and len(stored_files("quota-bytes")) == 2  # no .part left

    # unfinished fine-tuning jobs: refused before the charge
    key = target.key("quota-jobs")
    sid = session(target, key, epsilon=50.0)
    r = upload(key, b"".join(b"record %d of a small corpus\n" % i for i in range(64)))
    assert r.status_code == 201, r.text
    job = {"corpus_id": r.json()["id"], "model": "tiny", "session_id": sid, "noise_multiplier": 1.0}
    r = httpx.post(target.url + "/v1/finetune-jobs", json=job, headers=_auth(key), timeout=60)
    assert r.status_code == 201, r.text
    assert target.charges("quota-jobs", sid) == 1
    r = httpx.post(target.url + "/v1/finetune-jobs", json=job, headers=_auth(key), timeout=60)
    assert r.status_code == 429 and "max_jobs_per_tenant=1" in r.json()["detail"], r.text
    assert target.charges("quota-jobs", sid) == 1  # nothing charged
    r = httpx.get(target.url + "/v1/finetune-jobs", headers=_auth(key), timeout=30)
    assert len(r.json()) == 1  # nothing stored
