"""CKKS split inference over HTTP: the server computes a LoRA delta on ciphertext it cannot decrypt.

The private inference server's split mode with an honest-but-curious server, encrypted
(:mod:`gaussdp.inference.ckks`):

1. ``POST /v1/sessions/{id}/ckks-context`` (body: the raw bytes of
   :meth:`~gaussdp.inference.ckks.CKKSClient.public_context`, ``application/octet-stream``): the
   client's CKKS parameters and rotation keys, WITHOUT its secret key. Answered 201 with a
   ``context_id`` (the SHA-256 of the bytes) and the adapters those keys can serve. This route has
   its own body limit, :data:`MAX_CONTEXT_BYTES` (16 MiB; the rotation keys weigh 6.6 to 8.7 MB), in
   place of the service's ``max_body_bytes``. Kept in this worker's memory: one context per session (a new
   upload replaces it), at most :data:`MAX_CONTEXTS` in all (least recently used evicted). A
   context that is not (or no longer) here is answered 404 ``ckks_context_unknown``: upload it again
   (with several worker processes, each needs its copy; the client does that on 404).
2. ``POST /v1/sessions/{id}/ckks-lora-delta`` (JSON: ``context_id``, ``adapter``, ``ciphertext_b64``
   (base64 of :meth:`~gaussdp.inference.ckks.CKKSClient.encrypt`), ``rows``, and the privacy the
   client declares it spent: ``sigma``, ``clip_norm``, ``neighbouring``, as for ``/lora-delta``);
   its body limit is :data:`MAX_DELTA_BYTES` (about 1.1 MB: 4 rows of about 236 kB in base64).
   The ciphertexts are parsed and checked, then the session is charged one
   ``GaussianEvent(noise_multiplier=sigma / sensitivity)`` per row, atomically, BEFORE any
   homomorphic work (an exhausted session is refused 409 and costs no computation), then the delta
   ``scaling * B @ (A @ h)`` is computed on the ciphertexts and returned as ``ciphertext_b64``, for
   :meth:`~gaussdp.inference.ckks.CKKSClient.decrypt_delta`. A failure after the charge leaves the
   charge in place (the safe direction).

**What the charge means.** As with ``/lora-delta``, the server cannot verify the client's clipping
and noise (it cannot even see the rows); the charge records the client's declared spend so that
the session's budget is enforced. Encryption keeps the noised rows and the delta from the server;
the privacy of the rows against whoever holds the key comes from the noise.

**Cost.** At most :data:`MAX_ROWS` rows a request: each row costs about 0.1 to 0.2 s of one core at
hidden size 1536 and rank 32 (``benchmarks/bench_inference.py``), so that a request stays near the
service's 1 s of CPU. Loading a context costs about 0.3 s. An adapter's diagonals are encoded once,
at its first request.
"""

# No "from __future__ import annotations": FastAPI resolves the local Annotated aliases at runtime.

import base64
import binascii
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from gaussdp._neighbouring import DEFAULT_HIDDEN_STATE_NEIGHBOURING
from gaussdp._worklimit import no_cpu_limit
from gaussdp.service.auth import Caller
from gaussdp.service.models import (
    SESSION_ID_PATTERN,
    IdempotencyKey,
    Neighbouring,
    Privacy,
    _Strict,
)
from gaussdp.service.responses import IdempotencyKeyUsed
from gaussdp.service.responses import responses as error_responses

__all__ = [
    "BODY_LIMITS",
    "CONTEXT_PATH_PATTERN",
    "DELTA_PATH_PATTERN",
    "MAX_CONTEXTS",
    "MAX_CONTEXT_BYTES",
    "MAX_DELTA_BYTES",
    "MAX_ROWS",
    "CKKSContextOut",
    "CKKSLoraDeltaIn",
    "CKKSLoraDeltaOut",
    "ckks_router",
]

MAX_CONTEXT_BYTES = 16 * 1024 * 1024
MAX_CONTEXTS = 8  # loaded contexts per worker, about 18 MB each in memory (rotation keys unseeded)
MAX_ROWS = 4
CONTEXT_PATH_PATTERN = r"/v1/sessions/[^/]+/ckks-context"
DELTA_PATH_PATTERN = r"/v1/sessions/[^/]+/ckks-lora-delta"
_MAX_ROW_BYTES = 200_000  # one seeded ciphertext is about 177 kB
_CIPHERTEXT_B64_MAX = (MAX_ROWS * _MAX_ROW_BYTES * 4) // 3 + 4
MAX_DELTA_BYTES = _CIPHERTEXT_B64_MAX + 16 * 1024  # the JSON body of ckks-lora-delta
BODY_LIMITS = {CONTEXT_PATH_PATTERN: MAX_CONTEXT_BYTES, DELTA_PATH_PATTERN: MAX_DELTA_BYTES}

SessionId = Annotated[str, Path(pattern=SESSION_ID_PATTERN, description="The session's id.")]


class CKKSContextOut(BaseModel):
    context_id: str = Field(description="SHA-256 (hex) of the uploaded bytes; name it in ckks-lora-delta.")
    size_bytes: int = Field(description="Size of the uploaded context.")
    adapters: list[str] = Field(
        description="Adapters this context can serve (their sizes fit the packing, its keys their rank)."
    )


class CKKSLoraDeltaIn(_Strict):
    """Encrypted rows the CLIENT already clipped and noised; an encrypted LoRA delta out."""

    context_id: str = Field(pattern=r"^[0-9a-f]{64}$", description="From POST .../ckks-context.")
    adapter: str = Field(min_length=1, max_length=128, description="Name of a LoRA adapter the server holds.")
    ciphertext_b64: str = Field(
        min_length=4,
        max_length=_CIPHERTEXT_B64_MAX,
        description="Base64 of CKKSClient.encrypt(noised_rows): one ciphertext a row.",
    )
    rows: int = Field(ge=1, le=MAX_ROWS, description="Rows in the ciphertext; each is charged.")
    clip_norm: float = Field(gt=0, le=1e6, allow_inf_nan=False, description="Each row's L2 clip.")
    sigma: float = Field(gt=0, le=1e12, allow_inf_nan=False, description="Std of the noise the client added.")
    neighbouring: Neighbouring = Field(
        DEFAULT_HIDDEN_STATE_NEIGHBOURING,
        description="Relation of the client's privatizer (see /lora-delta).",
    )
    idempotency_key: IdempotencyKey | None = Field(
        None, description="A retried request with the same key is charged once (and answered once)."
    )


class CKKSLoraDeltaOut(BaseModel):
    ciphertext_b64: str = Field(description="Base64 of the encrypted delta rows, for decrypt_delta.")
    rows: int = Field(description="Rows answered, and charged.")
    d_out: int
    adapter: str
    context_id: str
    neighbouring: Neighbouring = Field(description="The relation the charge was computed for.")
    sensitivity: float
    noise_multiplier: float = Field(description="sigma / sensitivity of each row's charged GaussianEvent.")
    charge_id: int
    spent: Privacy
    remaining: Privacy


class _Contexts:
    """Loaded public contexts of this worker: one per session, LRU-bounded in all."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[str, Any] = OrderedDict()  # principal -> CKKSPublicContext
        self._lock = threading.Lock()

    def get(self, principal: str, context_id: str) -> Any:
        with self._lock:
            ctx = self._items.get(principal)
            if ctx is None or ctx.context_id != context_id:
                return None
            self._items.move_to_end(principal)
            return ctx

    def put(self, principal: str, ctx: Any) -> None:
        with self._lock:
            self._items[principal] = ctx
            self._items.move_to_end(principal)
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)


def ckks_router(
    *,
    adapters: Mapping[str, tuple[Any, Any, float, Any]],
    ledger: Any,
    releaser: Callable[..., Caller],
    owned: Callable[[str, str], str],
    charged: Callable[[Caller, Any], None],
    sensitivity_of: Callable[[float, str], float],
    row_event: Callable[[float, int], Any],
    bounded: Callable[[Callable[..., Any]], Callable[..., Any]],
    max_contexts: int = MAX_CONTEXTS,
) -> APIRouter:
    """The two CKKS routes over ``create_app``'s adapters, ledger, key check and charge path."""
    from gaussdp.inference.ckks import (
        MAX_HIDDEN,
        MAX_RANK,
        SLOTS,
        CKKSLoRAPlan,
        CKKSPublicContext,
        rotation_steps_for,
    )

    Releaser = Annotated[Caller, Depends(releaser)]
    contexts = _Contexts(max_contexts)
    plans: dict[str, CKKSLoRAPlan] = {}
    plans_lock = threading.Lock()
    router = APIRouter(tags=["releases"])

    def plan_for(name: str) -> CKKSLoRAPlan:
        with plans_lock:  # encoded once per adapter (about 0.2 s at rank 32), then shared
            if name not in plans:
                a, b, scaling, _ = adapters[name]
                plans[name] = CKKSLoRAPlan(a, b, scaling)
            return plans[name]

    def load(session_id: str, who: Caller, data: bytes) -> CKKSContextOut:
        p = owned(who.tenant, session_id)
        ctx = CKKSPublicContext(data)  # UnsafeInput -> 422 (the app's PrivacyError handler)
        contexts.put(p, ctx)
        usable = [
            name
            for name, (a, b, *_) in adapters.items()
            if a.shape[0] <= MAX_RANK
            and a.shape[1] <= MAX_HIDDEN
            and b.shape[0] <= SLOTS
            and all(ctx.has_rotation(k) for k in rotation_steps_for(int(a.shape[0])))
        ]
        return CKKSContextOut(context_id=ctx.context_id, size_bytes=ctx.nbytes, adapters=sorted(usable))

    @router.post(
        "/v1/sessions/{session_id}/ckks-context",
        response_model=CKKSContextOut,
        status_code=201,
        responses=error_responses(401, 403, 404, 413, 422, 429, 503),
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
            }
        },
    )
    async def ckks_context(session_id: SessionId, request: Request, who: Releaser) -> CKKSContextOut:
        """Upload the client's CKKS public context (parameters and rotation keys, no secret key).

        The body is the raw bytes of ``CKKSClient.public_context()``, at most 16 MiB. Answers the
        ``context_id`` to name in ``ckks-lora-delta``. Costs no privacy.
        """
        data = await request.body()
        if not data:
            raise HTTPException(422, "body: send the bytes of CKKSClient.public_context()")
        return await run_in_threadpool(load, session_id, who, data)

    @router.post(
        "/v1/sessions/{session_id}/ckks-lora-delta",
        response_model=CKKSLoraDeltaOut,
        responses=error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503),
    )
    @bounded
    def ckks_lora_delta(session_id: SessionId, body: CKKSLoraDeltaIn, who: Releaser) -> Any:
        """The LoRA delta of encrypted rows the client privatized: charged per row, then computed blind.

        ``rows`` ciphertexts (at most 4) under the context ``context_id`` uploaded for this
        session. The server charges the client's declared spend (``sigma``, ``clip_norm``,
        ``neighbouring``: one ``GaussianEvent`` per row, as ``/lora-delta``) before computing, and
        answers ``scaling * B @ (A @ h)`` per row, encrypted. 404 ``ckks_context_unknown``: upload
        the context (again) to this server.
        """
        p = owned(who.tenant, session_id)
        if body.adapter not in adapters:
            raise HTTPException(422, f"adapter: no LoRA adapter named {body.adapter!r} on this server")
        ctx = contexts.get(p, body.context_id)
        if ctx is None:
            return JSONResponse(
                {
                    "detail": f"no CKKS context {body.context_id} for this session in this server "
                    "process: POST its bytes to .../ckks-context (again)",
                    "error": "ckks_context_unknown",
                },
                status_code=404,
            )
        try:
            raw = base64.b64decode(body.ciphertext_b64, validate=True)
        except (binascii.Error, ValueError):
            raise HTTPException(422, "ciphertext_b64 must be standard base64") from None
        plan = plan_for(body.adapter)
        plan.check_range(clip_norm=body.clip_norm, sigma=body.sigma)  # UnsafeInput -> 422, uncharged
        rows = plan.read_rows(ctx, raw)  # UnsafeInput -> 422, nothing charged
        if len(rows) != body.rows:
            raise HTTPException(422, f"rows={body.rows} but ciphertext_b64 holds {len(rows)} rows")
        sensitivity = sensitivity_of(body.clip_norm, body.neighbouring)
        event = row_event(body.sigma / sensitivity, body.rows)
        receipt = ledger.charge(p, event, body.idempotency_key, key_id=who.key_id)
        if receipt.replayed:
            raise IdempotencyKeyUsed(
                f"idempotency_key={body.idempotency_key!r} was already charged and answered "
                "(the first response is the only one)",
            )
        with no_cpu_limit():  # charged: the answer must follow (its cost is bounded by MAX_ROWS)
            out = plan.delta_rows(ctx, rows)
            charged(who, receipt)
            budget, spent = ledger.budget(p), ledger.spent(p, as_of=receipt)
        return CKKSLoraDeltaOut(
            ciphertext_b64=base64.b64encode(out).decode(),
            rows=body.rows,
            d_out=plan.d_out,
            adapter=body.adapter,
            context_id=body.context_id,
            neighbouring=body.neighbouring,
            sensitivity=sensitivity,
            noise_multiplier=body.sigma / sensitivity,
            charge_id=receipt.charge_id,
            spent=Privacy(epsilon=spent.epsilon, delta=spent.delta),
            remaining=Privacy(epsilon=max(0.0, budget.epsilon - spent.epsilon), delta=budget.delta),
        )

    return router
