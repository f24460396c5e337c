"""API keys: scopes, expiry, rotation, revocation within 1 s across workers; rate limits per key
(429 with Retry-After); per-tenant caps on sessions and on total epsilon granted; the /text routes
keyed, public, or on their own app."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient

from gaussdp.budget import Ledger
from gaussdp.service.app import create_app, create_text_app
from gaussdp.service.keys import create_api_key, key_id_of, rotate_api_key

RELEASE = {"vector": [1.0, 2.0], "sigma": 50.0, "sensitivity": 1.0}


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _session(client: TestClient, key: str, sid: str = "s", epsilon: float = 1.0) -> int:
    body = {"epsilon": epsilon, "delta": 1e-5, "session_id": sid}
    return client.post("/v1/sessions", json=body, headers=_h(key)).status_code


def test_scopes_read_release_admin(service, client) -> None:  # type: ignore[no-untyped-def]
    store = service.ledger.store
    read, admin = (
        create_api_key(store, "tenant-a", scope="read"),
        create_api_key(store, "tenant-a", scope="admin"),
    )
    release = service.key_a  # the default scope
    assert _session(client, read) == 403
    assert _session(client, release) == 201
    assert client.get("/v1/sessions/s", headers=_h(read)).status_code == 200
    assert client.get("/v1/sessions/s/history", headers=_h(read)).status_code == 200
    r = client.post("/v1/sessions/s/release", json=RELEASE, headers=_h(read))
    assert r.status_code == 403 and "read" in r.json()["detail"]
    assert client.post("/v1/sessions/s/release", json=RELEASE, headers=_h(admin)).status_code == 200
    assert client.get("/v1/audit/export", headers=_h(release)).status_code == 403
    assert client.get("/v1/audit/export", headers=_h(admin)).status_code == 200
    assert len(service.ledger.history("tenant-a/s")) == 1  # the refused release charged nothing
    with pytest.raises(ValueError, match="scope"):
        create_api_key(store, "tenant-a", scope="root")


def test_expired_and_rotated_keys_stop_working(service, client) -> None:  # type: ignore[no-untyped-def]
    store = service.ledger.store
    past = create_api_key(store, "tenant-a", expires_at=time.time() - 1)
    assert client.get("/v1/sessions", headers=_h(past)).status_code == 401
    soon = create_api_key(store, "tenant-a", expires_at=time.time() + 0.5)
    assert client.get("/v1/sessions", headers=_h(soon)).status_code == 200  # cached from here on
    time.sleep(0.6)
    assert client.get("/v1/sessions", headers=_h(soon)).status_code == 401  # expiry beats the cache

    old = service.key_a
    assert _session(client, old) == 201
    new = rotate_api_key(store, key_id_of(old), grace_s=60)
    assert client.get("/v1/sessions/s", headers=_h(new)).status_code == 200  # same tenant, same sessions
    assert client.get("/v1/sessions/s", headers=_h(old)).status_code == 200  # within the grace
    newer = rotate_api_key(store, key_id_of(new), grace_s=0)
    time.sleep(1.1)  # the key cache's lifetime
    assert client.get("/v1/sessions/s", headers=_h(new)).status_code == 401
    assert client.post("/v1/sessions/s/release", json=RELEASE, headers=_h(newer)).status_code == 200
    assert [c.key_id for c in service.ledger.history("tenant-a/s")] == [key_id_of(newer)]
    assert store.get_api_key(key_id_of(newer)).scopes == "release"
    with pytest.raises(ValueError, match="no valid key"):
        rotate_api_key(store, key_id_of(new))


def test_revocation_takes_effect_within_one_second_in_every_worker(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    with Ledger(url) as admin_ledger:
        key = create_api_key(admin_ledger.store, "t")
        workers = [Ledger(url), Ledger(url)]  # two worker processes' ledgers (own caches)
        clients = [TestClient(create_app(ledger=w)) for w in workers]
        try:
            for c in clients:  # every worker has the key cached
                assert c.get("/v1/sessions", headers=_h(key)).status_code == 200
            assert admin_ledger.store.revoke_api_key(key_id_of(key))
            t0 = time.monotonic()
            lag = []
            for c in clients:
                while c.get("/v1/sessions", headers=_h(key)).status_code == 200:
                    time.sleep(0.02)
                lag.append(time.monotonic() - t0)
            print(f"\n[keys] revocation seen by both workers after {max(lag):.2f} s")
            assert max(lag) < 1.2
        finally:
            for w in workers:
                w.close()


def test_rate_limit_per_key_answers_429_with_retry_after(service) -> None:  # type: ignore[no-untyped-def]
    app = create_app(ledger=service.ledger, rate_limit_per_s=2.0, rate_limit_burst=3)
    with TestClient(app) as c:
        codes = [c.get("/v1/sessions", headers=_h(service.key_a)).status_code for _ in range(5)]
        assert codes[:3] == [200, 200, 200] and 429 in codes[3:]
        r = c.get("/v1/sessions", headers=_h(service.key_a))
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["detail"].startswith("rate limit")
        assert c.get("/v1/sessions", headers=_h(service.key_b)).status_code == 200  # per key
        time.sleep(0.6)  # one token back at 2/s
        assert c.get("/v1/sessions", headers=_h(service.key_a)).status_code == 200
    with pytest.raises(ValueError):
        create_app(ledger=service.ledger, rate_limit_per_s=0)


def test_tenant_caps_on_sessions_and_total_epsilon(service, client) -> None:  # type: ignore[no-untyped-def]
    assert _session(client, service.key_a, "before", epsilon=1.0) == 201  # counted when caps are set
    service.ledger.store.set_tenant_limits("tenant-a", 3, 5.0)
    assert _session(client, service.key_a, "s1", epsilon=3.0) == 201
    r = client.post("/v1/sessions", json={"epsilon": 1.5, "delta": 1e-5}, headers=_h(service.key_a))
    # a tenant limit answers 429, as the OpenAPI document says (one error table: issue 29)
    assert r.status_code == 429 and r.json()["error"] == "tenant_limit_exceeded"  # 1 + 3 + 1.5 > 5
    doc = client.get("/openapi.json").json()["paths"]["/v1/sessions"]["post"]["responses"]
    assert "tenant_limit_exceeded" in doc["429"]["description"]
    assert "tenant_limit_exceeded" not in doc["409"]["description"]
    assert _session(client, service.key_a, "s1", epsilon=3.0) == 201  # reopening counts nothing
    assert _session(client, service.key_a, "s2", epsilon=0.5) == 201
    assert _session(client, service.key_a, "s3", epsilon=0.1) == 429  # a fourth session
    assert _session(client, service.key_b, "s3", epsilon=100.0) == 201  # other tenants unaffected
    limits = service.ledger.store.get_tenant_limits("tenant-a")
    assert (limits.sessions, limits.epsilon_granted) == (3, 4.5)
    assert sorted(client.get("/v1/sessions", headers=_h(service.key_a)).json()) == ["before", "s1", "s2"]


@pytest.mark.parametrize("mode", ["keyed", "public", "off"])
def test_text_routes_keyed_public_or_off(service, mode) -> None:  # type: ignore[no-untyped-def]
    """keyed: the page and what it reads are public (a browser opening a page sends no key);
    submitting text needs a key. public: no key anywhere. off: not on this app."""
    pytest.importorskip("gaussdp.text.web")
    submit = {"text": "zzzz-not-a-word", "mechanism": "gaussian", "sigma": 0.5}
    with TestClient(create_app(ledger=service.ledger, text=mode)) as c:  # type: ignore[arg-type]
        page = c.get("/text").status_code
        anonymous = c.get("/text/guarantee", params={"sigma": 0.5}).status_code
        keyed = c.get("/text/guarantee", params={"sigma": 0.5}, headers=_h(service.key_a)).status_code
        submit_anonymous = c.post("/text/submit", json=submit).status_code
        submit_keyed = c.post("/text/submit", json=submit, headers=_h(service.key_a)).status_code
    assert (page, anonymous, keyed, submit_anonymous, submit_keyed) == {
        "keyed": (200, 200, 200, 401, 422),  # 422: reached the route (not vocabulary words)
        "public": (200, 200, 200, 422, 422),
        "off": (404, 404, 404, 404, 404),
    }[mode]
    with TestClient(create_text_app()) as c:  # their own app
        assert c.get("/text/guarantee", params={"sigma": 0.5}).status_code == 200
        assert c.get("/v1/sessions").status_code == 404
