"""The client's request plumbing with in-process transports (no server): which calls are retried,
with the same idempotency key, and which errors come out."""

from __future__ import annotations

import json

import httpx
import pytest

from gaussdp.client import (
    BudgetExhausted,
    ConnectionFailed,
    GaussDPClient,
    IdempotencyKeyUsed,
    InvalidRequest,
    ResponseLost,
    ServiceUnavailable,
)
from gaussdp.errors import BudgetExhausted as CoreBudgetExhausted

_RELEASED = {
    "vector": [0.5],
    "sigma": 2.0,
    "sensitivity": 1.0,
    "charge_id": 7,
    "spent": {"epsilon": 0.5, "delta": 1e-5},
    "remaining": {"epsilon": 0.5, "delta": 1e-5},
}


def _client(answers: list, seen: list) -> GaussDPClient:  # type: ignore[type-arg]
    """A client whose transport answers from ``answers`` in turn (a response, or an exception)."""

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content) if request.content else None)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    return GaussDPClient("http://gaussdp.test", "k", transport=httpx.MockTransport(handler), backoff_s=0.0)


def test_a_release_is_retried_with_one_idempotency_key() -> None:
    seen: list = []  # type: ignore[type-arg]
    answers = [
        httpx.ConnectError("refused"),
        httpx.Response(
            503, json={"detail": "db", "error": "database_unavailable"}, headers={"Retry-After": "0"}
        ),
        httpx.Response(
            409, json={"detail": "busy", "error": "ledger_contention"}, headers={"Retry-After": "0"}
        ),
        httpx.Response(200, json=_RELEASED),
    ]
    c = _client(answers, seen)
    c.retries = 3
    assert c.release("s", [1.0], sigma=2.0).charge_id == 7
    keys = {body["idempotency_key"] for body in seen}
    assert len(seen) == 4 and len(keys) == 1  # made once for the call, sent on every attempt
    answers.append(httpx.Response(200, json=_RELEASED))
    assert c.release("s", [1.0], sigma=2.0, idempotency_key="mine").charge_id == 7
    assert seen[-1]["idempotency_key"] == "mine"


def test_what_each_refusal_raises() -> None:
    seen: list = []  # type: ignore[type-arg]
    c = _client(
        [
            httpx.Response(409, json={"detail": "no", "error": "budget_exhausted"}),
            httpx.Response(409, json={"detail": "used", "error": "idempotency_key_used"}),
            httpx.Response(422, json={"detail": [{"loc": ["body", "sigma"], "msg": "bad", "type": "x"}]}),
            httpx.TimeoutException("lost"),
            httpx.Response(409, json={"detail": "used", "error": "idempotency_key_used"}),
        ],
        seen,
    )
    with pytest.raises(BudgetExhausted) as exc:
        c.release("s", [1.0], sigma=2.0)
    assert isinstance(exc.value, CoreBudgetExhausted)  # also the library's own exception
    with pytest.raises(IdempotencyKeyUsed) as used:  # first attempt: the caller reused a key
        c.release("s", [1.0], sigma=2.0, idempotency_key="k1")
    assert not isinstance(used.value, ResponseLost)
    with pytest.raises(InvalidRequest, match=r"body\.sigma: bad"):
        c.release("s", [1.0], sigma=2.0)
    with pytest.raises(ResponseLost, match="charged"):  # a retry found its own key used
        c.release("s", [1.0], sigma=2.0)
    assert seen[-1]["idempotency_key"] == seen[-2]["idempotency_key"]


def test_calls_that_cannot_be_repeated_safely_are_not() -> None:
    seen: list = []  # type: ignore[type-arg]
    c = _client([httpx.ReadError("dropped")], seen)
    with pytest.raises(ConnectionFailed):  # a POST without an idempotency key: one attempt only
        c.request("POST", "/v1/sessions/s/release", json_body={"vector": [1.0], "sigma": 1.0})
    assert len(seen) == 1
    c = _client(
        [httpx.Response(429, json={"detail": "slow down"}, headers={"Retry-After": "0"})] * 3, seen := []
    )
    with pytest.raises(ServiceUnavailable):  # still refused after the retries
        c.list_sessions()
    assert len(seen) == 3
    c = _client([httpx.ReadError("dropped"), httpx.Response(201, json=_session("x"))], seen := [])
    assert c.create_session(epsilon=1.0, delta=1e-5).session_id == "x"  # retried: the id is the client's
    assert seen[0]["session_id"] == seen[1]["session_id"]


def _session(sid: str) -> dict:  # type: ignore[type-arg]
    p = {"epsilon": 1.0, "delta": 1e-5}
    return {"session_id": sid, "accountant": "pld", "budget": p, "spent": p, "remaining": p, "charges": 0}


def test_a_tenant_limit_is_not_retried_a_busy_server_is() -> None:
    from gaussdp.client import LimitExceeded

    seen: list = []  # type: ignore[type-arg]
    c = _client(
        [
            httpx.Response(429, json={"detail": "cap", "error": "tenant_limit_exceeded"}),
            httpx.Response(429, json={"detail": "quota", "error": "quota_exceeded"}),
            httpx.Response(
                429, json={"detail": "slots", "error": "too_many_generations"}, headers={"Retry-After": "0"}
            ),
            httpx.Response(200, json=_RELEASED),
        ],
        seen,
    )
    with pytest.raises(LimitExceeded, match="cap") as exc:  # waiting would not lift a cap: no retry
        c.create_session(epsilon=1.0, delta=1e-5)
    assert exc.value.status == 429 and len(seen) == 1
    with pytest.raises(LimitExceeded, match="quota"):
        c.create_session(epsilon=1.0, delta=1e-5)
    assert c.release("s", [1.0], sigma=2.0).charge_id == 7  # too_many_generations: retried
    assert len(seen) == 4
