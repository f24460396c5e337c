"""The service's HTTP contract: auth, tenant isolation, releases charged first, limits, errors."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from gaussdp.accounting import GaussianEvent, accountant
from gaussdp.calibration import sigma_for


def allowance(epsilon: float, delta: float, budget_eps: float, budget_delta: float) -> int:
    """Releases of one (epsilon, delta) Gaussian that fit a budget, by the PLD accountant directly."""
    event = GaussianEvent(sigma_for(epsilon=epsilon, delta=delta))
    n = 0
    while accountant("pld").compose(event, n + 1).epsilon(budget_delta) <= budget_eps:
        n += 1
    return n


def new_session(client, service, key=None, **budget):  # type: ignore[no-untyped-def]
    body = {"epsilon": 3.0, "delta": 1e-5, **budget}
    r = client.post("/v1/sessions", json=body, headers=service.headers(key or service.key_a))
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def test_health_and_openapi_need_no_key(client) -> None:  # type: ignore[no-untyped-def]
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert "/v1/sessions/{session_id}/hidden-state" in paths


@pytest.mark.parametrize(
    "auth", [None, "Bearer nope", "Bearer gdp_0123456789abcdef_" + "x" * 43, "Basic abc"]
)
def test_requests_without_a_valid_key_are_401(client, auth) -> None:  # type: ignore[no-untyped-def]
    headers = {} if auth is None else {"Authorization": auth}
    r = client.post("/v1/sessions", json={"epsilon": 1.0, "delta": 1e-5}, headers=headers)
    assert r.status_code == 401
    assert client.get("/v1/sessions", headers=headers).status_code == 401


def test_revoked_key_is_refused(service, client) -> None:  # type: ignore[no-untyped-def]
    from gaussdp.service.app import create_app
    from gaussdp.service.keys import create_api_key

    key = create_api_key(service.ledger.store, "tenant-c")
    assert service.ledger.store.revoke_api_key(key.split("_")[1])
    from fastapi.testclient import TestClient

    with TestClient(create_app(ledger=service.ledger)) as fresh:  # fresh app: no cached key
        assert fresh.get("/v1/sessions", headers=service.headers(key)).status_code == 401


def test_keys_are_hashed_at_rest(service) -> None:  # type: ignore[no-untyped-def]
    rows = service.ledger.store.list_api_keys()
    assert {r.tenant for r in rows} == {"tenant-a", "tenant-b"}
    for row in rows:
        assert service.key_a not in row.key_hash and service.key_b not in row.key_hash
        assert len(row.key_hash) == 64


def test_release_until_refused_charges_exactly_the_budget(service, client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(client, service)
    expected = allowance(1.0, 1e-6, 3.0, 1e-5)
    h = service.headers(service.key_a)
    body = {"vector": [3.0, 4.0, 0.0], "epsilon": 1.0, "delta": 1e-6, "sensitivity": 1.0}
    statuses = []
    for _ in range(expected + 3):
        r = client.post(f"/v1/sessions/{sid}/release", json=body, headers=h)
        statuses.append(r.status_code)
        if r.status_code == 200:
            out = r.json()
            assert len(out["vector"]) == 3
            assert out["sigma"] == pytest.approx(sigma_for(epsilon=1.0, delta=1e-6))
            assert out["spent"]["epsilon"] <= 3.0
    assert statuses == [200] * expected + [409] * 3
    refused = client.post(f"/v1/sessions/{sid}/release", json=body, headers=h).json()
    assert refused["error"] == "budget_exhausted" and "nothing was charged" in refused["detail"]
    info = client.get(f"/v1/sessions/{sid}", headers=h).json()
    assert info["charges"] == expected
    assert info["spent"]["epsilon"] == pytest.approx(
        accountant("pld").compose(GaussianEvent(sigma_for(epsilon=1.0, delta=1e-6)), expected).epsilon(1e-5)
    )
    assert len(client.get(f"/v1/sessions/{sid}/history", headers=h).json()["charges"]) == expected


def test_base64_float32_round_trip(service, client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(client, service)
    x = np.linspace(-1, 1, 16, dtype="<f4")
    body = {"vector_b64": base64.b64encode(x.tobytes()).decode(), "sigma": 2.0, "sensitivity": 0.5}
    r = client.post(f"/v1/sessions/{sid}/release", json=body, headers=service.headers(service.key_a))
    assert r.status_code == 200, r.text
    out = np.frombuffer(base64.b64decode(r.json()["vector_b64"]), dtype="<f4")
    assert out.shape == (16,) and np.isfinite(out).all()
    hist = service.ledger.history(service.ledger.principals()[0])
    from gaussdp.mechanism import GaussianMechanism

    # noise multiplier = sigma / sensitivity (the core's float-safe margin included)
    assert hist[0].event == GaussianMechanism(sigma=2.0, sensitivity=0.5).event.to_dict()
    assert hist[0].event["noise_multiplier"] == pytest.approx(4.0, rel=1e-5)


def test_hidden_state_split_mode(service, client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(client, service, epsilon=10.0)
    h = np.full(1536, 177.5 / np.sqrt(1536))  # document 000: hidden norm about 177.5, d = 1536
    r = client.post(
        f"/v1/sessions/{sid}/hidden-state",
        json={"hidden_state": h.tolist()},
        headers=service.headers(service.key_a),
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["noised"]) == 1536
    # analytic, not 4.8448; replace-one (the default relation for hidden states): sensitivity 2C
    assert (out["neighbouring"], out["sensitivity"]) == ("replace_one", 2.0)
    assert out["sigma"] == pytest.approx(sigma_for(epsilon=1.0, delta=1e-5, sensitivity=2.0))
    assert out["budget_ok"] is True and 0 < out["epsilon_spent"] <= 10.0
    # The state was clipped to norm 1 before noise: the output is noise-dominated, not h.
    assert np.linalg.norm(np.asarray(out["noised"]) - h) > 100


def test_a_tenant_never_sees_or_spends_another_tenants_sessions(service, client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(client, service, session_id="shared-name")
    a, b = service.headers(service.key_a), service.headers(service.key_b)
    body = {"vector": [1.0], "sigma": 20.0}
    assert client.get(f"/v1/sessions/{sid}", headers=b).status_code == 404
    assert client.get(f"/v1/sessions/{sid}/history", headers=b).status_code == 404
    assert client.post(f"/v1/sessions/{sid}/release", json=body, headers=b).status_code == 404
    assert (
        client.post(f"/v1/sessions/{sid}/hidden-state", json={"hidden_state": [1.0]}, headers=b).status_code
        == 404
    )
    assert client.get("/v1/sessions", headers=b).json() == []
    # B may use the same session id: it is B's own principal, with its own budget.
    assert (
        new_session(client, service, key=service.key_b, session_id="shared-name", epsilon=1.0)
        == "shared-name"
    )
    assert client.post(f"/v1/sessions/{sid}/release", json=body, headers=b).status_code == 200
    assert client.get(f"/v1/sessions/{sid}", headers=a).json()["charges"] == 0
    assert client.get(f"/v1/sessions/{sid}", headers=b).json()["charges"] == 1
    assert client.get("/v1/sessions", headers=a).json() == ["shared-name"]
    # Path tricks do not escape the tenant prefix.
    assert client.get("/v1/sessions/..%2Ftenant-a%2Fshared-name", headers=b).status_code in (404, 422)


def test_idempotent_release_is_charged_and_released_once(service, client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(client, service)
    h = service.headers(service.key_a)
    body = {"vector": [0.5, 0.5], "sigma": 3.0, "idempotency_key": "req-42"}
    assert client.post(f"/v1/sessions/{sid}/release", json=body, headers=h).status_code == 200
    again = client.post(f"/v1/sessions/{sid}/release", json=body, headers=h)
    assert again.status_code == 409 and "already charged and released" in again.json()["detail"]
    assert client.get(f"/v1/sessions/{sid}", headers=h).json()["charges"] == 1


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"vector": [1.0], "epsilon": -1.0, "delta": 1e-5}, "epsilon"),
        ({"vector": [1.0], "epsilon": 1.0, "delta": 2.0}, "delta"),
        ({"vector": [1.0], "sigma": 1.0, "sensitivity": 0}, "sensitivity"),
        ({"vector": [], "sigma": 1.0}, "vector"),
        ({"vector": [1.0], "vector_b64": "AACAPw==", "sigma": 1.0}, "vector_b64"),
        ({"vector": [1.0], "sigma": 1.0, "epsilon": 1.0}, "sigma"),
        ({"vector": [1.0], "epsilon": 1.0}, "sigma"),
        ({"vector_b64": "AACAP", "sigma": 1.0}, "vector_b64"),
        ({"vector_b64": "AACA", "sigma": 1.0}, "vector_b64"),
        (
            {"vector_b64": base64.b64encode(np.array([np.nan], "<f4").tobytes()).decode(), "sigma": 1.0},
            "vector_b64",
        ),
        ({"vector": [1.0], "sigma": 1.0, "colour": "red"}, "colour"),
    ],
)
def test_invalid_arguments_are_422_naming_them(service, client, body, named) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(client, service)
    r = client.post(f"/v1/sessions/{sid}/release", json=body, headers=service.headers(service.key_a))
    assert r.status_code == 422, r.text
    assert named in r.text
    assert client.get(f"/v1/sessions/{sid}", headers=service.headers(service.key_a)).json()["charges"] == 0


def test_nan_in_json_is_422(service, client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(client, service)
    r = client.post(
        f"/v1/sessions/{sid}/release",
        content=b'{"vector": [NaN, 1.0], "sigma": 1.0}',
        headers={**service.headers(service.key_a), "Content-Type": "application/json"},
    )
    assert r.status_code == 422 and "vector" in r.text


def test_session_validation(service, client) -> None:  # type: ignore[no-untyped-def]
    h = service.headers(service.key_a)
    r = client.post("/v1/sessions", json={"epsilon": 0, "delta": 1e-5}, headers=h)
    assert r.status_code == 422 and "epsilon" in r.text
    r = client.post("/v1/sessions", json={"epsilon": 1, "delta": 1e-5, "accountant": "gdp"}, headers=h)
    assert r.status_code == 422 and "accountant" in r.text
    assert client.get("/v1/sessions/bad%20id", headers=h).status_code == 422
    assert client.get("/v1/sessions/missing", headers=h).status_code == 404
    new_session(client, service, session_id="fixed")
    r = client.post("/v1/sessions", json={"epsilon": 9.0, "delta": 1e-5, "session_id": "fixed"}, headers=h)
    assert r.status_code == 409 and "cannot be changed" in r.text


def test_oversized_bodies_are_413_without_reading_them(service, client) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(client, service)
    h = {**service.headers(service.key_a), "Content-Type": "application/json"}
    big = b'{"vector": [' + b"1.0," * 40_000 + b'1.0], "sigma": 1.0}'
    r = client.post(f"/v1/sessions/{sid}/release", content=big, headers=h)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: counted as it streams
        yield b'{"vector": ['
        for _ in range(100):
            yield b"1.0," * 400
        yield b'1.0], "sigma": 1.0}'

    r = client.post(f"/v1/sessions/{sid}/release", content=chunks(), headers=h)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]
    assert client.get(f"/v1/sessions/{sid}", headers=h).json()["charges"] == 0


def test_readyz_reaches_the_sqlite_ledger_and_healthz_does_not(client, service) -> None:  # type: ignore[no-untyped-def]
    assert client.get("/readyz").json() == {"status": "ok"}
    service.ledger.store.close()  # every pooled connection closed: the next query cannot run
    import sqlite3

    def broken(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("unable to open database file")

    service.ledger.store._connect = broken  # what a deleted directory or a full disk looks like
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["error"] == "database_unavailable"
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize("bad", [True, "1", "1.0", None, [1.0]])
@pytest.mark.parametrize("field", ["sigma", "sensitivity", "vector0"])
def test_numbers_are_json_numbers_only(service, client, field, bad) -> None:  # type: ignore[no-untyped-def]
    sid = new_session(client, service)
    body = {"vector": [0.5, 1.0], "sigma": 2.0, "sensitivity": 1.0}
    if field == "vector0":
        body["vector"] = [bad, 1.0]
    else:
        body[field] = bad
    r = client.post(f"/v1/sessions/{sid}/release", json=body, headers=service.headers(service.key_a))
    assert r.status_code == 422, r.text
    assert service.ledger.history(f"tenant-a/{sid}") == []  # nothing charged
    body_ok = {**body, "vector": [1, 0.5], "sigma": 2, "sensitivity": 1}  # integers are numbers
    assert (
        client.post(
            f"/v1/sessions/{sid}/release", json=body_ok, headers=service.headers(service.key_a)
        ).status_code
        == 200
    )


@pytest.mark.parametrize("bad", [True, "3"])
def test_budget_numbers_are_json_numbers_only(service, client, bad) -> None:  # type: ignore[no-untyped-def]
    r = client.post(
        "/v1/sessions", json={"epsilon": bad, "delta": 1e-5}, headers=service.headers(service.key_a)
    )
    assert r.status_code == 422, r.text


def test_openapi_documents_every_error_status_with_its_body(client) -> None:  # type: ignore[no-untyped-def]
    spec = client.get("/openapi.json").json()
    ops = spec["paths"]
    release = ops["/v1/sessions/{session_id}/release"]["post"]["responses"]
    for code in ("200", "400", "401", "404", "409", "413", "422", "503"):
        assert code in release, code
    ref = release["401"]["content"]["application/json"]["schema"]["$ref"]
    assert ref.endswith("/ErrorOut")
    assert release["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/InvalidOut")
    assert "Retry-After" in release["409"]["headers"]
    for path, methods in ops.items():
        for method, op in methods.items():
            if path.startswith("/v1/"):
                assert "401" in op["responses"], (method, path)
                assert "503" in op["responses"], (method, path)
    assert "503" in ops["/readyz"]["get"]["responses"]


def test_method_not_allowed_lists_every_method_of_the_path(client) -> None:  # type: ignore[no-untyped-def]
    r = client.request("DELETE", "/v1/sessions")
    assert r.status_code == 405
    assert r.headers["Allow"] == "GET, POST"
