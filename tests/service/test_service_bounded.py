"""Bounded work per request: the extreme corners of every accepted parameter range cost < 1 s of CPU,
and the per-request CPU limit cancels numeric work before anything is charged."""

from __future__ import annotations

import secrets
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")

from gaussdp._worklimit import check_work_limit, cpu_limit, no_cpu_limit
from gaussdp.errors import WorkLimitExceeded

TINY = 5e-324  # the smallest positive float: "gt=0" lets it through
NORMAL_MIN = 2.2250738585072014e-308
# Corners of the ranges the service's models accept (service/models.py), and a value in between.
BUDGET_EPSILON = [TINY, NORMAL_MIN, 1e-12, 1.0, 1e3]
DELTA = [TINY, NORMAL_MIN, 1e-300, 1e-10, 0.5, 1.0 - 1e-16]
SIGMA = [TINY, 1e-300, 1e-12, 1.0, 1e6, 1e12]
SENSITIVITY = [TINY, 1e-300, 1e-12, 1.0, 1e3, 1e6]
RELEASE_EPSILON = [TINY, 1e-12, 1.0, 100.0]
ACCOUNTANTS = ["pld", "rdp", "advanced", "basic"]
CPU_BOUND_S = 1.0

release_body = st.one_of(
    st.fixed_dictionaries({"sigma": st.sampled_from(SIGMA), "sensitivity": st.sampled_from(SENSITIVITY)}),
    st.fixed_dictionaries(
        {
            "epsilon": st.sampled_from(RELEASE_EPSILON),
            "delta": st.sampled_from(DELTA),
            "sensitivity": st.sampled_from(SENSITIVITY),
        }
    ),
)
hidden_body = st.one_of(
    st.fixed_dictionaries({"sigma": st.sampled_from(SIGMA), "clip_norm": st.sampled_from(SENSITIVITY)}),
    st.fixed_dictionaries(
        {
            "epsilon": st.sampled_from(RELEASE_EPSILON),
            "delta": st.sampled_from(DELTA),
            "clip_norm": st.sampled_from(SENSITIVITY),
        }
    ),
).flatmap(lambda b: st.sampled_from(["replace_one", "add_remove"]).map(lambda n: {**b, "neighbouring": n}))


def _timed(client, method: str, url: str, **kwargs):  # type: ignore[no-untyped-def]
    # process CPU: the route runs in a worker thread of this process
    t = time.process_time()
    r = client.request(method, url, **kwargs)
    return r, time.process_time() - t


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    budget_epsilon=st.sampled_from(BUDGET_EPSILON),
    budget_delta=st.sampled_from(DELTA),
    accountant=st.sampled_from(ACCOUNTANTS),
    releases=st.lists(
        st.one_of(release_body, hidden_body.map(lambda b: {**b, "_hidden": True})), min_size=1, max_size=4
    ),
)
def test_extreme_corners_cost_under_a_second_of_cpu(
    service, client, budget_epsilon, budget_delta, accountant, releases
) -> None:  # type: ignore[no-untyped-def]
    h = service.headers(service.key_a)
    sid = secrets.token_hex(6)  # a fresh session: no cache warmed by an earlier example
    r, cpu = _timed(
        client,
        "POST",
        "/v1/sessions",
        headers=h,
        json={"epsilon": budget_epsilon, "delta": budget_delta, "accountant": accountant, "session_id": sid},
    )
    assert r.status_code in (201, 422), r.text
    assert cpu < CPU_BOUND_S
    if r.status_code != 201:
        return
    for body in releases:
        body = dict(body)
        route = "hidden-state" if body.pop("_hidden", False) else "release"
        key = "hidden_state" if route == "hidden-state" else "vector"
        r, cpu = _timed(
            client, "POST", f"/v1/sessions/{sid}/{route}", headers=h, json={key: [1.0, -2.0], **body}
        )
        assert r.status_code in (200, 409, 422), (body, r.text)
        assert r.json().get("error") != "work_limit_exceeded", (body, r.text)
        assert cpu < CPU_BOUND_S, (route, body, cpu)
    r, cpu = _timed(client, "GET", f"/v1/sessions/{sid}", headers=h)
    assert r.status_code == 200
    assert cpu < CPU_BOUND_S
    assert r.json()["spent"]["epsilon"] <= budget_epsilon


@pytest.mark.parametrize("sigma", [TINY, 1e-12, 1.0, 1e6])
@pytest.mark.parametrize("delta", [TINY, 1e-300, 0.5, 1.0 - 1e-16])
def test_text_guarantee_corners_cost_under_a_second(service, client, sigma, delta) -> None:  # type: ignore[no-untyped-def]
    params = {"sigma": sigma, "delta": delta}
    r, cpu = _timed(client, "GET", "/text/guarantee", params=params, headers=service.headers(service.key_a))
    if r.status_code == 404:
        pytest.skip("the text router is not mounted")
    assert r.status_code in (200, 422)
    assert cpu < CPU_BOUND_S


def test_the_113_second_release_of_issue_18(service, client) -> None:  # type: ignore[no-untyped-def]
    h = service.headers(service.key_a)
    r = client.post("/v1/sessions", headers=h, json={"epsilon": 1.0, "delta": 1e-10, "session_id": "slow"})
    assert r.status_code == 201
    r, cpu = _timed(
        client,
        "POST",
        "/v1/sessions/slow/release",
        headers=h,
        json={"vector": [1.0], "sigma": 1e12, "sensitivity": 1000.0},
    )
    assert r.status_code == 200, r.text
    assert cpu < CPU_BOUND_S
    assert 0.0 < r.json()["spent"]["epsilon"] < 1e-8


def test_a_request_past_the_cpu_limit_is_cancelled_before_any_charge(service) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from gaussdp.service.app import create_app

    h = service.headers(service.key_a)
    # advanced composition costs milliseconds per accountant call: far beyond a 0.1 ms limit
    strict = create_app(ledger=service.ledger, cpu_limit_s=1e-4)
    with TestClient(strict) as c:
        r = c.post(
            "/v1/sessions",
            headers=h,
            json={"epsilon": 5.0, "delta": 1e-5, "accountant": "advanced", "session_id": "b"},
        )
        assert r.status_code == 201, r.text
        r = c.post("/v1/sessions/b/release", headers=h, json={"vector": [1.0], "sigma": 3.0})
        assert r.status_code == 422
        assert r.json()["error"] == "work_limit_exceeded"
        assert service.ledger.history("tenant-a/b") == []  # nothing was charged
    with TestClient(create_app(ledger=service.ledger)) as c:  # the default limit lets it through
        r = c.post("/v1/sessions/b/release", headers=h, json={"vector": [1.0], "sigma": 3.0})
        assert r.status_code == 200, r.text
        assert len(service.ledger.history("tenant-a/b")) == 1


def test_cpu_limit_counts_this_threads_cpu_only() -> None:
    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    with cpu_limit(0.05):
        check_work_limit()
        time.sleep(0.1)  # waiting is not work
        check_work_limit()
        other = threading.Thread(target=spin, args=(0.1,))  # another thread's work is not counted
        other.start()
        other.join()
        check_work_limit()
        spin(0.06)
        with no_cpu_limit():
            check_work_limit()
        with pytest.raises(WorkLimitExceeded, match="nothing was charged"):
            check_work_limit()
    check_work_limit()  # outside the block: no limit
    with cpu_limit(10.0):
        with cpu_limit(0.01):  # nested: the earlier end wins
            spin(0.02)
            with pytest.raises(WorkLimitExceeded):
                check_work_limit()
    with pytest.raises(ValueError, match="seconds"):
        with cpu_limit(0.0):
            pass
