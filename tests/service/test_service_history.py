"""``/history`` pages with an opaque cursor and a bounded limit; the audit export (JSON lines) per
tenant records the API key that made each charge."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from gaussdp.accounting import GaussianEvent
from gaussdp.service.app import HISTORY_DEFAULT_LIMIT, HISTORY_MAX_LIMIT
from gaussdp.service.keys import create_api_key, key_id_of

EVENT = GaussianEvent(noise_multiplier=50.0)
RELEASE = {"vector": [1.0, 2.0], "sigma": 50.0, "sensitivity": 1.0}


def _session(client, service, key: str, sid: str) -> None:  # type: ignore[no-untyped-def]
    body = {"epsilon": 100.0, "delta": 1e-5, "session_id": sid}
    assert client.post("/v1/sessions", json=body, headers=service.headers(key)).status_code == 201


def test_history_pages_cover_every_charge_once_in_order(service, client) -> None:  # type: ignore[no-untyped-def]
    _session(client, service, service.key_a, "s")
    n = 2 * HISTORY_DEFAULT_LIMIT + 37
    for _ in range(n):  # straight into the ledger: the pages are what is tested here
        service.ledger.charge("tenant-a/s", EVENT)
    h = service.headers(service.key_a)
    seen: list[int] = []
    sizes = []
    cursor = None
    while True:
        params = {} if cursor is None else {"cursor": cursor}
        page = client.get("/v1/sessions/s/history", params=params, headers=h).json()
        sizes.append(len(page["charges"]))
        seen += [c["charge_id"] for c in page["charges"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert sizes == [HISTORY_DEFAULT_LIMIT, HISTORY_DEFAULT_LIMIT, 37]
    assert seen == sorted(seen) and len(set(seen)) == n
    assert seen == [c.charge_id for c in service.ledger.history("tenant-a/s")]
    small = client.get("/v1/sessions/s/history", params={"limit": 5}, headers=h).json()
    assert [c["charge_id"] for c in small["charges"]] == seen[:5]
    after = client.get(
        "/v1/sessions/s/history", params={"limit": 5, "cursor": small["next_cursor"]}, headers=h
    )
    assert [c["charge_id"] for c in after.json()["charges"]] == seen[5:10]


@pytest.mark.parametrize(
    "params",
    [
        {"limit": HISTORY_MAX_LIMIT + 1},
        {"limit": 0},
        {"limit": "true"},
        {"cursor": "not-a-cursor"},
        {"cursor": "AAAAAAAAAA"},  # one character short
        {"cursor": "AAAAAAAAAAA="},
    ],
)
def test_history_refuses_bad_limits_and_foreign_cursors(service, client, params) -> None:  # type: ignore[no-untyped-def]
    _session(client, service, service.key_a, "s")
    r = client.get("/v1/sessions/s/history", params=params, headers=service.headers(service.key_a))
    assert r.status_code == 422, r.text


def test_each_charge_records_the_key_that_made_it_and_the_export_lists_them(service, client) -> None:  # type: ignore[no-untyped-def]
    second_a = create_api_key(service.ledger.store, "tenant-a")  # two keys of one tenant
    _session(client, service, service.key_a, "s1")
    _session(client, service, service.key_a, "s2")
    _session(client, service, service.key_b, "s1")  # another tenant, same session id
    for key, sid in [(service.key_a, "s1"), (second_a, "s1"), (second_a, "s2"), (service.key_b, "s1")]:
        r = client.post(f"/v1/sessions/{sid}/release", json=RELEASE, headers=service.headers(key))
        assert r.status_code == 200, r.text
    history = client.get("/v1/sessions/s1/history", headers=service.headers(second_a)).json()["charges"]
    assert [c["key_id"] for c in history] == [key_id_of(service.key_a), key_id_of(second_a)]

    auditor = create_api_key(service.ledger.store, "tenant-a", scope="admin")  # the export needs admin
    r = client.get("/v1/audit/export", headers=service.headers(auditor))
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in r.text.splitlines()]
    charges, end = lines[:-1], lines[-1]
    assert [(c["session_id"], c["key_id"]) for c in charges] == [
        ("s1", key_id_of(service.key_a)),
        ("s1", key_id_of(second_a)),
        ("s2", key_id_of(second_a)),
    ]  # tenant-b's charge is not in tenant-a's export
    assert all(c["event"]["type"] == "gaussian" for c in charges)
    # the end line's cursor continues after the last charge: nothing new yet, then only what is new
    again = client.get(
        "/v1/audit/export", params={"cursor": end["next_cursor"]}, headers=service.headers(auditor)
    )
    assert [json.loads(x) for x in again.text.splitlines()] == [end]
    client.post("/v1/sessions/s2/release", json=RELEASE, headers=service.headers(service.key_a))
    more = client.get(
        "/v1/audit/export", params={"cursor": end["next_cursor"]}, headers=service.headers(auditor)
    )
    new = [json.loads(x) for x in more.text.splitlines()][:-1]
    assert [(c["session_id"], c["key_id"]) for c in new] == [("s2", key_id_of(service.key_a))]
    assert client.get("/v1/audit/export").status_code == 401


def test_export_streams_more_than_one_page(service, client, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import gaussdp.service.sessions as sessions_module

    monkeypatch.setattr(sessions_module, "_EXPORT_PAGE", 7)
    _session(client, service, service.key_a, "s")
    for _ in range(23):
        service.ledger.charge("tenant-a/s", EVENT)
    auditor = create_api_key(service.ledger.store, "tenant-a", scope="admin")
    r = client.get("/v1/audit/export", headers=service.headers(auditor))
    ids = [json.loads(x).get("charge_id") for x in r.text.splitlines()]
    assert ids[:-1] == [c.charge_id for c in service.ledger.history("tenant-a/s")] and ids[-1] is None
