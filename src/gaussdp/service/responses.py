"""The error statuses of the service's routes, as OpenAPI entries with their body schemas, and the
opaque cursor of paginated routes."""

from __future__ import annotations

import base64
from typing import Any

from gaussdp.service.models import ErrorOut, InvalidOut

__all__ = ["CURSOR_PATTERN", "IdempotencyKeyUsed", "after_cursor", "cursor_after", "responses"]


class IdempotencyKeyUsed(Exception):
    """A request's idempotency key was already charged and answered: the service answers 409
    ``idempotency_key_used`` and releases nothing new (a second noisy answer would not be covered
    by the one charge). A client that retried after losing the first answer gets this, not a
    second charge."""


_RETRY_AFTER = {
    "Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}
}
_ERRORS: dict[int, dict[str, Any]] = {
    400: {"model": ErrorOut, "description": "The body cannot be parsed (not UTF-8 JSON)."},
    401: {
        "model": ErrorOut,
        "description": "Missing, malformed, unknown, revoked or expired API key.",
        "headers": {"WWW-Authenticate": {"description": "Bearer", "schema": {"type": "string"}}},
    },
    403: {"model": ErrorOut, "description": "The API key's scopes do not allow this route."},
    404: {
        "model": ErrorOut,
        "description": "No such session (or corpus, or job) for this tenant (others' are invisible).",
    },
    409: {
        "model": ErrorOut,
        "description": "budget_exhausted (nothing charged or released), idempotency_key_used (charged "
        "and answered before: nothing new charged or released), "
        "session_conflict, or ledger_contention (with Retry-After).",
        "headers": _RETRY_AFTER,
    },
    413: {"model": ErrorOut, "description": "Request body over max_body_bytes (not read)."},
    422: {"model": InvalidOut, "description": "Invalid fields or values (named); nothing charged."},
    429: {"model": ErrorOut, "description": "Rate or tenant limit reached.", "headers": _RETRY_AFTER},
    503: {
        "model": ErrorOut,
        "description": "The ledger's database cannot be reached; nothing released.",
        "headers": _RETRY_AFTER,
    },
}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI entries of the error statuses a route can answer, with their body schemas."""
    return {code: _ERRORS[code] for code in codes}


# A cursor is opaque to clients: 11 base64url characters (8 bytes). Every string of that shape is a
# valid position (so that the schema describes exactly what is accepted); ids past the end give an
# empty page.
CURSOR_PATTERN = r"^[A-Za-z0-9_-]{11}$"
_MAX_ID = 2**63 - 1  # BIGINT


def cursor_after(last_id: int) -> str:
    return base64.urlsafe_b64encode(int(last_id).to_bytes(8, "big")).decode().rstrip("=")


def after_cursor(cursor: str | None) -> int:
    """The charge id a cursor continues after (0 for none)."""
    if cursor is None:
        return 0
    return min(_MAX_ID, int.from_bytes(base64.urlsafe_b64decode(cursor + "="), "big"))
