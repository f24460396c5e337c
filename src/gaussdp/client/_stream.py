"""A generation streamed over the service's WebSocket: an iterator of tokens with flow control.

See :mod:`gaussdp.service.streaming` for the protocol. The iterator acknowledges the tokens it has
received each time the next one is asked for; with ``window=1`` (the default of
:meth:`GaussDPClient.stream_generate <gaussdp.client.GaussDPClient.stream_generate>`) the server
computes, and charges, a token only when the consumer asks for it, so that breaking out of the loop
and closing the stream leaves the session charged for exactly the tokens received.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from gaussdp.client._errors import BudgetExhausted, ConnectionFailed, ServiceError, error_for
from gaussdp.client._types import Token

__all__ = ["TokenStream"]


class TokenStream(Iterator[Token]):
    """Tokens of one streamed generation, as they come (each already charged to the session).

    Attributes:
        info: the server's ``start`` message (``stream_id``, ``sigma``, ``layer``, ...).
        tokens: every token received so far (also those drained by :meth:`close`).
        end: the server's ``end`` message once the stream ended normally (``finish_reason``,
            ``tokens_sent``, ``spent``, ``remaining``), else ``None``.

    Raises (from iteration):
        BudgetExhausted: the session's budget ran out; ``tokens_sent``, ``spent``, ``remaining``
            say where (every token sent was charged, nothing else).
        ServiceError: any other refusal, with the service's code. ``generation_failed`` (status
            500): a token's forward pass failed; ``body["tokens_charged"]`` and
            ``body["charged_not_sent"]`` say whether it was charged (that charge stands).
    """

    def __init__(self, ws: Any, info: dict[str, Any], timeout: float) -> None:
        self._ws = ws
        self.info = info
        self.tokens: list[Token] = []
        self.end: dict[str, Any] | None = None
        self._timeout = timeout
        self._done = False
        self._asked = False

    @property
    def stream_id(self) -> str:
        return str(self.info["stream_id"])

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> Token:
        if self._done:
            raise StopIteration
        if self._asked:  # the consumer wants one more: acknowledge what was received
            from websockets.exceptions import ConnectionClosed

            try:
                self._ws.send(json.dumps({"ack": len(self.tokens)}))
            except ConnectionClosed:
                pass  # the server ended the stream (e.g. 4402): its last message is still to be read
            except Exception as exc:
                self._abandon()
                raise ConnectionFailed(f"the stream's connection broke: {exc}") from exc
        self._asked = True
        message = self._receive()
        if message.get("type") == "token":
            token = Token.of(message)
            self.tokens.append(token)
            return token
        self._finish(message)
        raise StopIteration

    def _receive(self) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        try:
            raw = self._ws.recv(timeout=self._timeout)
        except ConnectionClosed as exc:
            self._abandon()
            rcvd = exc.rcvd
            raise ConnectionFailed(
                f"the stream closed without an end message (code {getattr(rcvd, 'code', None)})"
            ) from exc
        except TimeoutError as exc:
            self._abandon()
            raise ConnectionFailed(f"no message from the server within {self._timeout:g} s") from exc
        message = json.loads(raw)
        if not isinstance(message, dict):
            self._abandon()
            raise ServiceError(f"unexpected message from the server: {raw!r}")
        return message

    def _finish(self, message: dict[str, Any]) -> None:
        """An ``end`` (store it) or an ``error`` (raise it); the server closes after either."""
        self._abandon()
        if message.get("type") == "end":
            self.end = message
            return
        if message.get("type") != "error":
            raise ServiceError(f"unexpected message from the server: {message!r}")
        code = message.get("error")
        exc = error_for(_status_of(code), message)
        if isinstance(exc, BudgetExhausted):
            exc.tokens_sent = message.get("tokens_sent")
            exc.spent = message.get("spent")
            exc.remaining = message.get("remaining")
        raise exc

    def _abandon(self) -> None:
        self._done = True
        try:
            self._ws.close()
        except Exception:  # already closed
            pass

    def close(self) -> None:
        """Stop the stream: ask the server to stop, keep the tokens still in flight (they were
        charged) in :attr:`tokens`, and close. Idempotent; the ``with`` block calls it."""
        if self._done:
            return
        try:
            self._ws.send(json.dumps({"stop": True}))
            while True:
                message = self._receive()
                if message.get("type") == "token":
                    self.tokens.append(Token.of(message))
                    continue
                try:
                    self._finish(message)
                except ServiceError:
                    pass  # the stream is over either way
                return
        except Exception:  # the connection is gone: nothing more can arrive
            self._abandon()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The HTTP status of each error a stream can end with (the service's table, gaussdp.service.errors:
# the client does not import the service; tests/client checks that the two agree).
_STATUS = {
    "unauthorized": 401,
    "forbidden": 403,
    "not_found": 404,
    "timeout": 408,
    "budget_exhausted": 409,
    "idempotency_key_used": 409,
    "ledger_contention": 409,
    "too_large": 413,
    "invalid": 422,
    "json_too_deep": 422,
    "work_limit_exceeded": 422,
    "rate_limited": 429,
    "too_many_generations": 429,
    "database_unavailable": 503,
    "internal": 500,
    "generation_failed": 500,
}


def _status_of(code: Any) -> int:
    return _STATUS.get(str(code), 409)
