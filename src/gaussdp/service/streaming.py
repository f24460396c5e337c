"""Private generation over HTTP and WebSocket: ``/v1/sessions/{session_id}/generate`` (issue 20).

A served model (``gaussdp serve --model NAME=PATH``) generates greedily, token by token, with the
hidden state of one layer clipped to ``clip_norm`` and noised with ``N(0, sigma^2 I)`` in every
forward pass (:class:`gaussdp.inference.HiddenStatePrivatizer`; default layer: the last transformer
block; default relation ``"replace_one"``, sensitivity ``2 * clip_norm``). Every token's release is
charged to the session's ledger **before** the token is sent: one charge per token, with the
idempotency key ``"<stream_id>/<index>"`` (visible in ``/history``). With the model's key/value
cache the first charge covers the prompt's rows (``prompt_tokens`` Gaussian releases composed) and
each later one the new token's row. The epsilon reported is the ledger's accountant's bound on the
whole session (never an approximation).

``POST /v1/sessions/{id}/generate`` (body :class:`~gaussdp.service.models.GenerateIn`) answers the
whole generation at once (:class:`~gaussdp.service.models.GenerateOut`). When the budget runs out
after at least one token, the answer is 200 with the tokens so far, ``finish_reason``
``"budget_exhausted"`` and ``error``; at the first token it is 409 ``budget_exhausted`` (nothing
charged, nothing generated). A retry with the same ``idempotency_key`` is refused with 409
``idempotency_key_used`` (the first answer is the only one; nothing is charged twice). A key revoked
during the generation stops it before the next charge (the tokens so far are answered, with the
error ``unauthorized``).

WebSocket protocol (``/v1/sessions/{id}/generate``)
---------------------------------------------------
Authentication comes from the upgrade request, before any message is read
(:mod:`gaussdp.service.deps`): the ``Authorization: Bearer <API key>`` header (scope ``release``),
or, for browsers (which cannot set headers on a WebSocket), the subprotocols
``["gaussdp.v1", "gaussdp.key.<API key>"]`` (the server selects ``gaussdp.v1``). Giving both is
refused; a key in the URL or in a message is never read. The key, its scope and rate, and the
tenant's share of generation slots are checked on the upgrade request: a refusal is the HTTP
answer to it (401, 403, 422, 429 with ``Retry-After``; body ``{"detail", "error"}``) and the
WebSocket never opens, so nothing the client sends is read. A 401 comes after
:data:`UNAUTHORIZED_DELAY_S` (0.25 s): a loop of upgrades without a key costs the server a
sleeping coroutine each, not a busy event loop. (Under an ASGI server without the
WebSocket denial extension, the stream opens, sends the error and closes with its code.)

1. Client -> server, within :data:`START_TIMEOUT_S`: the start message, a JSON object of at most
   :data:`~gaussdp.service.bounds.WS_MAX_MESSAGE_BYTES` bytes with the fields of
   :class:`~gaussdp.service.models.GenerateIn`, plus optionally ``"window"`` (an integer >= 1,
   default ``max_new_tokens``: see flow control).
2. Server -> client: ``{"type": "start", "stream_id", "model", "layer", "prompt_tokens",
   "max_new_tokens", "window", "sigma", "clip_norm", "neighbouring", "sensitivity",
   "noise_multiplier"}``.
3. Server -> client, per token, each sent only after its charge was recorded durably:
   ``{"type": "token", "index", "token_id", "text", "charge_id"}``.
4. Client -> server, at any time: ``{"ack": n}`` (the client has received ``n`` tokens) and
   ``{"stop": true}`` (end the stream after the token in flight, if any), each at most
   :data:`CONTROL_MAX_BYTES` bytes, at most ``2 * max_new_tokens + 16`` of them. Any other message
   (not JSON, too deep, too large, binary, too many) ends the stream with its error (``invalid``,
   ``json_too_deep``, ``too_large``).
5. The end, then the server closes: ``{"type": "end", "finish_reason": "length" | "eos" | "stopped"
   | "idle" | "time_limit", "tokens_sent", "spent", "remaining"}`` with code 1000, or ``{"type":
   "error", "error": CODE, "detail", "tokens_sent", ...}`` with the close code of that error in
   :data:`gaussdp.service.errors.ERRORS` (:data:`CLOSE_CODES`). On exhaustion: ``{"type": "error",
   "error": "budget_exhausted", "tokens_sent": k, "spent": {...}, "remaining": {...}}`` and close
   code :data:`CLOSE_BUDGET_EXHAUSTED` (4402). When a token's forward pass fails (it is never
   retried): ``{"type": "error", "error": "generation_failed", "detail", "tokens_sent": k,
   "tokens_charged": k or k + 1, "charged_not_sent": [] or [{"index", "charge_id",
   "idempotency_key"}]}`` and close code 1011, whose reason repeats the two counts
   (``"generation_failed: charged N, sent K"``): the failed token's charge, when it was recorded
   before the failure, stands and is named; nothing from that token was released. A key revoked (or
   expired) during the stream ends it
   with ``unauthorized`` (4401) within 1 s (within 0.5 s of the key cache, plus at most 0.25 s
   between two looks while the stream waits for an ack, or the forward pass in flight), before any
   further charge: ``tokens_sent`` equals the stream's charges.

Flow control: the server computes (and charges) token ``i`` only when ``i < acked + window``, where
``acked`` is the client's latest ``ack`` (at most the tokens sent), and only while the client is
connected (checked before each token's forward pass). The default window lets the server run
ahead freely; ``window=1`` makes the stream pull-driven (token ``i`` is computed once the client
acknowledged token ``i - 1``): the Python client (:class:`gaussdp.client.GaussDPClient`) uses it.

Time limits, whatever the client sends: the server waits at most ``stream_idle_s`` (default
:data:`IDLE_TIMEOUT_S`) since the last token (or the start) for an ack that lets the next token go,
then ends with ``"idle"`` (acks that do not advance do not extend it); a stream lasts at most
``max_stream_s`` (default :data:`MAX_STREAM_S`), then ends with ``"time_limit"``.

What a client that leaves is charged: every charged token is sent unless the client disconnected
during that token's forward pass (the charge is made inside it); tokens are never sent uncharged.
So on a disconnect ``charges == tokens_sent``, or ``tokens_sent + 1`` when the disconnect came
during a forward pass (that one charge stays: a charge is never refunded, over-counting is the safe
side). With ``window=1`` the server is idle between a token and the client's ack for the next one:
a client that disconnects (or sends ``stop``) instead of acknowledging is charged for exactly the
tokens it was sent. A ``stop`` always ends with the ``end`` message, whose ``tokens_sent`` equals
the stream's charges.

Work per request is bounded: at most :data:`~gaussdp.service.models.MAX_NEW_TOKENS` tokens and
:data:`~gaussdp.service.models.MAX_PROMPT_TOKENS` prompt tokens (and the model's context), one
forward pass per token, the ledger's numeric work of each charge under the service's ``cpu_limit_s``
(the forward passes are bounded by the token caps and the model's size, not by it). Fair shares
(:mod:`gaussdp.service.fairness`): a generation holds one of its tenant's ``max_streams_per_tenant``
slots, under ``max_streams`` in all per worker, from authentication to its end, whatever its privacy
cost (past either: 429 ``too_many_generations``, the upgrade refused). Forward passes run in the thread
pool, never on the event loop; passes of one model take turns tenant by tenant (a fair lock per
model: the privatizer's hook is on the shared module for the duration of one pass), so streams of
other tenants interleave token by token.

This module is over 600 lines on purpose: the protocol above is documented beside the one function
that implements it (:func:`generation_router`, whose POST and WebSocket routes share their app's
generation slots and model locks), and the upgrade GET's OpenAPI entry is made from the same table.
"""

# No "from __future__ import annotations": FastAPI resolves the route's annotations at runtime.

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, WebSocket
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from gaussdp.budget import (
    BudgetExhausted,
    IdempotencyKeyUsed,
    LedgerContention,
    StoreUnavailable,
)
from gaussdp.errors import InvalidParameter, PrivacyError, WorkLimitExceeded
from gaussdp.service.auth import Caller
from gaussdp.service.bounds import WS_MAX_MESSAGE_BYTES, loads_bounded
from gaussdp.service.deps import SUBPROTOCOL, Service, SessionId, websocket_key
from gaussdp.service.errors import ERRORS, Refusal, close_code, code_of, detail_of, websocket_close_codes
from gaussdp.service.errors import responses as error_responses
from gaussdp.service.fairness import (
    DEFAULT_MAX_STREAMS,
    DEFAULT_MAX_STREAMS_PER_TENANT,
    TenantSlots,
)
from gaussdp.service.generation import Generation, GenerationFailed, revoked
from gaussdp.service.models import (
    SESSION_ID_PATTERN,
    ErrorOut,
    GenerateIn,
    GenerateOut,
)

__all__ = [
    "CLOSE_BUDGET_EXHAUSTED",
    "CLOSE_CODES",
    "CONTROL_MAX_BYTES",
    "IDLE_TIMEOUT_S",
    "MAX_STREAM_S",
    "START_TIMEOUT_S",
    "StreamLimits",
    "document_websocket",
    "generation_router",
]

logger = logging.getLogger("gaussdp.service")

CLOSE_NORMAL = 1000
CLOSE_BUDGET_EXHAUSTED = ERRORS["budget_exhausted"].close
#: WebSocket close code of each error, from the service's one table (gaussdp.service.errors).
CLOSE_CODES = {code: kind.close for code, kind in ERRORS.items()}
START_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 60.0
MAX_STREAM_S = 300.0
#: Largest message a client may send once the stream has started (an ack or a stop).
CONTROL_MAX_BYTES = 1024
KEY_RECHECK_S = 0.25  # a waiting stream re-checks its key this often (the key cache adds 0.5 s)
UNAUTHORIZED_DELAY_S = 0.25  # an upgrade without a valid key is refused after this
_SESSION_ID = re.compile(SESSION_ID_PATTERN)

_REFUSALS = (
    BudgetExhausted,
    IdempotencyKeyUsed,
    LedgerContention,
    StoreUnavailable,
    WorkLimitExceeded,
    Refusal,
)


@dataclass(frozen=True)
class StreamLimits:
    """Fair shares and time limits of generations (``gaussdp serve`` options of the same names)."""

    max_streams: int = DEFAULT_MAX_STREAMS
    max_streams_per_tenant: int = DEFAULT_MAX_STREAMS_PER_TENANT
    max_stream_s: float = MAX_STREAM_S
    stream_idle_s: float = IDLE_TIMEOUT_S

    def __post_init__(self) -> None:
        TenantSlots(self.max_streams, self.max_streams_per_tenant)  # validates both
        for name in ("max_stream_s", "stream_idle_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {name}={value!r}")


def generation_router(svc: Service) -> APIRouter:
    """The ``generate`` routes (POST and WebSocket) of :func:`gaussdp.service.app.create_app`, with
    the upgrade GET's OpenAPI entry (:func:`document_websocket`), over ``svc``: its gate (the
    WebSocket route authenticates from the upgrade request), ledger and ``stream_limits`` (fair
    shares and time limits; default :class:`StreamLimits`)."""
    gate, owned, on_refused = svc.gate, svc.owned, svc.refused
    releaser = Annotated[Caller, Depends(svc.releaser)]
    responses = error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503)
    lim = svc.stream_limits or StreamLimits()
    router = APIRouter(tags=["inference"])
    gens = svc.generations
    slots = gens.slots
    generation, checked_step, spent_remaining = gens.start, gens.step, gens.figures

    @router.post(
        "/v1/sessions/{session_id}/generate",
        response_model=GenerateOut,
        responses={**responses, **error_responses(500)},
    )
    def generate(
        session_id: SessionId,
        body: GenerateIn,
        who: releaser,
        request: Request,
    ) -> GenerateOut | JSONResponse:
        """Generate with the hidden state at ``layer`` clipped and noised for every token; each token
        charged (key ``<stream_id>/<index>``) before the answer is built.

        Greedy decoding from the noised model. The first token's charge covers the prompt's rows,
        each later one the new token's row. When the budget runs out after the first token the
        answer holds the tokens so far with ``finish_reason`` ``budget_exhausted``; before it, 409
        (nothing charged). Any other refusal of a later token (nothing charged for it) likewise
        answers the tokens so far, with ``finish_reason`` ``error`` and its code. A retried
        ``idempotency_key`` is refused with 409 ``idempotency_key_used``. A failed forward pass is
        never retried: after the first token the answer holds the tokens so far with
        ``finish_reason`` ``error``, ``error`` ``generation_failed`` and a ``detail`` that says
        whether the failed token was charged (its charge_id); at the first token, 500
        ``generation_failed`` with that detail. Holds one of the tenant's generation slots (429
        ``too_many_generations`` when none is free).
        The WebSocket route of the same path streams the tokens (see :mod:`gaussdp.service.streaming`).
        """
        p = owned(who.tenant, session_id)
        slots.acquire(who.tenant)
        try:
            gen = generation(request.app, body, p, who)
            try:
                got = gens.collect(gen, who, body.max_new_tokens)
            except GenerationFailed as exc:  # at the first token: nothing was released
                on_refused("generation_failed")
                return JSONResponse({"detail": str(exc), "error": "generation_failed"}, 500)
        finally:
            slots.release(who.tenant)
        tokens, finish, error, detail = got.tokens, got.finish, got.error, got.detail
        figures = spent_remaining(p, gen.last_receipt)
        return GenerateOut(
            stream_id=gen.stream_id,
            model=body.model,
            prompt_tokens=gen.prompt_tokens,
            tokens=tokens,
            text=gen.decode([t.token_id for t in tokens]),
            finish_reason=finish,  # type: ignore[arg-type]
            error=error,
            detail=detail,
            **gen.describe(),
            spent=figures["spent"],
            remaining=figures["remaining"],
        )

    @router.websocket("/v1/sessions/{session_id}/generate")
    async def generate_stream(websocket: WebSocket, session_id: str) -> None:
        stream = _Stream(websocket)
        try:
            await stream.run(session_id)
        except Exception as exc:  # never leave the socket open on a bug
            logger.exception("generation stream failed")
            await stream.fail(exc)
        finally:
            stream.finish()

    class _Stream:
        """One WebSocket generation: authentication, the start message, flow control, token by token."""

        def __init__(self, ws: WebSocket) -> None:
            self.ws = ws
            self.accepted = False
            self.sent = 0
            self.acked = 0
            self.window = 1
            self.received = 0
            self.max_messages = 16
            self.stop = False
            self.gone = False
            self.bad: BaseException | None = None
            self.changed = asyncio.Event()
            self.receiver: asyncio.Task[None] | None = None
            self.p: str | None = None
            self.slot: str | None = None

        async def accept(self, subprotocol: str | None = None) -> None:
            if not self.accepted:
                self.accepted = True
                await self.ws.accept(subprotocol=subprotocol)

        async def send(self, message: dict[str, Any]) -> bool:
            try:
                await self.ws.send_text(json.dumps(message))
                return True
            except Exception:  # the client left: nothing more can be sent
                self.gone = True
                return False

        async def close(self, code: int, reason: str | None = None) -> None:
            if not self.gone:
                try:
                    await self.ws.close(code, reason)
                except Exception:  # already closed by the client
                    self.gone = True

        async def fail(self, exc: BaseException) -> None:
            code = code_of(exc)
            on_refused(code)
            detail = detail_of(exc)
            if code == "internal":
                detail = "internal error; the tokens sent so far were charged, nothing else was"
            message: dict[str, Any] = {
                "type": "error",
                "error": code,
                "detail": detail,
                "tokens_sent": self.sent,
            }
            reason = None
            if isinstance(exc, GenerationFailed):
                lost = (
                    [{"index": exc.index, "charge_id": exc.receipt.charge_id, "idempotency_key": exc.key}]
                    if exc.charged
                    else []
                )
                charged = self.sent + len(lost)
                message.update(tokens_charged=charged, charged_not_sent=lost)
                reason = f"generation_failed: charged {charged}, sent {self.sent}"
            if self.p is not None and code == "budget_exhausted":
                try:
                    figures = await run_in_threadpool(spent_remaining, self.p)
                    message.update({k: v.model_dump() for k, v in figures.items()})
                except Exception:  # the figures are a courtesy; the refusal stands
                    logger.warning("could not read the spent budget of %s", self.p)
            await self.accept()
            if await self.send(message):
                await self.close(close_code(code), reason)

        def finish(self) -> None:
            if self.receiver is not None:
                self.receiver.cancel()
            if self.slot is not None:
                slots.release(self.slot)
                self.slot = None

        async def receive_loop(self) -> None:
            """Acks and stops, each bounded before it is parsed; any other message ends the stream
            with its error (the loop never dies silently: the token loop is woken either way)."""
            try:
                while self.bad is None:
                    msg = await self.ws.receive()
                    if msg["type"] == "websocket.disconnect":
                        self.gone = True
                        return
                    self.received += 1
                    self.control(msg)
                    self.changed.set()
            except Exception as exc:  # the connection broke under us: the client is gone
                logger.info("generation stream: receive failed (%s)", type(exc).__name__)
                self.gone = True
            finally:
                self.changed.set()

        def control(self, msg: Any) -> None:
            if self.received > self.max_messages:
                self.bad = Refusal("invalid", f"more than {self.max_messages} messages during one stream")
                return
            text = msg.get("text")
            if text is None:
                self.bad = Refusal("invalid", "messages are JSON text frames, not binary")
                return
            try:
                data = loads_bounded(text, max_bytes=CONTROL_MAX_BYTES, what="message during a stream")
            except Refusal as exc:
                self.bad = exc
                return
            ack = data.get("ack") if isinstance(data, dict) and set(data) == {"ack"} else None
            if isinstance(ack, int) and not isinstance(ack, bool) and ack >= 0:
                self.acked = max(self.acked, min(ack, self.sent))
            elif data == {"stop": True}:
                self.stop = True
            else:
                self.bad = Refusal("invalid", 'messages during a stream are {"ack": n} or {"stop": true}')

        async def start_message(self) -> dict[str, Any] | None:
            try:
                msg = await asyncio.wait_for(self.ws.receive(), START_TIMEOUT_S)
            except TimeoutError:
                await self.fail(Refusal("timeout", f"no start message within {START_TIMEOUT_S:g} s"))
                return None
            if msg["type"] == "websocket.disconnect":
                self.gone = True
                return None
            text = msg.get("text")
            if text is None:
                await self.fail(Refusal("invalid", "the start message is a JSON text frame (GenerateIn)"))
                return None
            try:
                start = loads_bounded(text, max_bytes=WS_MAX_MESSAGE_BYTES, what="the start message")
            except Refusal as exc:
                await self.fail(exc)
                return None
            if not isinstance(start, dict):
                await self.fail(Refusal("invalid", "the start message must be a JSON object (GenerateIn)"))
                return None
            return start

        async def deny(self, exc: Refusal) -> None:
            """Refuse the upgrade itself with the refusal's HTTP status: the stream never opens, and
            nothing the client sends is read (a server without the ASGI denial extension: the
            error message and its close code instead)."""
            if "websocket.http.response" not in self.ws.scope.get("extensions", {}):
                await self.fail(exc)
                return
            code = code_of(exc)
            on_refused(code)
            self.gone = True
            body = json.dumps({"detail": detail_of(exc), "error": code}).encode()
            # the server frames the body itself (Content-Length, Content-Type): passing ours too
            # would send each header twice (uvicorn's websockets-sansio adds its own)
            headers = [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
            await self.ws.send(
                {"type": "websocket.http.response.start", "status": exc.status_code, "headers": headers}
            )
            await self.ws.send({"type": "websocket.http.response.body", "body": body})

        async def run(self, session_id: str) -> None:
            # 1. who, and 2. the tenant's share (held from now on, whatever the stream costs): from
            # the upgrade request alone, refused before the WebSocket opens
            try:
                key, subprotocol = websocket_key(self.ws.headers, list(self.ws.scope.get("subprotocols", [])))
                if key is None:  # no key: no database, no thread
                    gate.authenticate(None)
                who = await run_in_threadpool(gate.authenticate, key, "release")
                slots.acquire(who.tenant)
            except Refusal as exc:
                if exc.code == "unauthorized":
                    # a client without a valid key waits before its refusal: a loop of hostile
                    # upgrades costs the server a sleeping coroutine, not a busy event loop
                    await asyncio.sleep(UNAUTHORIZED_DELAY_S)
                await self.deny(exc)
                return
            self.slot = who.tenant
            await self.accept(subprotocol)
            # 3. the start message: bounded in size, depth and time
            start = await self.start_message()
            if start is None:
                return
            window = start.pop("window", None)
            try:
                if not _SESSION_ID.match(session_id):
                    raise InvalidParameter(f"session_id must match {SESSION_ID_PATTERN}")
                self.p = p = await run_in_threadpool(owned, who.tenant, session_id)
                body = GenerateIn.model_validate(start)
                if window is not None:
                    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
                        raise InvalidParameter(f"window must be an integer >= 1, got window={window!r}")
                    self.window = window
                else:
                    self.window = body.max_new_tokens
                self.max_messages = 2 * body.max_new_tokens + 16
                gen = await run_in_threadpool(generation, self.ws.app, body, p, who)
            except ValidationError as exc:
                issues = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
                await self.fail(InvalidParameter(issues))
                return
            except (Refusal, PrivacyError) as exc:
                await self.fail(exc)
                return
            await self.generate(gen, body, who, p)

        async def generate(self, gen: Generation, body: GenerateIn, who: Caller, p: str) -> None:
            info = {"stream_id": gen.stream_id, "model": body.model, "prompt_tokens": gen.prompt_tokens}
            info.update(max_new_tokens=body.max_new_tokens, window=self.window, **gen.describe())
            if not await self.send({"type": "start", **info}):
                return
            self.receiver = asyncio.create_task(self.receive_loop())
            now = time.monotonic
            deadline = now() + lim.max_stream_s
            progress = now()  # the last token sent (or the start): the idle time counts from it
            finish = "length"
            for i in range(body.max_new_tokens):
                while not (self.gone or self.stop or self.bad) and i >= self.acked + self.window:
                    left = min(deadline - now(), progress + lim.stream_idle_s - now())
                    if left <= 0:
                        finish = "time_limit" if now() >= deadline else "idle"
                        break
                    self.changed.clear()
                    try:
                        await asyncio.wait_for(self.changed.wait(), min(left, KEY_RECHECK_S))
                    except TimeoutError:
                        pass
                    if not await run_in_threadpool(gate.alive, who):
                        await self.fail(revoked())
                        return
                if self.gone:
                    return  # charges == tokens sent: nothing is in flight
                if self.bad is not None:
                    await self.fail(self.bad)
                    return
                if self.stop or finish != "length":
                    finish = "stopped" if self.stop else finish
                    break
                if now() >= deadline:
                    finish = "time_limit"
                    break
                try:
                    tok = await run_in_threadpool(checked_step, gen, who, i)
                except (*_REFUSALS, PrivacyError, GenerationFailed) as exc:
                    await self.fail(exc)
                    return
                if self.gone:  # left during the forward pass: this token was charged, not sent
                    return
                if not await self.send({"type": "token", **tok.model_dump()}):
                    return
                self.sent += 1
                progress = now()
                if gen.eos is not None and tok.token_id == gen.eos:
                    finish = "eos"
                    break
            figures = await run_in_threadpool(spent_remaining, p)
            message = {"type": "end", "finish_reason": finish, "tokens_sent": self.sent}
            message.update({k: v.model_dump() for k, v in figures.items()})
            if await self.send(message):
                await self.close(CLOSE_NORMAL)

    document_websocket(router, svc.releaser)
    return router


def document_websocket(router: APIRouter, releaser: Callable[..., Caller]) -> None:
    """``GET /v1/sessions/{id}/generate``: the WebSocket stream's entry in the OpenAPI document.

    OpenAPI has no WebSocket operations; this GET is the upgrade request. Its description and its
    ``x-websocket-close-codes`` come from the error table; a plain HTTP GET (no upgrade) with a
    valid key is answered 426 Upgrade Required (its key is checked as for every route).
    """
    codes = websocket_close_codes()
    table = "\n".join(
        f"| {close} | {', '.join(f'`{c}`' for c in entry['errors']) or 'normal end'} |"
        for close, entry in sorted(codes.items())
    )
    description = (
        "The generation stream over WebSocket: upgrade this GET (`Upgrade: websocket`) with the "
        "API key in the `Authorization` header, or in the subprotocol `gaussdp.key.<key>` next to "
        f"`{SUBPROTOCOL}`. The protocol is documented in `gaussdp.service.streaming`.\n\n"
        "| close code | errors |\n|---|---|\n" + table
    )

    @router.get(
        "/v1/sessions/{session_id}/generate",
        status_code=426,
        response_class=JSONResponse,
        description=description,
        summary="Generate stream (WebSocket upgrade)",
        responses={
            101: {"description": "Switching protocols: the stream (messages and close codes as described)."},
            426: {
                "description": "A plain HTTP GET: this route is a WebSocket (upgrade required).",
                "model": ErrorOut,
                "headers": {"Upgrade": {"description": "websocket", "schema": {"type": "string"}}},
            },
            **error_responses(401, 403, 422, 429, 503),
        },
        openapi_extra={"x-websocket-close-codes": codes},
        dependencies=[Depends(releaser)],
    )
    def generate_stream_upgrade(session_id: SessionId) -> JSONResponse:
        raise Refusal(
            "upgrade_required",
            "this route is a WebSocket: upgrade the request (see the OpenAPI description)",
            headers={"Upgrade": "websocket", "Connection": "Upgrade"},
        )
