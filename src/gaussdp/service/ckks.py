"""CKKS split inference over HTTP: the server computes a LoRA delta on ciphertext it cannot decrypt.

The private inference server's split mode with an honest-but-curious server, encrypted
(:mod:`gaussdp.inference.ckks`):

1. ``POST /v1/sessions/{id}/ckks-context`` (body: the raw bytes of
   :meth:`~gaussdp.inference.ckks.CKKSClient.public_context`, ``application/octet-stream``): the
   client's CKKS parameters and rotation keys, WITHOUT its secret key. Answered 201 with a
   ``context_id`` (the SHA-256 of the bytes), the adapters those keys can serve, and the memory it
   is counted for. This route has its own body limit, :data:`MAX_CONTEXT_BYTES` (16 MiB; the
   rotation keys weigh 6.6 MB at rank 32, 8.7 MB for all 12 power-of-two steps), in place of the
   service's ``max_body_bytes``. Kept in this worker's memory: one context per session (a new
   upload replaces it), under two budgets in bytes (:class:`ContextMemory`): the tenant's
   (``ckks_tenant_memory_bytes``, default 128 MiB: a tenant's new context evicts its own least
   recently used ones) and the worker's (``ckks_memory_bytes``, default 512 MiB: when other
   tenants' contexts fill it, the upload is refused 429 ``capacity_exceeded``; one tenant never
   evicts another's). A context unused for :data:`CONTEXT_IDLE_S` is dropped. A context that is
   not (or no longer) here is answered 404 ``ckks_context_unknown``: upload it again (with several
   worker processes, each needs its copy; the client does that on 404).
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

**Memory and cost.** A loaded context holds its rotation keys unseeded: 1.5 MiB of data per key
(:data:`GALOIS_KEY_BYTES`: 3 decomposition parts x 2 polynomials x 4 primes x 8192 coefficients x 8
bytes), 1.7 MiB of RSS measured; the SEAL context of the fixed parameters is shared. Measured RSS
growth per context (``tests/service/test_service_ckks.py``): 15.2 MiB at rank 32 (9 keys), 18.7 MiB
at rank 4 (11 keys), 20.4 MiB with the 12 keys of every rank; each is counted for 1.75 MiB a key
and 0.5 MiB besides (:func:`context_memory_bytes`: 16.3, 19.8 and 21.5 MiB; at most 42.5 MiB, 24
keys).
Loading one costs 0.05 to 0.12 s of CPU, key by key (SEAL calls of about 7 ms, each holding the
GIL, with 10 ms between two keys for the other threads: forward passes of other tenants' streams):
loads run in a worker thread under the request's CPU limit, in the app's lane for CPU-heavy work
(one piece at a time per worker, busy at most half the time) and one at a time per tenant, so that
the event loop waits for one key's load at most. At most :data:`MAX_ROWS` rows a request: each row
costs about 0.1 to 0.2 s of one core at hidden size 1536 and rank 32
(``benchmarks/bench_inference.py``), so that a request stays near the service's 1 s of CPU. An
adapter's diagonals are encoded once, at its first request.
"""

# No "from __future__ import annotations": FastAPI resolves the local Annotated aliases at runtime.

import asyncio
import base64
import binascii
import threading
import time
from collections import OrderedDict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from gaussdp._neighbouring import DEFAULT_HIDDEN_STATE_NEIGHBOURING
from gaussdp._worklimit import check_work_limit, no_cpu_limit
from gaussdp.service.auth import Caller
from gaussdp.service.deps import CPUBudget, Service, SessionId
from gaussdp.service.errors import Refusal
from gaussdp.service.models import (
    IdempotencyKey,
    Neighbouring,
    Privacy,
    _Strict,
)
from gaussdp.service.responses import responses as error_responses

__all__ = [
    "BODY_LIMITS",
    "CONTEXT_IDLE_S",
    "CONTEXT_PATH_PATTERN",
    "DELTA_PATH_PATTERN",
    "GALOIS_KEY_BYTES",
    "MAX_CONTEXT_BYTES",
    "MAX_DELTA_BYTES",
    "MAX_ROWS",
    "CKKSContextOut",
    "CKKSLoraDeltaIn",
    "CKKSLoraDeltaOut",
    "ContextMemory",
    "ckks_router",
    "context_memory_bytes",
]

MAX_CONTEXT_BYTES = 16 * 1024 * 1024
#: The data of one loaded rotation key: 3 decomposition parts (the data primes) x 2 polynomials x 4
#: primes x 8192 coefficients x 8 bytes (SEAL keeps keys unseeded and uncompressed in memory).
GALOIS_KEY_BYTES = 3 * 2 * 4 * 8192 * 8
# What one loaded key adds to the process's RSS, measured (1.69-1.71 MiB for contexts of 6 to 12
# keys, tests/service/test_service_ckks.py), rounded up; and a context's own objects besides.
_KEY_MEMORY_BYTES = 1792 << 10  # 1.75 MiB
_CONTEXT_OVERHEAD_BYTES = 512 << 10
_KEY_PAUSE_S = 0.01  # between two keys' loads: bench_abuse's CKKS phase, p99 3.5x -> 1.4-1.8x idle
CONTEXT_IDLE_S = 3600.0  # a context unused this long is dropped (its tenant uploads it again)
MAX_ROWS = 4
CONTEXT_PATH_PATTERN = r"/v1/sessions/[^/]+/ckks-context"
DELTA_PATH_PATTERN = r"/v1/sessions/[^/]+/ckks-lora-delta"
_MAX_ROW_BYTES = 200_000  # one seeded ciphertext is about 177 kB
_CIPHERTEXT_B64_MAX = (MAX_ROWS * _MAX_ROW_BYTES * 4) // 3 + 4
MAX_DELTA_BYTES = _CIPHERTEXT_B64_MAX + 16 * 1024  # the JSON body of ckks-lora-delta
BODY_LIMITS = {CONTEXT_PATH_PATTERN: MAX_CONTEXT_BYTES, DELTA_PATH_PATTERN: MAX_DELTA_BYTES}


class CKKSContextOut(BaseModel):
    context_id: str = Field(description="SHA-256 (hex) of the uploaded bytes; name it in ckks-lora-delta.")
    size_bytes: int = Field(description="Size of the uploaded context.")
    memory_bytes: int = Field(
        description="Memory the loaded context is counted for, against the tenant's CKKS memory budget."
    )
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


def context_memory_bytes(ctx: Any) -> int:
    """The bytes a loaded context is counted for: 1.75 MiB per rotation key (its data,
    :data:`GALOIS_KEY_BYTES`, and SEAL's allocations around it) and 0.5 MiB besides, an upper bound
    of the RSS growth measured per context."""
    return int(ctx.galois_keys.size()) * _KEY_MEMORY_BYTES + _CONTEXT_OVERHEAD_BYTES


class ContextMemory:
    """Loaded public contexts of this worker: one per session, under a byte budget per tenant and
    one for all tenants. A tenant's new context evicts only that tenant's least recently used ones;
    when the others' contexts leave no room, the upload is refused (never evicts them)."""

    def __init__(self, total_bytes: int, tenant_bytes: int, idle_s: float = CONTEXT_IDLE_S) -> None:
        self.total_bytes, self.tenant_bytes, self.idle_s = int(total_bytes), int(tenant_bytes), idle_s
        # tenant -> principal -> (context, bytes, last used); tenants' dicts in LRU order
        self._items: dict[str, OrderedDict[str, tuple[Any, int, float]]] = {}
        self._lock = threading.Lock()

    def used(self, tenant: str | None = None) -> int:
        """Bytes held by ``tenant`` (by every tenant when ``None``)."""
        with self._lock:
            return self._used(tenant)

    def _used(self, tenant: str | None) -> int:
        tenants = self._items.values() if tenant is None else [self._items.get(tenant, OrderedDict())]
        return sum(n for items in tenants for _, n, _ in items.values())

    def _drop_idle(self, now: float) -> None:
        for tenant in list(self._items):
            items = self._items[tenant]
            for p in [p for p, (_, _, at) in items.items() if now - at > self.idle_s]:
                del items[p]
            if not items:
                del self._items[tenant]

    def get(self, tenant: str, principal: str, context_id: str) -> Any:
        with self._lock:
            items = self._items.get(tenant)
            hit = None if items is None else items.get(principal)
            if items is None or hit is None or hit[0].context_id != context_id:
                return None
            items[principal] = (hit[0], hit[1], time.monotonic())
            items.move_to_end(principal)
            return hit[0]

    def room(self, tenant: str) -> None:
        """Refuse an upload before it is read when not even the smallest context could be kept."""
        smallest = _KEY_MEMORY_BYTES + _CONTEXT_OVERHEAD_BYTES
        if self.tenant_bytes < smallest:
            raise Refusal(
                "quota_exceeded",
                "this server keeps no CKKS context for a tenant "
                f"(ckks_tenant_memory_bytes={self.tenant_bytes})",
            )
        with self._lock:
            self._drop_idle(time.monotonic())
            others = self._used(None) - self._used(tenant)
        if self.total_bytes - others < smallest:
            raise self._full(smallest, others)

    def _full(self, size: int, others: int) -> Refusal:
        return Refusal(
            "capacity_exceeded",
            f"the server's memory for CKKS contexts is in use by other tenants ({others} of "
            f"{self.total_bytes} bytes): a context of {size} bytes does not fit; retry later",
            headers={"Retry-After": "60"},
        )

    def put(self, tenant: str, principal: str, ctx: Any, size: int) -> None:
        """Keep ``ctx`` for ``principal`` (replacing its earlier one), evicting ``tenant``'s least
        recently used contexts as its budget needs.

        Raises:
            Refusal: ``quota_exceeded`` (larger than the tenant's budget), ``capacity_exceeded``
                (other tenants' contexts leave no room): nothing is kept, nothing evicted.
        """
        if size > self.tenant_bytes:
            raise Refusal(
                "quota_exceeded",
                f"this CKKS context needs {size} bytes in memory, more than this tenant's "
                f"ckks_tenant_memory_bytes={self.tenant_bytes}: make one with fewer rotation keys "
                "(CKKSClient(rank=...))",
            )
        now = time.monotonic()
        with self._lock:
            self._drop_idle(now)
            items = self._items.get(tenant, OrderedDict())
            mine = self._used(tenant) - (items[principal][1] if principal in items else 0)
            others = self._used(None) - self._used(tenant)
            if others + size > self.total_bytes:
                raise self._full(size, others)
            items.pop(principal, None)  # replaced
            limit = min(self.tenant_bytes, self.total_bytes - others)
            while items and mine + size > limit:  # this tenant's own, least recently used first
                _, (_, n, _) = items.popitem(last=False)
                mine -= n
            items[principal] = (ctx, size, now)
            self._items[tenant] = items


def ckks_router(svc: Service) -> APIRouter:
    """The two CKKS routes over ``svc``: its adapters, ledger, key check and charge path, its
    per-request CPU limit (a context's loading runs under it, in ``svc.lane``, the app's lane for
    CPU-heavy work) and its quotas (``ckks_memory_bytes``, ``ckks_tenant_memory_bytes``)."""
    from gaussdp.inference.ckks import (
        MAX_HIDDEN,
        MAX_RANK,
        SLOTS,
        CKKSLoRAPlan,
        CKKSPublicContext,
        rotation_steps_for,
    )
    from gaussdp.inference.privatizer import row_event
    from gaussdp.service.releases import sensitivity_of

    adapters, ledger, owned, charged = svc.adapters, svc.ledger, svc.owned, svc.charged
    bounded, cpu_limit_s, quotas, lane = svc.bounded, svc.cpu_limit_s, svc.quotas, svc.lane
    Releaser = Annotated[Caller, Depends(svc.releaser)]
    contexts = ContextMemory(quotas.ckks_memory_bytes, quotas.ckks_tenant_memory_bytes)
    # A context loads key by key (SEAL calls of about 7 ms, each holding the GIL), in the app's lane
    # for CPU-heavy work (one piece at a time per worker), and one upload at a time per tenant, so
    # that a tenant's queue of uploads waits behind itself (the lane is first come, first served)
    tenant_uploads: dict[str, tuple[asyncio.Lock, int]] = {}  # tenant -> (its lock, uploads in flight)
    plans: dict[str, CKKSLoRAPlan] = {}
    plans_lock = threading.Lock()
    router = APIRouter(tags=["releases"])

    def plan_for(name: str) -> CKKSLoRAPlan:
        with plans_lock:  # encoded once per adapter (about 0.2 s at rank 32), then shared
            if name not in plans:
                a, b, scaling, _ = adapters[name]
                plans[name] = CKKSLoRAPlan(a, b, scaling)
            return plans[name]

    def between_keys() -> None:
        check_work_limit()
        time.sleep(_KEY_PAUSE_S)  # the GIL to other threads (forward passes) between two SEAL calls

    def load(data: bytes) -> Any:
        # UnsafeInput -> 422 (the app's PrivacyError handler); the CPU limit is looked at between keys
        ctx = CKKSPublicContext(data, between_keys=between_keys)
        check_work_limit()
        return ctx

    def usable(ctx: Any) -> list[str]:
        return sorted(
            name
            for name, (a, b, *_) in adapters.items()
            if a.shape[0] <= MAX_RANK
            and a.shape[1] <= MAX_HIDDEN
            and b.shape[0] <= SLOTS
            and all(ctx.has_rotation(k) for k in rotation_steps_for(int(a.shape[0])))
        )

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
        ``context_id`` to name in ``ckks-lora-delta``. Costs no privacy. Kept under the tenant's
        and the worker's CKKS memory budgets (429 ``quota_exceeded`` / ``capacity_exceeded``).
        """
        p = await run_in_threadpool(owned, who.tenant, session_id)
        contexts.room(who.tenant)  # before a byte of the body is read
        mine, waiting = tenant_uploads.get(who.tenant, (asyncio.Lock(), 0))
        tenant_uploads[who.tenant] = (mine, waiting + 1)
        try:
            async with mine:
                data = await request.body()
                if not data:
                    raise HTTPException(422, "body: send the bytes of CKKSClient.public_context()")
                ctx = await lane.run(CPUBudget(cpu_limit_s), load, data)
                del data
                size = context_memory_bytes(ctx)
                contexts.put(who.tenant, p, ctx, size)
        finally:
            lock, waiting = tenant_uploads[who.tenant]
            if waiting == 1:
                del tenant_uploads[who.tenant]
            else:
                tenant_uploads[who.tenant] = (lock, waiting - 1)
        return CKKSContextOut(
            context_id=ctx.context_id, size_bytes=ctx.nbytes, memory_bytes=size, adapters=usable(ctx)
        )

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
        ctx = contexts.get(who.tenant, p, body.context_id)
        if ctx is None:
            raise Refusal(
                "ckks_context_unknown",
                f"no CKKS context {body.context_id} for this session in this server process: POST its "
                "bytes to .../ckks-context (again)",
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
        receipt = ledger.charge(p, event, body.idempotency_key, key_id=who.key_id, fresh=True)
        with no_cpu_limit():  # charged: the answer must follow (its cost is bounded by MAX_ROWS)
            out = plan.delta_rows(ctx, rows)
            charged(who, receipt)
            spent = ledger.spent(p, as_of=receipt)
            remaining = ledger.budget(p).remaining(spent)
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
            spent=Privacy.of(spent),
            remaining=Privacy.of(remaining),
        )

    return router
