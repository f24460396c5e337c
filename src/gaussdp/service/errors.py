"""The service's refusals: ONE table from which the HTTP statuses, the WebSocket close codes, the
exception handlers and the OpenAPI entries all come, so that they cannot drift apart.

Each row of :data:`ERRORS` is a stable ``error`` code (what programs match on), the HTTP status a
route answers with it, the close code a WebSocket stream ends with (4000 + the status, except
``budget_exhausted``: 4402, "payment required", and ``internal``: 1011), whether the answer carries
``Retry-After``, and what it means. Every error body is ``{"detail": ..., "error": CODE}`` (422 for
invalid fields: ``{"detail": [issues]}``). A refused WebSocket upgrade is answered the same way, over
HTTP; an open stream that ends with an error sends ``{"type": "error", "error": CODE, "detail": ...,
"tokens_sent": n}`` and closes with the close code of that row.

Raise :class:`Refusal` (``Refusal("quota_exceeded", "...")``) in routes; the library's exceptions
(:class:`~gaussdp.budget.BudgetExhausted`, ...) are mapped by :func:`code_of`. :func:`install`
registers the handlers on an app, :func:`document` makes its OpenAPI 422 entries the table's,
:func:`responses` gives a route's OpenAPI entries, :func:`close_code` a stream's close code and
:func:`websocket_close_codes` the close codes of the OpenAPI document.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import HTTPException
from starlette.exceptions import HTTPException as StarletteHTTPException

from gaussdp.service.models import ErrorOut, InvalidOut, OpenAIErrorOut

__all__ = [
    "ERRORS",
    "OPENAI_PATHS",
    "ErrorKind",
    "Refusal",
    "close_code",
    "code_of",
    "detail_of",
    "document",
    "install",
    "responses",
    "websocket_close_codes",
]


@dataclass(frozen=True)
class ErrorKind:
    """One row of the table: a stable code, its HTTP status and WebSocket close code, and its meaning."""

    code: str
    status: int
    close: int
    summary: str
    retry_after: bool = False  # the answer carries Retry-After (seconds)
    http: bool = True  # answered by HTTP routes (False: WebSocket streams only)
    ws: bool = True  # may end a WebSocket stream


_ROWS = (
    ErrorKind("bad_request", 400, 4400, "the body cannot be parsed (not UTF-8 JSON)", ws=False),
    ErrorKind("unauthorized", 401, 4401, "missing, malformed, unknown, revoked or expired API key"),
    ErrorKind("forbidden", 403, 4403, "the API key's scope does not allow this route"),
    ErrorKind(
        "not_found", 404, 4404, "no such session, corpus or job for this tenant (others' are invisible)"
    ),
    ErrorKind(
        "ckks_context_unknown",
        404,
        4404,
        "the CKKS context is not (or no longer) held here: upload it again",
        ws=False,
    ),
    ErrorKind("timeout", 408, 4408, "no start message within the deadline", http=False),
    ErrorKind("budget_exhausted", 409, 4402, "the session's budget cannot pay: nothing charged or released"),
    ErrorKind(
        "idempotency_key_used", 409, 4409, "charged and answered before: nothing new charged or released"
    ),
    ErrorKind(
        "ledger_contention", 409, 4409, "concurrent charges kept moving the history; retry", retry_after=True
    ),
    ErrorKind(
        "session_conflict", 409, 4409, "the session exists with another budget or accountant", ws=False
    ),
    ErrorKind(
        "job_not_succeeded", 409, 4409, "the fine-tuning job has no adapter (it has not succeeded)", ws=False
    ),
    ErrorKind("too_large", 413, 4413, "request body (or WebSocket message) over its limit, not read"),
    ErrorKind("invalid", 422, 4422, "invalid fields or values (named); nothing charged"),
    ErrorKind("json_too_deep", 422, 4422, "JSON nested deeper than the limit, not parsed; nothing charged"),
    ErrorKind("work_limit_exceeded", 422, 4422, "more than the request's CPU limit of work; nothing charged"),
    ErrorKind("upgrade_required", 426, 4426, "a plain HTTP request to a WebSocket route", ws=False),
    ErrorKind("rate_limited", 429, 4429, "the API key's rate limit", retry_after=True),
    ErrorKind(
        "too_many_generations",
        429,
        4429,
        "the tenant's share of generation slots (or the server's) is in use",
        retry_after=True,
    ),
    ErrorKind("tenant_limit_exceeded", 429, 4429, "the tenant's cap on sessions or total epsilon", ws=False),
    ErrorKind(
        "quota_exceeded",
        429,
        4429,
        "the tenant's quota (stored corpora, jobs, CKKS context memory)",
        ws=False,
    ),
    ErrorKind(
        "capacity_exceeded",
        429,
        4429,
        "the server's memory for CKKS contexts is full",
        retry_after=True,
        ws=False,
    ),
    ErrorKind(
        "database_unavailable",
        503,
        4503,
        "the ledger's database cannot be reached; nothing released",
        retry_after=True,
    ),
    ErrorKind(
        "generation_failed",
        500,
        1011,
        "a token's forward pass failed (never retried); the detail says whether its charge was recorded "
        "(it then stands, with its charge_id); nothing from it was released",
    ),
    ErrorKind("internal", 500, 1011, "a bug; the tokens sent so far were charged, nothing else", http=False),
)
#: Every refusal of the service, by code.
ERRORS: dict[str, ErrorKind] = {row.code: row for row in _ROWS}

#: The routes whose error bodies take OpenAI's shape, ``{"error": {"message", "type", "code",
#: "param"}, "detail"}`` (:class:`~gaussdp.service.models.OpenAIErrorOut`), so that an OpenAI client
#: shows the message: the same rows, statuses and headers as every other route.
OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})

# The code of an HTTPException raised without one (FastAPI's own 400 and 422, a 404 from a route).
_DEFAULT_CODE = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found"}
_DEFAULT_CODE |= {413: "too_large", 422: "invalid", 429: "rate_limited", 503: "database_unavailable"}


class Refusal(HTTPException):
    """A refusal with its code from :data:`ERRORS`: raise it anywhere a route may refuse."""

    def __init__(self, code: str, detail: str, *, headers: dict[str, str] | None = None) -> None:
        kind = ERRORS[code]
        if kind.retry_after and not (headers and "Retry-After" in headers):
            headers = {**(headers or {}), "Retry-After": "1"}
        if code == "unauthorized":
            headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
        super().__init__(kind.status, detail, headers)
        self.code = code


def _library_codes() -> tuple[tuple[type[BaseException], str], ...]:
    """The library's exceptions -> codes, most specific first (imported late: the budget layer)."""
    from gaussdp.budget import (
        BudgetExhausted,
        IdempotencyKeyUsed,
        LedgerContention,
        PrincipalConflict,
        StoreUnavailable,
        TenantLimitExceeded,
    )
    from gaussdp.errors import PrivacyError, WorkLimitExceeded
    from gaussdp.service.generation import GenerationFailed
    from gaussdp.service.jobs import QuotaExceeded

    return (
        (GenerationFailed, "generation_failed"),
        (TenantLimitExceeded, "tenant_limit_exceeded"),
        (QuotaExceeded, "quota_exceeded"),
        (BudgetExhausted, "budget_exhausted"),
        (IdempotencyKeyUsed, "idempotency_key_used"),
        (LedgerContention, "ledger_contention"),
        (PrincipalConflict, "session_conflict"),
        (StoreUnavailable, "database_unavailable"),
        (WorkLimitExceeded, "work_limit_exceeded"),
        (PrivacyError, "invalid"),
    )


def code_of(exc: BaseException) -> str:
    """The code of any exception a route or stream may end with (``internal`` for a bug)."""
    if isinstance(exc, Refusal):
        return exc.code
    if isinstance(exc, StarletteHTTPException):
        return _DEFAULT_CODE.get(exc.status_code, "invalid" if exc.status_code < 500 else "internal")
    for cls, code in _library_codes():
        if isinstance(exc, cls):
            return code
    from fastapi.exceptions import RequestValidationError
    from pydantic import ValidationError

    if isinstance(exc, ValidationError | RequestValidationError):
        return "invalid"
    return "internal"


def close_code(code: str) -> int:
    """The WebSocket close code of ``code``."""
    return ERRORS[code].close


def detail_of(exc: BaseException) -> str:
    """What a refusal says, for people (an HTTP exception's ``detail``, else the message)."""
    detail = exc.detail if isinstance(exc, StarletteHTTPException) else str(exc)
    return str(detail)


def install(app: Any, on_refused: Callable[[str], None]) -> None:
    """Register the handlers of every refusal on ``app``: the body ``{"detail", "error"}`` with the
    status, ``Retry-After`` and ``WWW-Authenticate`` of the code's row; ``on_refused(code)`` counts it."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.routing import Match

    def answer(
        request: Any,
        code: str,
        detail: Any,
        headers: dict[str, str] | None = None,
        error: str | None = None,
    ) -> Any:
        kind = ERRORS[code]
        headers = dict(headers or {})
        if kind.retry_after:
            headers.setdefault("Retry-After", "1")
        if code == "unauthorized":
            headers.setdefault("WWW-Authenticate", "Bearer")
        body: dict[str, Any] = {"detail": detail, "error": error or code}
        if request.scope.get("path") in OPENAI_PATHS:
            body["error"] = {"message": str(detail), "type": error or code, "code": code, "param": None}
        return JSONResponse(body, status_code=kind.status, headers=headers)

    async def library(request: Any, exc: Exception) -> Any:
        code = code_of(exc)
        on_refused(code)
        if code == "database_unavailable":
            import logging

            logging.getLogger("gaussdp.service").warning("ledger database unavailable: %s", exc)
            return answer(request, code, "the ledger's database cannot be reached; nothing was released")
        # a PrivacyError other than the ones above keeps its class name (InvalidParameter, UnsafeInput)
        return answer(request, code, str(exc), error=type(exc).__name__ if code == "invalid" else None)

    for cls, _ in _library_codes():
        app.add_exception_handler(cls, library)

    async def validation(request: Any, exc: RequestValidationError) -> Any:
        # FastAPI's default echoes the input back: it may be huge, or NaN (which JSON cannot encode).
        errors = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        body: dict[str, Any] = {"detail": errors}
        if request.scope.get("path") in OPENAI_PATHS:
            message = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors)
            param = ".".join(map(str, errors[0]["loc"][1:])) if errors and errors[0]["loc"] else None
            body["error"] = {"message": message, "type": "invalid", "code": "invalid", "param": param or None}
        return JSONResponse(body, status_code=422)

    app.add_exception_handler(RequestValidationError, validation)

    async def http(request: Any, exc: StarletteHTTPException) -> Any:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Allow lists every method of the path (routes are per method)
            allowed = sorted(
                m
                for m in _METHODS
                if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in app.routes)
            )
            headers["Allow"] = ", ".join(allowed)
            return JSONResponse({"detail": exc.detail}, status_code=405, headers=headers)
        code = code_of(exc)
        if exc.status_code != ERRORS[code].status:  # a status outside the table (e.g. 426): as raised
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)
        if isinstance(exc, Refusal) or exc.status_code in (401, 403, 429):
            on_refused(code)
        return answer(request, code, exc.detail, headers)

    app.add_exception_handler(StarletteHTTPException, http)


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
_RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}
}


def responses(*statuses: int, openai: bool = False) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI entries of the error statuses a route can answer: each lists the codes of that
    status (from :data:`ERRORS`), with the body schema and the headers they carry (``openai``: the
    body of :data:`OPENAI_PATHS`, :class:`~gaussdp.service.models.OpenAIErrorOut`)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        rows = [r for r in _ROWS if r.status == status and r.http]
        if not rows:
            raise ValueError(f"status {status} is not in the error table")
        entry: dict[str, Any] = {
            "model": OpenAIErrorOut if openai else InvalidOut if status == 422 else ErrorOut,
            "description": "; ".join(f"`{r.code}`: {r.summary}" for r in rows) + ".",
        }
        headers: dict[str, Any] = {}
        if any(r.retry_after for r in rows):
            headers |= _RETRY_AFTER
        if status == 401:
            headers["WWW-Authenticate"] = {"description": "Bearer", "schema": {"type": "string"}}
        if headers:
            entry["headers"] = headers
        out[status] = entry
    return out


def websocket_close_codes(codes: Iterable[str] | None = None) -> dict[str, dict[str, Any]]:
    """The close codes of a WebSocket route, for its OpenAPI entry (``x-websocket-close-codes``):
    close code -> the error codes that end a stream with it, and what they mean."""
    out: dict[str, dict[str, Any]] = {"1000": {"errors": [], "description": "the stream's normal end"}}
    for row in [r for r in _ROWS if r.ws] if codes is None else [ERRORS[c] for c in codes]:
        entry = out.setdefault(str(row.close), {"errors": [], "description": ""})
        entry["errors"].append(row.code)
        entry["description"] = "; ".join(filter(None, [entry["description"], f"{row.code}: {row.summary}"]))
    return out


def document(app: Any) -> None:
    """Make ``app``'s OpenAPI entries of 422 come from the table too: FastAPI adds its own 422
    ("Validation Error") to every route with parameters; it is replaced by the table's row (the
    handler answers :class:`~gaussdp.service.models.InvalidOut`, which the row documents)."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = original()
        if "InvalidOut" not in schema.get("components", {}).get("schemas", {}):
            return schema
        row = {
            "description": responses(422)[422]["description"],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/InvalidOut"}}},
        }
        for methods in schema.get("paths", {}).values():
            for op in methods.values():
                entry = op.get("responses", {}).get("422")
                if entry is not None and entry.get("description") == "Validation Error":
                    op["responses"]["422"] = row
        return schema

    app.openapi = openapi
