"""The one error table (gaussdp.service.errors): the handlers' statuses and bodies, the WebSocket close
codes, the OpenAPI entries and the client's view all come from it, so none can drift."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI
from fastapi.testclient import TestClient

from gaussdp.service import errors
from gaussdp.service.errors import ERRORS, Refusal


def test_every_refusal_is_answered_with_its_row_of_the_table() -> None:
    counted: list[str] = []
    app = FastAPI()
    errors.install(app, counted.append)

    @app.get("/refuse/{code}")
    def refuse(code: str) -> None:
        raise Refusal(code, f"refused: {code}")

    with TestClient(app) as client:
        for code, kind in ERRORS.items():
            r = client.get(f"/refuse/{code}")
            assert r.status_code == kind.status, code
            assert r.json() == {"detail": f"refused: {code}", "error": code}
            assert ("Retry-After" in r.headers) == kind.retry_after, code
            assert ("WWW-Authenticate" in r.headers) == (code == "unauthorized"), code
    assert counted == list(ERRORS)


def test_the_library_s_exceptions_map_to_their_codes() -> None:
    from gaussdp.budget import (
        BudgetExhausted,
        LedgerContention,
        PrincipalConflict,
        StoreUnavailable,
        TenantLimitExceeded,
    )
    from gaussdp.errors import InvalidParameter, WorkLimitExceeded
    from gaussdp.service.jobs import QuotaExceeded

    app = FastAPI()
    errors.install(app, lambda code: None)
    cases = {
        "tenant_limit_exceeded": TenantLimitExceeded("cap"),
        "quota_exceeded": QuotaExceeded("quota"),
        "budget_exhausted": BudgetExhausted("spent"),
        "ledger_contention": LedgerContention("busy"),
        "session_conflict": PrincipalConflict("other budget"),
        "database_unavailable": StoreUnavailable("down"),
        "work_limit_exceeded": WorkLimitExceeded("slow"),
        "invalid": InvalidParameter("bad"),
    }

    @app.get("/raise/{code}")
    def raise_(code: str) -> None:
        raise cases[code]

    with TestClient(app) as client:
        for code, exc in cases.items():
            assert errors.code_of(exc) == code
            r = client.get(f"/raise/{code}")
            assert r.status_code == ERRORS[code].status, (code, r.text)
            # a PrivacyError without a row of its own keeps its class name (InvalidParameter)
            assert r.json()["error"] == (type(exc).__name__ if code == "invalid" else code)
    assert ERRORS["tenant_limit_exceeded"].status == 429  # issue 29: the handler said 409
    assert errors.code_of(RuntimeError("a bug")) == "internal"


def test_openapi_and_close_codes_come_from_the_table(service) -> None:  # type: ignore[no-untyped-def]
    from gaussdp.service import streaming

    assert streaming.CLOSE_CODES == {code: kind.close for code, kind in ERRORS.items()}
    assert streaming.CLOSE_BUDGET_EXHAUSTED == 4402
    with TestClient(service.app) as client:
        spec = client.get("/openapi.json").json()
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            for status, entry in op["responses"].items():
                if (status.startswith("4") and status not in ("426",)) or status.startswith("5"):
                    codes = [r.code for r in ERRORS.values() if str(r.status) == status and r.http]
                    assert codes, (path, method, status)
                    assert all(f"`{c}`" in entry["description"] for c in codes), (path, method, status)
                    retry = any(ERRORS[c].retry_after for c in codes)
                    assert ("Retry-After" in entry.get("headers", {})) == retry, (path, method, status)
    stream = spec["paths"]["/v1/sessions/{session_id}/generate"]["get"]
    assert stream["x-websocket-close-codes"] == errors.websocket_close_codes()
    closes = stream["x-websocket-close-codes"]
    assert closes["4401"]["errors"] == ["unauthorized"] and closes["4402"]["errors"] == ["budget_exhausted"]
    assert set(closes["4422"]["errors"]) == {"invalid", "json_too_deep", "work_limit_exceeded"}
    assert "| 4429 |" in stream["description"]


def test_a_plain_http_get_of_the_stream_is_426_after_its_key(service) -> None:  # type: ignore[no-untyped-def]
    with TestClient(service.app) as client:
        r = client.get("/v1/sessions/s1/generate")
        assert r.status_code == 401 and r.json()["error"] == "unauthorized"
        r = client.get("/v1/sessions/s1/generate", headers=service.headers(service.key_a))
        assert r.status_code == 426 and r.json()["error"] == "upgrade_required"
        assert r.headers["Upgrade"] == "websocket"


def test_the_client_reads_stream_errors_as_the_table_says() -> None:
    pytest.importorskip("websockets")
    from gaussdp.client import _stream

    for code, kind in ERRORS.items():
        if kind.ws:
            assert _stream._status_of(code) == kind.status, code


def test_a_replayed_release_is_refused_by_the_ledger_s_one_check(service) -> None:  # type: ignore[no-untyped-def]
    from gaussdp.budget import IdempotencyKeyUsed

    assert errors.code_of(IdempotencyKeyUsed("used", None)) == "idempotency_key_used"
    body = {"vector": [0.1, 0.2], "sigma": 50.0, "idempotency_key": "k-1"}
    with TestClient(service.app) as client:
        h = service.headers(service.key_a)
        assert client.post("/v1/sessions", json={"session_id": "s", "epsilon": 5.0, "delta": 1e-5}, headers=h)
        first = client.post("/v1/sessions/s/release", json=body, headers=h)
        assert first.status_code == 200
        again = client.post("/v1/sessions/s/release", json=body, headers=h)
    assert again.status_code == ERRORS["idempotency_key_used"].status == 409
    assert again.json()["error"] == "idempotency_key_used" and "already charged" in again.json()["detail"]
    (charge,) = service.ledger.history("tenant-a/s")
    assert charge.charge_id == first.json()["charge_id"]
    # the answer's spend is the ledger's Release: spent right after the charge, remaining floored
    spent = service.ledger.spent("tenant-a/s")
    assert first.json()["spent"] == {"epsilon": spent.epsilon, "delta": spent.delta}
    assert first.json()["remaining"]["epsilon"] == max(0.0, 5.0 - spent.epsilon)


def test_every_router_is_made_from_the_app_s_one_service(service) -> None:  # type: ignore[no-untyped-def]
    from gaussdp.service.deps import Service

    svc = service.app.state.service
    assert isinstance(svc, Service) and svc.ledger is service.ledger is service.app.state.ledger
    with pytest.raises(Refusal) as missing:
        svc.owned("tenant-a", "nope")
    assert missing.value.code == "not_found"
