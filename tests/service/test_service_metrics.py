"""``/metrics`` (Prometheus text format) and configuration by environment variables."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from gaussdp.service.app import create_app
from gaussdp.service.config import settings_from_env
from gaussdp.service.keys import create_api_key


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_charges_refusals_latency_and_epsilon_per_tenant(service, client) -> None:  # type: ignore[no-untyped-def]
    h = service.headers(service.key_a)
    assert (
        client.post(
            "/v1/sessions", json={"epsilon": 1.0, "delta": 1e-5, "session_id": "s"}, headers=h
        ).status_code
        == 201
    )
    body = {"vector": [1.0, 2.0], "epsilon": 0.4, "delta": 1e-6}
    codes = [client.post("/v1/sessions/s/release", json=body, headers=h).status_code for _ in range(12)]
    assert 200 in codes and codes[-1] == 409
    assert client.get("/v1/sessions", headers={"Authorization": "Bearer nope"}).status_code == 401

    assert client.get("/metrics", headers=h).status_code == 403  # a release key
    admin = create_api_key(service.ledger.store, "tenant-a", scope="admin")
    r = client.get("/metrics", headers=service.headers(admin))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    s = _samples(r.text)
    ok = codes.count(200)
    assert s[("gaussdp_charges_total", (("tenant", "tenant-a"),))] == ok
    assert s[("gaussdp_refusals_total", (("reason", "budget_exhausted"),))] == codes.count(409)
    assert s[("gaussdp_refusals_total", (("reason", "unauthorized"),))] == 1
    assert s[("gaussdp_refusals_total", (("reason", "forbidden"),))] == 1
    release = (("method", "POST"), ("route", "/v1/sessions/{session_id}/release"), ("status", "200"))
    assert s[("gaussdp_request_seconds_count", release)] == ok
    spent = service.ledger.spent("tenant-a/s").epsilon
    assert s[("gaussdp_epsilon_spent_total", (("tenant", "tenant-a"),))] == pytest.approx(spent, rel=1e-9)

    with TestClient(create_app(ledger=service.ledger, metrics="public")) as c:
        assert c.get("/metrics").status_code == 200
    with TestClient(create_app(ledger=service.ledger, metrics="off")) as c:
        assert c.get("/metrics").status_code == 404


def test_settings_from_environment_variables() -> None:
    env = {
        "GAUSSDP_DB": "sqlite:///x.db",
        "GAUSSDP_CPU_LIMIT_S": "0.5",
        "GAUSSDP_MAX_BODY_BYTES": "1024",
        "GAUSSDP_RATE_LIMIT_PER_S": "20",
        "GAUSSDP_TEXT": "off",
        "GAUSSDP_METRICS": "public",
        "UNRELATED": "1",
    }
    assert settings_from_env(env) == {
        "ledger_url": "sqlite:///x.db",
        "cpu_limit_s": 0.5,
        "max_body_bytes": 1024,
        "rate_limit_per_s": 20.0,
        "text": "off",
        "metrics": "public",
    }
    assert settings_from_env({}) == {}
    with pytest.raises(ValueError, match="GAUSSDP_CPU_LIMIT_S='fast'"):
        settings_from_env({"GAUSSDP_CPU_LIMIT_S": "fast"})
    with pytest.raises(ValueError, match="GAUSSDP_TEXT='on'"):
        settings_from_env({"GAUSSDP_TEXT": "on"})
