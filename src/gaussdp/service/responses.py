"""The opaque cursor of paginated routes; the error statuses' OpenAPI entries are re-exported from
their one home, :mod:`gaussdp.service.errors`."""

from __future__ import annotations

import base64

from gaussdp.service.errors import responses

__all__ = ["CURSOR_PATTERN", "after_cursor", "cursor_after", "responses"]


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
