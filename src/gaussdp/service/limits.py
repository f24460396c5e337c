"""Request limits: body size as pure ASGI middleware, and per-key rate limits (token buckets).

Body size: refused early, the whole body is never buffered. A declared ``Content-Length`` over the
limit is answered 413 before a byte of the body is read; a body without one (chunked) is counted as
it streams in and cut off with 413 as soon as it passes the limit. ``path_limits`` gives some
routes their own limit (regular expressions matched against the whole path, first match wins),
e.g. corpus uploads and the CKKS public context, whose rotation keys weigh several megabytes.

Rate limits: :class:`RateLimiter` keeps its buckets in the process; :class:`SharedRateLimiter` in a
memory-mapped file that every worker process of one host shares (``gaussdp serve --workers N``),
so that a key's rate holds across workers. Measured: about 14 us per request on a loaded 2-core
machine, against about 1.6 us in-process; a PostgreSQL ``UPDATE ... RETURNING`` per request would
cost a database round trip (0.2-1 ms) and hold the ledger's connections, for a limit that is
advisory (budgets, not rates, protect privacy).
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

from starlette.exceptions import HTTPException

__all__ = ["BodySizeLimit", "BodyTooLarge", "RateLimiter", "SharedRateLimiter"]


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int, *, own_limit: bool = False, note: str | None = None) -> None:
        hint = (
            note
            if note is not None
            else "this route's own limit (decimal bytes); split the upload"
            if own_limit
            else "max_body_bytes); send a smaller vector or use vector_b64 (4 bytes per float32"
        )
        super().__init__(
            status_code=413, detail=f"request body too large: the limit is {limit} bytes ({hint})"
        )


class BodySizeLimit:
    def __init__(
        self,
        app: Any,
        max_body_bytes: int,
        path_limits: Mapping[str, int] | None = None,
        path_notes: Mapping[str, str] | None = None,
    ) -> None:
        self.app = app
        self.max_body_bytes = int(max_body_bytes)
        self.path_limits = [(re.compile(rx), int(n)) for rx, n in (path_limits or {}).items()]
        # what a route's 413 says about its limit, in the user's terms (e.g. "text up to 20 MB")
        self.path_notes = [(re.compile(rx), note) for rx, note in (path_notes or {}).items()]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        own = next((n for rx, n in self.path_limits if rx.fullmatch(path)), None)
        limit = self.max_body_bytes if own is None else own
        note = next((n for rx, n in self.path_notes if rx.fullmatch(path)), None)
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _reply(send, 400, "invalid Content-Length header", path)
                    return
                if declared > limit:
                    await _reply(
                        send, 413, BodyTooLarge(limit, own_limit=own is not None, note=note).detail, path
                    )
                    return
        received = 0
        started = False

        async def limited_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit, own_limit=own is not None, note=note)
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
            await _reply(send, 413, exc.detail, path)


async def _reply(send: Any, status: int, detail: str, path: str) -> None:
    from gaussdp.service.errors import OPENAI_PATHS

    answer: dict[str, Any] = {"detail": detail}
    if path in OPENAI_PATHS:  # OpenAI's shape, so that an OpenAI client shows the message
        code = "too_large" if status == 413 else "bad_request"
        answer["error"] = {"message": detail, "type": code, "code": code, "param": None}
    body = json.dumps(answer).encode()
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


class RateLimiter:
    """A token bucket per API key, in this process: ``rate_per_s`` requests a second on average,
    bursts of up to ``burst``. With several worker processes each keeps its own buckets, so a key
    may reach ``workers`` times the rate in all (set the rate per worker accordingly)."""

    def __init__(self, rate_per_s: float, burst: int | None = None) -> None:
        if not rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got rate_per_s={rate_per_s!r}")
        self.rate = float(rate_per_s)
        self.burst = float(burst if burst is not None else max(1, math.ceil(rate_per_s)))
        if not self.burst >= 1:
            raise ValueError(f"burst must be >= 1, got burst={burst!r}")
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """Spend one token of ``key``: 0.0 when allowed, else the seconds until one is available."""
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.get(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            if tokens >= 1.0:
                if len(self._buckets) > 100_000:  # bounded memory; a cleared bucket starts full
                    self._buckets.clear()
                self._buckets[key] = (tokens - 1.0, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1.0 - tokens) / self.rate


_SLOT = struct.Struct("<Qdd")  # key hash (0: empty), tokens, time of the last update (monotonic)
_PROBES = 16


class SharedRateLimiter:
    """Token buckets per API key shared by every worker process of one host, in a memory-mapped file.

    ``rate_per_s`` requests a second per key *in all workers together*, bursts of up to ``burst``.
    Each :meth:`take` holds an exclusive ``flock`` on the file (and a thread lock: ``flock`` is per open
    file, shared by a process's threads) for a few microseconds while it refills and spends the
    key's bucket: a hash table of ``slots`` buckets (16 bytes of the key's SHA-256, open addressing over
    16 slots). ``time.monotonic`` is the system-wide ``CLOCK_MONOTONIC`` on Linux, the same in every
    process. Where all 16 slots of a key's probe window are taken, the least recently used one is
    reused: that key's bucket starts full again (only with many thousand active keys).

    Args:
        path: the file; created (sized) if missing. ``gaussdp serve`` makes one per server run
            (``GAUSSDP_RATE_LIMIT_FILE``) before it starts its workers.
    """

    def __init__(
        self, path: str, rate_per_s: float, burst: int | None = None, *, slots: int = 1 << 14
    ) -> None:
        import fcntl

        if not rate_per_s > 0:
            raise ValueError(f"rate_per_s must be > 0, got rate_per_s={rate_per_s!r}")
        self.rate = float(rate_per_s)
        self.burst = float(burst if burst is not None else max(1, math.ceil(rate_per_s)))
        if not self.burst >= 1:
            raise ValueError(f"burst must be >= 1, got burst={burst!r}")
        self._fcntl = fcntl
        self._slots = int(slots)
        size = self._slots * _SLOT.size
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                if os.fstat(self._fd).st_size < size:
                    os.ftruncate(self._fd, size)  # zero-filled: every slot empty
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            self._map = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """Spend one token of ``key``: 0.0 when allowed, else the seconds until one is available."""
        h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") | 1  # never 0 (empty)
        fcntl, m = self._fcntl, self._map
        with self._lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                now = time.monotonic()
                first = h % self._slots
                chosen, oldest_at, tokens, at = -1, math.inf, self.burst, now
                for i in range(_PROBES):
                    slot = (first + i) % self._slots
                    kh, t, a = _SLOT.unpack_from(m, slot * _SLOT.size)
                    if kh == h:
                        chosen, tokens, at = slot, t, a
                        break
                    if kh == 0:
                        chosen = slot
                        break
                    if a < oldest_at:
                        chosen, oldest_at = slot, a
                tokens = min(self.burst, tokens + max(0.0, now - at) * self.rate)
                if tokens >= 1.0:
                    _SLOT.pack_into(m, chosen * _SLOT.size, h, tokens - 1.0, now)
                    return 0.0
                _SLOT.pack_into(m, chosen * _SLOT.size, h, tokens, now)
                return (1.0 - tokens) / self.rate
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        self._map.close()
        os.close(self._fd)
