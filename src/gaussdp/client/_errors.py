"""The client's errors: one class per way a call can fail, each carrying the service's answer."""

from __future__ import annotations

from typing import Any

from gaussdp import errors as _errors

__all__ = [
    "BudgetExhausted",
    "ConnectionFailed",
    "Forbidden",
    "IdempotencyKeyUsed",
    "InvalidRequest",
    "LimitExceeded",
    "NotFound",
    "ResponseLost",
    "ServiceError",
    "ServiceUnavailable",
    "Unauthorized",
]


class ServiceError(Exception):
    """The service refused a call (or could not be reached): ``status`` (HTTP status, or the
    WebSocket close code), ``error`` (the service's stable code, e.g. ``budget_exhausted``) and
    ``detail`` (for people)."""

    def __init__(self, detail: str, *, status: int | None = None, error: str | None = None, body: Any = None):
        super().__init__(detail if status is None else f"{status} {error or ''}: {detail}".replace(" :", ":"))
        self.detail = detail
        self.status = status
        self.error = error
        self.body = body


class Unauthorized(ServiceError):
    """401: missing, invalid, revoked or expired API key."""


class Forbidden(ServiceError):
    """403: the key's scope does not allow the route."""


class NotFound(ServiceError):
    """404: no such session for this API key's tenant."""


class InvalidRequest(ServiceError):
    """422 (or 400, 413): invalid arguments, named in ``detail``; nothing was charged."""


class BudgetExhausted(ServiceError, _errors.BudgetExhausted):
    """The session's budget cannot pay for the release: nothing more was charged or released.

    Also a :class:`gaussdp.errors.BudgetExhausted`. From a stream, ``tokens_sent``, ``spent`` and
    ``remaining`` say where the stream stopped (every token sent was charged).
    """

    tokens_sent: int | None = None
    spent: dict[str, float] | None = None
    remaining: dict[str, float] | None = None


class IdempotencyKeyUsed(ServiceError):
    """409 ``idempotency_key_used``: this key was already charged and answered; nothing new was
    charged or released (the service answers a noisy release once)."""


class ResponseLost(IdempotencyKeyUsed):
    """A retry found its idempotency key already used: the first attempt WAS charged and answered,
    but its answer was lost on the way (dropped connection, time-out). The session was charged once
    (see its history: the charge carries the key); the answer cannot be had again, by design: a
    second noisy answer would not be covered by that charge."""


class LimitExceeded(ServiceError):
    """429 ``tenant_limit_exceeded`` or ``quota_exceeded``: the tenant's caps (sessions, epsilon) or
    quotas (stored corpora, jobs, CKKS context memory) are reached; not retried, since waiting does
    not lift them (delete something, or ask the operator)."""


class ServiceUnavailable(ServiceError):
    """429 (rate limit, generation slots, CKKS memory), 503 or ``ledger_contention`` still answered
    after the retries; nothing was released."""


class ConnectionFailed(ServiceError):
    """The service could not be reached, or the connection broke, on every attempt."""


def error_for(status: int, body: Any, *, retried: bool = False) -> ServiceError:
    """The exception for an error answer (``body``: the decoded JSON, or the text)."""
    if isinstance(body, dict):
        detail, code = body.get("detail", ""), body.get("error")
    else:
        detail, code = str(body), None
    if not isinstance(detail, str):  # FastAPI's validation errors: a list of issues
        detail = "; ".join(
            f"{'.'.join(str(x) for x in d.get('loc', []))}: {d.get('msg', '')}"
            if isinstance(d, dict)
            else str(d)
            for d in detail
        )
    cls: type[ServiceError]
    if code == "budget_exhausted":
        cls = BudgetExhausted
    elif code == "idempotency_key_used":
        cls = ResponseLost if retried else IdempotencyKeyUsed
        if retried:
            detail = (
                "the first attempt of this call was charged and answered, but its answer was lost; "
                f"nothing was charged twice, and the answer cannot be had again (service: {detail})"
            )
    elif status == 401:
        cls = Unauthorized
    elif status == 403:
        cls = Forbidden
    elif status == 404:
        cls = NotFound
    elif status in (400, 413, 422):
        cls = InvalidRequest
    elif code in ("tenant_limit_exceeded", "quota_exceeded"):
        cls = LimitExceeded
    elif status in (429, 503) or code == "ledger_contention":
        cls = ServiceUnavailable
    else:
        cls = ServiceError
    return cls(str(detail), status=status, error=code, body=body)
