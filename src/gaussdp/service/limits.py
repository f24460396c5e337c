"""Request body size limit as pure ASGI middleware: refuses early, never buffers the whole body.

A declared ``Content-Length`` over the limit is answered 413 before a byte of the body is read; a
body without one (chunked) is counted as it streams in and cut off with 413 as soon as it passes
the limit.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException

__all__ = ["BodySizeLimit", "BodyTooLarge"]


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(
            status_code=413,
            detail=f"request body too large: the limit is {limit} bytes (max_body_bytes); "
            "send a smaller vector or use vector_b64 (4 bytes per float32)",
        )


class BodySizeLimit:
    def __init__(self, app: Any, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = int(max_body_bytes)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _reply(send, 400, "invalid Content-Length header")
                    return
                if declared > limit:
                    await _reply(send, 413, BodyTooLarge(limit).detail)
                    return
        received = 0
        started = False

        async def limited_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge as exc:
            if started:
                raise
            await _reply(send, 413, exc.detail)


async def _reply(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
