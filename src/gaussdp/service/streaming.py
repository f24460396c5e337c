"""Private generation over HTTP and WebSocket: ``/v1/sessions/{session_id}/generate`` (issue 20).

A served model (``gaussdp serve --model NAME=PATH``) generates greedily, token by token, with the
hidden state of one layer clipped to ``clip_norm`` and noised with ``N(0, sigma^2 I)`` in every
forward pass (:class:`gaussdp.inference.HiddenStatePrivatizer`; default layer: the last transformer
block; default relation ``"replace"``, sensitivity ``2 * clip_norm``). Every token's release is
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
``idempotency_key_used`` (the first answer is the only one; nothing is charged twice).

WebSocket protocol (``/v1/sessions/{id}/generate``)
---------------------------------------------------
Authentication: the ``Authorization: Bearer <API key>`` header of the upgrade request (scope
``release``), or, for browsers (which cannot set headers on a WebSocket), an ``"api_key"`` field in
the start message. Giving both is refused; a key in the URL is never read (URLs are logged).

1. Client -> server, within :data:`START_TIMEOUT_S`: the start message, a JSON object with the
   fields of :class:`~gaussdp.service.models.GenerateIn`, plus optionally ``"api_key"`` and
   ``"window"`` (an integer >= 1, default ``max_new_tokens``: see flow control).
2. Server -> client: ``{"type": "start", "stream_id", "model", "layer", "prompt_tokens",
   "max_new_tokens", "window", "sigma", "clip_norm", "neighbouring", "sensitivity",
   "noise_multiplier"}``.
3. Server -> client, per token, each sent only after its charge was recorded durably:
   ``{"type": "token", "index", "token_id", "text", "charge_id"}``.
4. Client -> server, at any time: ``{"ack": n}`` (the client has received ``n`` tokens) and
   ``{"stop": true}`` (end the stream after the token in flight, if any). Any other message ends
   the stream with the error ``invalid``.
5. The end, then the server closes: ``{"type": "end", "finish_reason": "length" | "eos" | "stopped"
   | "idle", "tokens_sent", "spent", "remaining"}`` with code 1000, or ``{"type": "error", "error":
   CODE, "detail", "tokens_sent", ...}`` with the close code of :data:`CLOSE_CODES`. On exhaustion:
   ``{"type": "error", "error": "budget_exhausted", "tokens_sent": k, "spent": {...},
   "remaining": {...}}`` and close code :data:`CLOSE_BUDGET_EXHAUSTED` (4402). When a token's
   forward pass fails (it is never retried): ``{"type": "error", "error": "generation_failed",
   "detail", "tokens_sent": k, "tokens_charged": k or k + 1, "charged_not_sent": [] or [{"index",
   "charge_id", "idempotency_key"}]}`` and close code 1011, whose reason repeats the two counts
   (``"generation_failed: charged N, sent K"``): the failed token's charge, when it was recorded
   before the failure, stands and is named; nothing from that token was released.

Flow control: the server computes (and charges) token ``i`` only when ``i < acked + window``, where
``acked`` is the client's latest ``ack`` (at most the tokens sent), and only while the client is
connected (checked before each token's forward pass). The default window lets the server run
ahead freely; ``window=1`` makes the stream pull-driven (token ``i`` is computed once the client
acknowledged token ``i - 1``): the Python client (:class:`gaussdp.client.GaussDPClient`) uses it.
The server waits at most :data:`IDLE_TIMEOUT_S` for an ack, then ends with ``"idle"``.

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
(the forward passes are bounded by the token caps and the model's size, not by it), at most
:data:`MAX_ACTIVE_GENERATIONS` generations at once per worker (past it: 429 / close 4429). Forward
passes run in the thread pool, never on the event loop; passes of one model take turns (a lock per
model: the privatizer's hook is on the shared module for the duration of one pass), so streams of
other sessions interleave token by token.
"""

# No "from __future__ import annotations": FastAPI resolves the route's annotations at runtime.

import asyncio
import json
import logging
import re
import threading
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Request, WebSocket
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from gaussdp.budget import (
    BudgetExhausted,
    Ledger,
    LedgerContention,
    StoreUnavailable,
    TenantLimitExceeded,
)
from gaussdp.errors import InvalidParameter, PrivacyError, WorkLimitExceeded
from gaussdp.service.auth import Caller
from gaussdp.service.generation import ChargePerToken, Generation, GenerationFailed
from gaussdp.service.models import (
    MAX_NEW_TOKENS,
    SESSION_ID_PATTERN,
    ErrorOut,
    GeneratedToken,
    GenerateIn,
    GenerateOut,
    Privacy,
)
from gaussdp.service.responses import IdempotencyKeyUsed

__all__ = [
    "CLOSE_BUDGET_EXHAUSTED",
    "CLOSE_CODES",
    "IDLE_TIMEOUT_S",
    "MAX_ACTIVE_GENERATIONS",
    "START_TIMEOUT_S",
    "generation_router",
]

logger = logging.getLogger("gaussdp.service")

CLOSE_NORMAL = 1000
CLOSE_BUDGET_EXHAUSTED = 4402
#: WebSocket close code of each error (4000 + the HTTP status the POST route answers for it).
CLOSE_CODES = {
    "unauthorized": 4401,
    "budget_exhausted": CLOSE_BUDGET_EXHAUSTED,
    "forbidden": 4403,
    "not_found": 4404,
    "timeout": 4408,
    "idempotency_key_used": 4409,
    "ledger_contention": 4409,
    "tenant_limit_exceeded": 4409,
    "invalid": 4422,
    "work_limit_exceeded": 4422,
    "rate_limited": 4429,
    "database_unavailable": 4503,
    "generation_failed": 1011,
    "internal": 1011,
}
_HTTP_ERRORS = {401: "unauthorized", 403: "forbidden", 404: "not_found", 422: "invalid", 429: "rate_limited"}
_GENERATION_FAILED = {
    "model": ErrorOut,
    "description": "generation_failed: the first token's forward pass failed (never retried); the "
    "detail says whether its charge was recorded (it then stands, with its charge_id).",
}
START_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 60.0
MAX_ACTIVE_GENERATIONS = 32
_SESSION_ID = re.compile(SESSION_ID_PATTERN)


def _error_code(exc: BaseException) -> str:
    """The stable code of an error that ends a generation."""
    if isinstance(exc, TenantLimitExceeded):
        return "tenant_limit_exceeded"
    if isinstance(exc, BudgetExhausted):
        return "budget_exhausted"
    if isinstance(exc, IdempotencyKeyUsed):
        return "idempotency_key_used"
    if isinstance(exc, LedgerContention):
        return "ledger_contention"
    if isinstance(exc, StoreUnavailable):
        return "database_unavailable"
    if isinstance(exc, WorkLimitExceeded):
        return "work_limit_exceeded"
    if isinstance(exc, GenerationFailed):
        return "generation_failed"
    if isinstance(exc, HTTPException):
        return _HTTP_ERRORS.get(exc.status_code, "invalid")
    if isinstance(exc, PrivacyError | ValidationError | RequestValidationError):
        return "invalid"
    return "internal"


_REFUSALS = (
    BudgetExhausted,
    IdempotencyKeyUsed,
    LedgerContention,
    StoreUnavailable,
    WorkLimitExceeded,
)


def generation_router(
    *,
    ledger: Ledger,
    releaser: Any,
    authenticate: Callable[[str | None], Caller],
    owned: Callable[[str, str], str],
    noise: str,
    cpu_limit_s: float,
    on_charged: Callable[[Caller, Any], None],
    on_refused: Callable[[str], None],
    responses: dict[int | str, dict[str, Any]],
) -> APIRouter:
    """The ``generate`` routes (POST and WebSocket) of :func:`gaussdp.service.app.create_app`.

    Args:
        releaser: the dependency that authenticates a POST (scope ``release``).
        authenticate: API key (or ``None``) -> caller of scope ``release``; raises ``HTTPException``
            (401, 403, 429) as the HTTP routes do.
        owned: ``(tenant, session_id) -> principal``; raises ``HTTPException(404)``.
    """
    router = APIRouter(tags=["inference"])
    model_locks: dict[str, threading.Lock] = {}
    active = {"n": 0}
    guard = threading.Lock()

    def begin() -> None:
        with guard:
            if active["n"] >= MAX_ACTIVE_GENERATIONS:
                on_refused("rate_limited")
                raise HTTPException(
                    429,
                    f"this worker runs {MAX_ACTIVE_GENERATIONS} generations already; retry later",
                    headers={"Retry-After": "1"},
                )
            active["n"] += 1

    def end() -> None:
        with guard:
            active["n"] -= 1

    def generation(app: Any, body: GenerateIn, p: str, who: Caller) -> Generation:
        models = getattr(app.state, "models", None) or {}
        model = models.get(body.model)
        if model is None:
            raise InvalidParameter(f"model: no model named {body.model!r} on this server")
        tokenizer = (getattr(app.state, "tokenizers", None) or {}).get(body.model)
        with guard:
            lock = model_locks.setdefault(body.model, threading.Lock())
        charges = ChargePerToken(ledger, who.key_id, lambda r: on_charged(who, r), cpu_limit_s)
        return Generation(
            body,
            model=model,
            tokenizer=tokenizer,
            lock=lock,
            principal=p,
            charges=charges,
            noise=noise,
        )

    def spent_remaining(p: str, receipt: Any = None) -> dict[str, Privacy]:
        budget, spent = ledger.budget(p), ledger.spent(p, as_of=receipt)
        return {
            "spent": Privacy(epsilon=spent.epsilon, delta=spent.delta),
            "remaining": Privacy(epsilon=max(0.0, budget.epsilon - spent.epsilon), delta=budget.delta),
        }

    @router.post(
        "/v1/sessions/{session_id}/generate",
        response_model=GenerateOut,
        responses={**responses, 500: _GENERATION_FAILED},
    )
    def generate(
        session_id: Annotated[str, Path(pattern=SESSION_ID_PATTERN, description="The session's id.")],
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
        ``generation_failed`` with that detail. The WebSocket route of the same path streams the
        tokens (see :mod:`gaussdp.service.streaming`).
        """
        p = owned(who.tenant, session_id)
        begin()
        try:
            gen = generation(request.app, body, p, who)
            tokens: list[GeneratedToken] = []
            finish, error, detail = "length", None, None
            for i in range(body.max_new_tokens):
                try:
                    tok = gen.step(i)
                except (*_REFUSALS, PrivacyError) as exc:  # nothing charged for this token
                    if not tokens:
                        raise
                    # the tokens so far were charged: they are answered, with the refusal
                    error, detail = _error_code(exc), str(exc)
                    finish = "budget_exhausted" if error == "budget_exhausted" else "error"
                    break
                except GenerationFailed as exc:
                    if not tokens:
                        on_refused("generation_failed")
                        return JSONResponse({"detail": str(exc), "error": "generation_failed"}, 500)
                    # the tokens so far were charged: they are answered, with what failed and whether
                    # that token was charged too
                    error, detail, finish = "generation_failed", str(exc), "error"
                    break
                tokens.append(tok)
                if gen.eos is not None and tok.token_id == gen.eos:
                    finish = "eos"
                    break
        finally:
            end()
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
        await websocket.accept()
        stream = _Stream(websocket)
        try:
            await stream.run(session_id)
        except Exception as exc:  # never leave the socket open on a bug
            logger.exception("generation stream failed")
            await stream.fail(exc)
        finally:
            stream.stop_receiving()

    class _Stream:
        """One WebSocket generation: the start message, flow control, token by token."""

        def __init__(self, ws: WebSocket) -> None:
            self.ws = ws
            self.sent = 0
            self.acked = 0
            self.window = MAX_NEW_TOKENS
            self.stop = False
            self.gone = False
            self.bad: str | None = None
            self.changed = asyncio.Event()
            self.receiver: asyncio.Task[None] | None = None
            self.p: str | None = None
            self.begun = False

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

        async def fail(self, exc: BaseException, code: str | None = None) -> None:
            code = code or _error_code(exc)
            on_refused(code)
            detail = exc.detail if isinstance(exc, HTTPException) else str(exc)
            if code == "internal" and not isinstance(exc, TimeoutError):
                detail = "internal error; the tokens sent so far were charged, nothing else was"
            message = {"type": "error", "error": code, "detail": detail, "tokens_sent": self.sent}
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
                    message.update(
                        {
                            k: v.model_dump()
                            for k, v in (await run_in_threadpool(spent_remaining, self.p)).items()
                        }
                    )
                except Exception:  # the figures are a courtesy; the refusal stands
                    logger.warning("could not read the spent budget of %s", self.p)
            if await self.send(message):
                await self.close(CLOSE_CODES[code], reason)

        def stop_receiving(self) -> None:
            if self.receiver is not None:
                self.receiver.cancel()
            if self.begun:
                self.begun = False
                end()

        async def receive_loop(self) -> None:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    self.gone = True
                    self.changed.set()
                    return
                try:
                    data = json.loads(msg.get("text") or "")
                except ValueError:
                    data = None
                ack = data.get("ack") if isinstance(data, dict) and set(data) == {"ack"} else None
                if isinstance(ack, int) and not isinstance(ack, bool) and ack >= 0:
                    self.acked = max(self.acked, min(ack, self.sent))
                elif data == {"stop": True}:
                    self.stop = True
                else:
                    self.bad = 'messages during a stream are {"ack": n} or {"stop": true}'
                self.changed.set()
                if self.bad is not None:
                    return

        async def start_message(self) -> dict[str, Any] | None:
            try:
                msg = await asyncio.wait_for(self.ws.receive(), START_TIMEOUT_S)
            except TimeoutError:
                await self.fail(TimeoutError(f"no start message within {START_TIMEOUT_S:g} s"), "timeout")
                return None
            if msg["type"] == "websocket.disconnect":
                self.gone = True
                return None
            try:
                start = json.loads(msg.get("text") or "")
            except ValueError:
                start = None
            if not isinstance(start, dict):
                await self.fail(InvalidParameter("the start message must be a JSON object (GenerateIn)"))
                return None
            return start

        async def run(self, session_id: str) -> None:
            start = await self.start_message()
            if start is None:
                return
            header = self.ws.headers.get("authorization")
            key = start.pop("api_key", None)
            window = start.pop("window", None)
            if header is not None and key is not None:
                await self.fail(
                    InvalidParameter("give the API key in the header or in the message, not both")
                )
                return
            if header is not None:
                scheme, _, credentials = header.partition(" ")
                key = credentials.strip() if scheme.lower() == "bearer" else None
            try:
                who = await run_in_threadpool(authenticate, key if isinstance(key, str) else None)
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
                begin()
                self.begun = True
                gen = await run_in_threadpool(generation, self.ws.app, body, p, who)
            except (HTTPException, PrivacyError, ValidationError) as exc:
                if isinstance(exc, ValidationError):
                    exc = InvalidParameter(
                        "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
                    )
                await self.fail(exc)
                return
            info = {"stream_id": gen.stream_id, "model": body.model, "prompt_tokens": gen.prompt_tokens}
            info.update(max_new_tokens=body.max_new_tokens, window=self.window, **gen.describe())
            if not await self.send({"type": "start", **info}):
                return
            self.receiver = asyncio.create_task(self.receive_loop())
            finish = "length"
            for i in range(body.max_new_tokens):
                while not (self.gone or self.stop or self.bad) and i >= self.acked + self.window:
                    self.changed.clear()
                    try:
                        await asyncio.wait_for(self.changed.wait(), IDLE_TIMEOUT_S)
                    except TimeoutError:
                        finish = "idle"
                        break
                if self.gone:
                    return  # charges == tokens sent: nothing is in flight
                if self.bad is not None:
                    await self.fail(InvalidParameter(self.bad))
                    return
                if self.stop or finish == "idle":
                    finish = "stopped" if self.stop else finish
                    break
                try:
                    tok = await run_in_threadpool(gen.step, i)
                except (*_REFUSALS, PrivacyError, GenerationFailed) as exc:
                    await self.fail(exc)
                    return
                if self.gone:  # left during the forward pass: this token was charged, not sent
                    return
                if not await self.send({"type": "token", **tok.model_dump()}):
                    return
                self.sent += 1
                if gen.eos is not None and tok.token_id == gen.eos:
                    finish = "eos"
                    break
            figures = await run_in_threadpool(spent_remaining, p)
            message = {"type": "end", "finish_reason": finish, "tokens_sent": self.sent}
            message.update({k: v.model_dump() for k, v in figures.items()})
            if await self.send(message):
                await self.close(CLOSE_NORMAL)

    return router
