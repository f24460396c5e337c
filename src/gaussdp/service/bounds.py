"""Every client byte bounded before it is parsed: JSON nesting, WebSocket messages, the ASGI server.

- **JSON depth.** :func:`json_depth_within` answers whether a JSON text nests at most ``limit``
  arrays/objects, without parsing it (C-speed byte operations and numpy, chunk by chunk: bounded
  memory); :class:`JSONDepthLimit` applies it, as the body streams in, to every request body that
  FastAPI would parse as JSON (no ``Content-Type``, ``application/json`` or ``+json``), so that no
  route can meet a body deeper than :data:`MAX_JSON_DEPTH` (422 ``json_too_deep``: Python's parser
  would otherwise recurse, and fail with a ``RecursionError``, on a few kilobytes of ``[``).
  :func:`loads_bounded` does the same for one WebSocket message or one corpus line.
- **WebSocket messages.** The server accepts no frame over :data:`WS_MAX_MESSAGE_BYTES` (the
  generation stream's start message is the largest one: a 16,384-character prompt, escaped),
  without compression (``permessage-deflate`` off: a small compressed frame cannot inflate into a
  large one), and stops reading a connection while the application has not taken its messages
  (:func:`uvicorn_options`). Inside a stream the messages have their own, smaller limits
  (:mod:`gaussdp.service.streaming`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from gaussdp.service.errors import Refusal

__all__ = [
    "MAX_JSON_DEPTH",
    "WS_MAX_MESSAGE_BYTES",
    "WS_MAX_QUEUE",
    "JSONDepthLimit",
    "json_depth_within",
    "loads_bounded",
    "uvicorn_options",
]

#: Deepest nesting of arrays and objects a JSON body may have (the API's bodies need 3).
MAX_JSON_DEPTH = 32
#: Largest WebSocket message the server reads (a start message with the longest prompt, escaped
#: as ``\\uXXXX``: 16,384 x 6 bytes, and its other fields).
WS_MAX_MESSAGE_BYTES = 128 * 1024
#: Messages the ASGI server's ``websockets`` protocol may hold for the application.
WS_MAX_QUEUE = 4
_CHUNK = 1 << 16  # brackets and quotes scanned at a time: a too deep body stops early
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')


def uvicorn_options() -> dict[str, Any]:
    """The options every ``uvicorn`` the service runs under gets (``gaussdp serve``, ServerThread).

    ``websockets-sansio`` stops reading a connection after each message until the application has
    taken it (the older ``websockets`` protocol reads ahead up to ``ws_max_queue`` messages, which is
    bounded too, by :data:`WS_MAX_QUEUE`); no compression; no message over the limit (the
    connection is closed with 1009, "message too big", before the application sees it).
    """
    return {
        "ws": "websockets-sansio",
        "ws_max_size": WS_MAX_MESSAGE_BYTES,
        "ws_max_queue": WS_MAX_QUEUE,
        "ws_per_message_deflate": False,
    }


class _DepthScanner:
    """The nesting depth of a JSON text fed in chunks, with bounded memory (no parse).

    A backslash can only appear inside a string, where it escapes the next byte: removing escaped
    backslashes, then escaped quotes, leaves quotes that open and close strings; brackets between an
    even number of them are structure. A run of backslashes at the end of a chunk is carried to the
    next, so that no escape is split.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.depth = 0
        self.in_string = False
        self.exceeded = False
        self._carry = b""

    def feed(self, data: bytes, final: bool = False) -> bool:
        """Scan more bytes; False once the depth has passed the limit."""
        if self.exceeded:
            return False
        data = self._carry + data
        self._carry = b""
        if b"\\" in data:
            if not final:
                stripped = data.rstrip(b"\\")
                self._carry, data = data[len(stripped) :], stripped
            data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
        marks = data.translate(None, _NOT_STRUCTURE)  # quotes and brackets only (C-speed)
        for start in range(0, len(marks), _CHUNK):
            if not self._scan(marks[start : start + _CHUNK]):
                self.exceeded = True
                return False
        return True

    def _scan(self, marks: bytes) -> bool:
        if not self.in_string and b'"' not in marks:  # no strings: every bracket is structure
            opens = marks.count(b"[") + marks.count(b"{")
            if self.depth + opens <= self.limit:
                self.depth += 2 * opens - len(marks)
                return True
        c = np.frombuffer(marks, dtype=np.uint8)
        quote = c == ord('"')
        # inside a string: an odd number of quotes so far (its opening quote included)
        inside = (np.cumsum(quote, dtype=np.int64) + int(self.in_string)) & 1
        step = np.zeros(c.shape, dtype=np.int64)
        step[((c == ord("[")) | (c == ord("{"))) & (inside == 0)] = 1
        step[((c == ord("]")) | (c == ord("}"))) & (inside == 0)] = -1
        depth = self.depth + np.cumsum(step)
        if int(depth.max()) > self.limit:
            return False
        self.depth = int(depth[-1])
        self.in_string = bool(inside[-1])
        return True


def json_depth_within(data: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether the JSON text ``data`` nests at most ``limit`` arrays and objects (without parsing it).

    Exact for valid JSON; for invalid JSON the answer only decides whether it is parsed (and then
    refused by the parser).
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    return _DepthScanner(limit).feed(raw, final=True)


def loads_bounded(data: bytes | str, *, max_bytes: int, limit: int = MAX_JSON_DEPTH, what: str) -> Any:
    """``json.loads`` of one message, refused before parsing when over ``max_bytes`` (``too_large``)
    or deeper than ``limit`` (``json_too_deep``), and ``invalid`` when it is not JSON.

    Raises:
        Refusal: with the code of the refusal, naming ``what``.
    """
    size = len(data.encode("utf-8", "surrogatepass")) if isinstance(data, str) else len(data)
    if size > max_bytes:
        raise Refusal("too_large", f"{what}: {size} bytes, the limit is {max_bytes}")
    if not json_depth_within(data, limit):
        raise Refusal("json_too_deep", f"{what}: JSON nested deeper than {limit} levels")
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise Refusal("invalid", f"{what}: not valid JSON") from None


def _parsed_as_json(scope: Any) -> bool:
    """Whether FastAPI would parse this request's body as JSON (as ``fastapi.routing`` decides)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media == b"application/json" or (
                media.startswith(b"application/") and media.endswith(b"+json")
            )
    return True


class JSONDepthLimit:
    """ASGI middleware: a JSON request body deeper than ``limit`` is refused with 422
    ``json_too_deep`` as soon as the scan passes the limit, before any of it is parsed.

    The body is scanned as it streams through (nothing is buffered here); the application's own
    reading of the body is then interrupted with the refusal. ``raw_paths`` (regular expressions
    matched against the whole path) are routes whose bodies are not JSON whatever their
    ``Content-Type`` says (a corpus, a CKKS context): they are not scanned.
    """

    def __init__(self, app: Any, limit: int = MAX_JSON_DEPTH, raw_paths: Sequence[str] = ()) -> None:
        self.app = app
        self.limit = int(limit)
        self.raw_paths = [re.compile(rx) for rx in raw_paths]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        raw = any(rx.fullmatch(scope.get("path", "")) for rx in self.raw_paths)
        if scope["type"] != "http" or raw or not _parsed_as_json(scope):
            await self.app(scope, receive, send)
            return
        scanner = _DepthScanner(self.limit)

        async def scanned_receive() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                if not scanner.feed(body, final=not message.get("more_body", False)):
                    raise Refusal("json_too_deep", f"body: JSON nested deeper than {self.limit} levels")
            return message

        await self.app(scope, scanned_receive, send)
