"""CKKS split mode over HTTP (gaussdp.service.ckks): the public context is uploaded once per session,
the delta is computed on ciphertext, charged once per call before it is computed, and decrypts to
the plaintext delta of the same noised rows; in-process and against a real ``gaussdp serve``."""

from __future__ import annotations

import base64
import hashlib

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("tenseal")

from gaussdp.accounting import GaussianEvent, SelfComposedEvent, accountant
from gaussdp.inference.ckks import CKKSClient

D, RANK, D_OUT, SCALING = 64, 4, 48, 0.5
CLIP, SIGMA = 1.0, 4.0
OCTETS = {"Content-Type": "application/octet-stream"}


@pytest.fixture(scope="module")
def ckks_client() -> CKKSClient:
    return CKKSClient(rank=RANK)


@pytest.fixture
def lora():
    rng = np.random.default_rng(11)
    return rng.normal(size=(RANK, D)) / 4, rng.normal(size=(D_OUT, RANK))


@pytest.fixture
def app_client(service, lora):  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from gaussdp.service.app import create_app

    app = create_app(ledger=service.ledger, max_body_bytes=64 * 1024, lora_adapters={"ad": (*lora, SCALING)})
    with TestClient(app) as c:
        yield c


def new_session(client, service, key=None, **budget):  # type: ignore[no-untyped-def]
    body = {"epsilon": 3.0, "delta": 1e-5, **budget}
    r = client.post("/v1/sessions", json=body, headers=service.headers(key or service.key_a))
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def upload(client, service, sid, ckks_client, key=None):  # type: ignore[no-untyped-def]
    r = client.post(
        f"/v1/sessions/{sid}/ckks-context",
        content=ckks_client.public_context(),
        headers={**service.headers(key or service.key_a), **OCTETS},
    )
    return r


def delta_body(ckks_client, rows, **extra):  # type: ignore[no-untyped-def]
    rows = np.atleast_2d(rows)
    return {
        "context_id": ckks_client.context_id,
        "adapter": "ad",
        "ciphertext_b64": base64.b64encode(ckks_client.encrypt(rows)).decode(),
        "rows": rows.shape[0],
        "clip_norm": CLIP,
        "sigma": SIGMA,
        **extra,
    }


def charges(service, sid, key=None) -> int:  # type: ignore[no-untyped-def]
    return sum(service.ledger.store.groups(f"tenant-a/{sid}").values())


def test_upload_then_encrypted_delta_decrypts_to_the_plaintext_delta(service, app_client, ckks_client, lora):  # type: ignore[no-untyped-def]
    A, B = lora
    sid = new_session(app_client, service, epsilon=10.0)
    r = upload(app_client, service, sid, ckks_client)
    assert r.status_code == 201, r.text
    out = r.json()
    # the context is 6-9 MB: over this app's max_body_bytes (64 KiB), under the route's own limit
    assert out["size_bytes"] == len(ckks_client.public_context()) > 64 * 1024
    assert out["context_id"] == hashlib.sha256(ckks_client.public_context()).hexdigest()
    assert out["adapters"] == ["ad"]
    h = np.random.default_rng(2).normal(size=(3, D)) * SIGMA
    r = app_client.post(
        f"/v1/sessions/{sid}/ckks-lora-delta",
        json=delta_body(ckks_client, h),
        headers=service.headers(service.key_a),
    )
    assert r.status_code == 200, r.text
    body = r.json()
    got = ckks_client.decrypt_delta(base64.b64decode(body["ciphertext_b64"]), rows=3)
    # the same rows in the clear through /lora-delta (another session): the same delta
    sid2 = new_session(app_client, service, epsilon=10.0)
    plain = app_client.post(
        f"/v1/sessions/{sid2}/lora-delta",
        json={"adapter": "ad", "noised": h.tolist(), "clip_norm": CLIP, "sigma": SIGMA},
        headers=service.headers(service.key_a),
    ).json()
    ref = np.asarray(plain["delta"])
    np.testing.assert_allclose(ref, SCALING * h @ A.T @ B.T, rtol=1e-12)
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 1e-4
    # charged exactly as /lora-delta charges the same declaration: one event of 3 rows, once
    assert body["rows"] == 3 and body["d_out"] == D_OUT and body["neighbouring"] == "replace_one"
    assert body["sensitivity"] == 2 * CLIP and body["noise_multiplier"] == SIGMA / (2 * CLIP)
    assert body["spent"] == plain["spent"]
    expected = accountant("pld").compose(SelfComposedEvent(GaussianEvent(noise_multiplier=SIGMA / 2), 3))
    assert body["spent"]["epsilon"] == pytest.approx(expected.epsilon(1e-5), rel=1e-6)
    assert charges(service, sid) == 1
    history = app_client.get(f"/v1/sessions/{sid}/history", headers=service.headers(service.key_a)).json()
    assert [c["charge_id"] for c in history["charges"]] == [body["charge_id"]]


def test_charged_once_per_call_and_an_idempotent_retry_is_refused(service, app_client, ckks_client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(app_client, service, epsilon=50.0)
    assert upload(app_client, service, sid, ckks_client).status_code == 201
    h = np.random.default_rng(3).normal(size=(1, D))
    url, headers = f"/v1/sessions/{sid}/ckks-lora-delta", service.headers(service.key_a)
    for n in (1, 2):
        r = app_client.post(url, json=delta_body(ckks_client, h), headers=headers)
        assert r.status_code == 200, r.text
        assert charges(service, sid) == n
    body = delta_body(ckks_client, h, idempotency_key="k-1")
    assert app_client.post(url, json=body, headers=headers).status_code == 200
    r = app_client.post(url, json=body, headers=headers)
    assert r.status_code == 409 and r.json()["error"] == "idempotency_key_used"
    assert charges(service, sid) == 3


def test_exhausted_budget_refuses_before_computing(service, app_client, ckks_client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(app_client, service, epsilon=0.5)
    assert upload(app_client, service, sid, ckks_client).status_code == 201
    h = np.random.default_rng(4).normal(size=(1, D))
    r = app_client.post(
        f"/v1/sessions/{sid}/ckks-lora-delta",
        json=delta_body(ckks_client, h, sigma=0.5),
        headers=service.headers(service.key_a),
    )
    assert r.status_code == 409 and r.json()["error"] == "budget_exhausted"
    assert "ciphertext_b64" not in r.json()
    assert charges(service, sid) == 0


def test_refusals_charge_nothing(service, app_client, ckks_client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(app_client, service)
    headers = service.headers(service.key_a)
    url = f"/v1/sessions/{sid}/ckks-lora-delta"
    h = np.random.default_rng(5).normal(size=(2, D))
    # no context uploaded yet for this session
    r = app_client.post(url, json=delta_body(ckks_client, h), headers=headers)
    assert r.status_code == 404 and r.json()["error"] == "ckks_context_unknown"
    assert upload(app_client, service, sid, ckks_client).status_code == 201
    cases = [
        ({**delta_body(ckks_client, h), "rows": 3}, 422, "rows=3"),
        (delta_body(ckks_client, h, adapter="nope"), 422, "no LoRA adapter"),
        ({**delta_body(ckks_client, h), "ciphertext_b64": "!!!!"}, 422, "base64"),
        (
            {**delta_body(ckks_client, h), "ciphertext_b64": base64.b64encode(b"x" * 64).decode()},
            422,
            "magic",
        ),
        (delta_body(ckks_client, np.ones((1, D + 1))), 422, "hidden size"),
        (delta_body(ckks_client, np.ones((5, D))), 413, "too large"),  # over MAX_ROWS: over the limit
        ({**delta_body(ckks_client, h), "context_id": "0" * 64}, 404, "ckks_context_unknown"),
        # a declared noise whose delta could pass 2^14 (and decrypt to garbage): refused first
        (delta_body(ckks_client, h, sigma=1e4), 422, "past the CKKS range"),
    ]
    for body, status, text in cases:
        r = app_client.post(url, json=body, headers=headers)
        assert r.status_code == status, (text, r.text)
        assert text in r.text, r.text
    assert charges(service, sid) == 0
    # another tenant cannot use (or see) this session's context
    r = app_client.post(url, json=delta_body(ckks_client, h), headers=service.headers(service.key_b))
    assert r.status_code == 404


def test_context_upload_limits_and_refusals(service, app_client, ckks_client) -> None:  # type: ignore[no-untyped-def]
    import tenseal as ts

    from gaussdp.service.ckks import MAX_CONTEXT_BYTES

    sid = new_session(app_client, service)
    url = f"/v1/sessions/{sid}/ckks-context"
    headers = {**service.headers(service.key_a), **OCTETS}
    r = app_client.post(url, content=b"\x00" * (MAX_CONTEXT_BYTES + 1), headers=headers)
    assert r.status_code == 413
    assert app_client.post(url, content=b"", headers=headers).status_code == 422
    # a TenSEAL context WITH its secret key (a client's mistake) is not a gaussdp public context
    tsctx = ts.context(ts.SCHEME_TYPE.CKKS, poly_modulus_degree=8192, coeff_mod_bit_sizes=[60, 40, 40, 60])
    r = app_client.post(url, content=tsctx.serialize(save_secret_key=True), headers=headers)
    assert r.status_code == 422 and "bad magic" in r.text
    # the other routes keep the service's limit
    r = app_client.post(
        f"/v1/sessions/{sid}/release",
        json={"vector": [0.0] * 20000, "sigma": 1.0},
        headers=service.headers(service.key_a),
    )
    assert r.status_code == 413
    r = app_client.post(url, content=ckks_client.public_context(), headers=service.headers(service.key_b))
    assert r.status_code == 404  # tenant b does not own the session


def test_without_adapters_there_are_no_ckks_routes(service, client) -> None:  # type: ignore[no-untyped-def]
    paths = client.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if "ckks" in p]


# --- against a real `gaussdp serve` process (the shared `served_lm` fixture, tests/conftest.py) ---


@pytest.mark.slow
def test_over_http_against_gaussdp_serve(served_lm) -> None:  # type: ignore[no-untyped-def]
    """`gaussdp serve --adapter ad=PATH` (a peft adapter saved to disk) through gaussdp.client."""
    import httpx
    import torch

    from gaussdp.client import GaussDPClient
    from gaussdp.inference import HiddenStatePrivatizer
    from gaussdp.service.loading import load_lora_adapter

    a, b, scaling = load_lora_adapter(served_lm.adapter_dir)
    d = a.shape[1]
    keys = CKKSClient()  # the default: every power-of-two rotation key (8.7 MB, over 8 MiB)
    # the client privatizes (clip + noise) hidden states, then encrypts the noised rows
    privatizer = HiddenStatePrivatizer(None, clip_norm=CLIP, sigma=SIGMA)
    h = privatizer.privatize(torch.randn(2, d, dtype=torch.float64) * 3).numpy()
    with GaussDPClient(served_lm.url, served_lm.key, timeout=60) as client:
        sid = client.create_session(epsilon=20.0, delta=1e-5).session_id
        answers = []
        for call in (1, 2):
            # the first call finds no context on the server (404), uploads it and repeats itself
            answers.append(
                client.ckks_lora_delta(
                    sid, h, keys=keys, adapter="ad", clip_norm=CLIP, sigma=SIGMA,
                    neighbouring=privatizer.neighbouring,
                )
            )  # fmt: skip
            assert len(client.history(sid)) == call  # charged once per call
        assert answers[0].charge_id != answers[1].charge_id
        assert answers[1].noise_multiplier == SIGMA / (2 * CLIP) and answers[1].rows == 2
        # the same rows in the clear (/lora-delta, float32 on the wire), for comparison
        plain = client.lora_delta(sid, h, adapter="ad", clip_norm=CLIP, sigma=SIGMA).delta
    with httpx.Client(base_url=served_lm.url, headers=served_lm.headers, timeout=60) as http:
        assert http.get(f"/v1/sessions/{sid}").json()["charges"] == 3
        r = http.post(f"/v1/sessions/{sid}/ckks-context", content=b"\x00" * (17 << 20), headers=OCTETS)
        assert r.status_code == 413
    # the plaintext delta of the same noised rows
    ref = scaling * (h @ a.T) @ b.T
    for answer in answers:
        assert np.linalg.norm(answer.delta - ref) / np.linalg.norm(ref) <= 1e-4
    np.testing.assert_allclose(plain, ref, rtol=1e-4, atol=1e-5)


# --- memory: per-tenant and per-worker budgets in bytes (issue 29) -------------------------------


class _Ctx:
    def __init__(self, context_id: str) -> None:
        self.context_id = context_id


def test_a_tenant_s_contexts_evict_only_its_own() -> None:
    from gaussdp.service.ckks import ContextMemory
    from gaussdp.service.errors import Refusal

    mib = 1 << 20
    memory = ContextMemory(total_bytes=100 * mib, tenant_bytes=40 * mib)
    memory.put("a", "a/s1", _Ctx("a1"), 20 * mib)
    for i in range(10):  # b fills its own budget over and over: only its oldest go
        memory.put("b", f"b/s{i}", _Ctx(f"b{i}"), 15 * mib)
    assert memory.get("a", "a/s1", "a1") is not None
    assert memory.used("b") == 30 * mib and memory.get("b", "b/s9", "b9") is not None
    assert memory.get("b", "b/s0", "b0") is None
    memory.put("c", "c/s1", _Ctx("c1"), 40 * mib)
    with pytest.raises(Refusal) as exc:  # 20 + 30 + 40 + 15 > 100: d is refused, nobody evicted
        memory.put("d", "d/s1", _Ctx("d1"), 15 * mib)
    assert exc.value.code == "capacity_exceeded" and exc.value.headers["Retry-After"] == "60"
    assert memory.used() == 90 * mib and memory.get("a", "a/s1", "a1") is not None
    with pytest.raises(Refusal) as exc:  # larger than a tenant's whole budget
        memory.put("a", "a/s2", _Ctx("a2"), 41 * mib)
    assert exc.value.code == "quota_exceeded"
    # a new upload for a session replaces its context; another id for it is unknown
    memory.put("a", "a/s1", _Ctx("a1b"), 25 * mib)
    assert memory.get("a", "a/s1", "a1") is None and memory.used("a") == 25 * mib
    # b's new context evicts b's own least recently used one (s8), never a's or c's
    assert memory.get("b", "b/s8", "b8") is not None  # s8 used now: s9 is the least recent
    memory.put("b", "b/s10", _Ctx("b10"), 15 * mib)
    assert memory.get("b", "b/s9", "b9") is None and memory.get("b", "b/s8", "b8") is not None
    assert memory.used("a") == 25 * mib and memory.used("c") == 40 * mib


def test_a_loaded_context_is_counted_at_least_its_measured_memory(ckks_client) -> None:  # type: ignore[no-untyped-def]
    """The bytes a context is counted for bound the RSS it adds (measured in a fresh process)."""
    import json
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import gc, json, os, sys
        from gaussdp.inference.ckks import CKKSClient, CKKSPublicContext
        from gaussdp.service.ckks import context_memory_bytes
        def rss():
            return int(open(f"/proc/{os.getpid()}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        data = CKKSClient(rank=int(sys.argv[1])).public_context()
        first = CKKSPublicContext(data)  # the shared SEAL context and the allocator, once
        gc.collect()
        before = rss()
        held = [CKKSPublicContext(data) for _ in range(6)]
        gc.collect()
        print(json.dumps({"per_context": (rss() - before) / 6, "counted": context_memory_bytes(first),
                          "keys": first.galois_keys.size()}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "4"], capture_output=True, text=True, timeout=300, check=True
    )
    m = json.loads(done.stdout)
    mib = 1 << 20
    measured, counted = m["per_context"] / mib, m["counted"] / mib
    print(f"{m['keys']} keys: {measured:.1f} MiB each measured, {counted:.1f} counted")
    assert m["per_context"] <= m["counted"] <= m["per_context"] + 2 * mib
