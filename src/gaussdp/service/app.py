"""The FastAPI application: sessions with budgets, and Gaussian releases charged to them first.

Status codes and error codes come from one table, :data:`gaussdp.service.errors.ERRORS` (the
handlers, the WebSocket close codes and the OpenAPI entries are made from it): 400 a body that is
not UTF-8 JSON; 401 missing, bad, revoked or expired API key; 403 the key's scope (read < release <
admin) does not allow the route; 404 a session this tenant does not own (another tenant's sessions
are indistinguishable from missing ones); 409 the session's budget cannot pay for the release
(``budget_exhausted``: nothing was charged or released), an idempotency key was already charged and
answered (``idempotency_key_used``: nothing new charged or released), or concurrent charges kept
moving the session's history (``ledger_contention``, with ``Retry-After``); 413 request body over
``max_body_bytes``; 422 invalid arguments, naming them, a JSON body nested deeper than
:data:`~gaussdp.service.bounds.MAX_JSON_DEPTH` (``json_too_deep``, refused before it is parsed), or
a request that needs more than ``cpu_limit_s`` of numeric work (``work_limit_exceeded``; nothing
charged); 429 the key's rate limit (``rate_limited``, ``Retry-After``), the tenant's caps on
sessions or epsilon (``tenant_limit_exceeded``), its share of generation slots
(``too_many_generations``) or its quotas (``quota_exceeded``); 503 the ledger's database cannot be
reached (``database_unavailable``, with ``Retry-After``; nothing released). ``/healthz`` is
liveness only (the process answers); ``/readyz`` reaches the database and answers 503 while it
cannot.

Split mode (the private inference server) has two endpoints. ``/hidden-state`` is for a TRUSTED server: it
receives the clean hidden state, clips and noises it itself. ``/lora-delta`` is for an honest-but-curious
server: the client clips and noises (:func:`gaussdp.inference.client_forward`), the server only
computes the LoRA delta of the noised rows with an adapter it holds, and charges the session the
privacy the client declares it spent (the server cannot verify that noise). With the ``he`` extra
the same adapters are also served encrypted, ``/ckks-context`` and ``/ckks-lora-delta``
(:mod:`gaussdp.service.ckks`): the server computes the delta on CKKS ciphertext it cannot decrypt.

Private generation with the models of ``gaussdp serve --model`` (``POST`` and WebSocket
``/v1/sessions/{id}/generate``, one charge per token before it is sent) lives in
:mod:`gaussdp.service.streaming`, which documents the WebSocket protocol and its close codes.
"""

# No "from __future__ import annotations": FastAPI resolves the local Annotated aliases at runtime.

import base64
import binascii
import importlib.util
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import numpy as np

from gaussdp._extras import require_extra

require_extra("service", feature="gaussdp.service")

from fastapi import Depends, FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from gaussdp._worklimit import no_cpu_limit
from gaussdp.budget import Budget, Ledger, StoreUnavailable, UnknownPrincipal
from gaussdp.service import errors
from gaussdp.service.auth import Caller, KeyCache
from gaussdp.service.bounds import JSONDepthLimit
from gaussdp.service.deps import SUBPROTOCOL, Gate, HeavyLane, bounded
from gaussdp.service.limits import BodySizeLimit, RateLimiter, SharedRateLimiter
from gaussdp.service.metrics import Metrics
from gaussdp.service.models import (
    SESSION_ID_PATTERN,
    AuditLine,
    ChargeOut,
    ErrorOut,
    HiddenStateIn,
    HiddenStateOut,
    HistoryPage,
    LoraDeltaIn,
    LoraDeltaOut,
    Privacy,
    ReadyOut,
    ReleaseIn,
    ReleaseOut,
    SessionIn,
    SessionOut,
)
from gaussdp.service.quotas import Quotas
from gaussdp.service.responses import CURSOR_PATTERN, IdempotencyKeyUsed, after_cursor, cursor_after
from gaussdp.service.responses import responses as error_responses
from gaussdp.service.streaming import StreamLimits

__all__ = [
    "DEFAULT_CPU_LIMIT_S",
    "DEFAULT_LEDGER_URL",
    "DEFAULT_MAX_BODY_BYTES",
    "create_app",
    "create_text_app",
]

logger = logging.getLogger("gaussdp.service")

DEFAULT_LEDGER_URL = "sqlite:///gaussdp-ledger.db"
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_CPU_LIMIT_S = 1.0
HISTORY_DEFAULT_LIMIT = 100
HISTORY_MAX_LIMIT = 1000
_EXPORT_PAGE = 1000

SessionId = Annotated[str, Path(pattern=SESSION_ID_PATTERN, description="The session's id.")]


def create_app(
    ledger_url: str = DEFAULT_LEDGER_URL,
    *,
    ledger: Ledger | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    noise: Literal["secure", "fast"] = "secure",
    lora_adapters: Mapping[str, Any] | None = None,
    cpu_limit_s: float = DEFAULT_CPU_LIMIT_S,
    rate_limit_per_s: float | None = None,
    rate_limit_burst: int | None = None,
    rate_limit_file: str | None = None,
    text: Literal["keyed", "public", "off"] = "keyed",
    metrics: Literal["keyed", "public", "off"] = "keyed",
    data_dir: str | None = None,
    model_paths: Mapping[str, str] | None = None,
    max_streams: int = StreamLimits.max_streams,
    max_streams_per_tenant: int = StreamLimits.max_streams_per_tenant,
    max_stream_s: float = StreamLimits.max_stream_s,
    stream_idle_s: float = StreamLimits.stream_idle_s,
    ckks_memory_bytes: int = Quotas.ckks_memory_bytes,
    ckks_tenant_memory_bytes: int = Quotas.ckks_tenant_memory_bytes,
    max_corpora_per_tenant: int = Quotas.max_corpora_per_tenant,
    max_corpus_bytes_per_tenant: int = Quotas.max_corpus_bytes_per_tenant,
    max_jobs_per_tenant: int = Quotas.max_jobs_per_tenant,
) -> FastAPI:
    """Build the service over a ledger (opened from ``ledger_url`` unless ``ledger`` is given).

    Args:
        ledger_url: where budgets and API keys live (``sqlite:///...`` or ``postgresql://...``).
        ledger: an existing :class:`~gaussdp.budget.Ledger` instead (the caller closes it).
        max_body_bytes: larger request bodies are refused with 413 before being read.
        noise: noise source of every release, passed to ``GaussianMechanism(noise=...)``.
        lora_adapters: LoRA adapters served by ``/lora-delta``: name -> ``(A, B)``, ``(A, B, scaling)``
            or ``(A, B, scaling, backend)``, with PEFT shapes A (r, d) and B (d_out, r) (numpy or
            torch), scaling 1 by default, and a :class:`gaussdp.inference.LoRABackend` (plain numpy
            by default). Needs the ``torch`` extra (for :mod:`gaussdp.inference`).
        cpu_limit_s: CPU seconds of numeric work (calibration, accounting) one request may use;
            past it the request is answered 422 ``work_limit_exceeded`` with nothing charged (the
            ledger computes before it charges). Every routine is bounded well below the default of
            1 s for the parameters the API accepts; the limit is the backstop.
        rate_limit_per_s: requests a second each API key may make (token bucket; ``None``: no
            limit); past it 429 with ``Retry-After``. Per process unless ``rate_limit_file`` is given.
        rate_limit_burst: the bucket's size (default: the rate rounded up).
        rate_limit_file: a file whose memory-mapped buckets every worker process of this host shares
            (:class:`~gaussdp.service.limits.SharedRateLimiter`), so that the rate holds for a key
            across ``gaussdp serve --workers N`` (which creates one per run). Several hosts behind a
            load balancer each enforce the rate on their own.
        text: the ``/text`` page and its routes (:mod:`gaussdp.text.web`, when importable):
            ``"keyed"`` (default: any valid API key of scope ``release``), ``"public"`` (no key), or
            ``"off"`` (serve them on their own app: :func:`create_text_app`).
        metrics: ``/metrics`` in Prometheus text format (:mod:`gaussdp.service.metrics`):
            ``"keyed"`` (default: an ``admin`` key; tenant names are labels), ``"public"`` (for a
            scraper on a private network), or ``"off"``.
        data_dir: where uploaded corpora and trained adapters live; given, the fine-tuning routes
            (:mod:`gaussdp.service.finetune`) are served (they need a durable ledger and the
            ``torch`` extra; jobs are trained by :mod:`gaussdp.service.worker` processes).
        model_paths: base models fine-tuning jobs may name: name -> local directory (``gaussdp serve
            --model NAME=PATH``); never from a request.
        max_streams, max_streams_per_tenant: generation slots of this worker process, in all and per
            tenant (:mod:`gaussdp.service.fairness`); a stream or a POST generation holds one.
        max_stream_s, stream_idle_s: a stream ends (``time_limit``) after ``max_stream_s``, and
            (``idle``) after ``stream_idle_s`` without a token, whatever the client sends.
        ckks_memory_bytes, ckks_tenant_memory_bytes: memory for loaded CKKS contexts in this worker,
            in all and per tenant (:mod:`gaussdp.service.ckks`); a tenant's uploads evict only its
            own contexts.
        max_corpora_per_tenant, max_corpus_bytes_per_tenant, max_jobs_per_tenant: a tenant's stored
            corpora (count and bytes) and its fine-tuning jobs not yet finished (429
            ``quota_exceeded``; nothing stored or charged).
    """
    if metrics not in ("keyed", "public", "off"):
        raise ValueError(f"metrics must be 'keyed', 'public' or 'off', got metrics={metrics!r}")
    stats = None if metrics == "off" else Metrics()
    if text not in ("keyed", "public", "off"):
        raise ValueError(f"text must be 'keyed', 'public' or 'off', got text={text!r}")
    limiter: RateLimiter | SharedRateLimiter | None = None
    if rate_limit_per_s is not None:
        limiter = (
            RateLimiter(rate_limit_per_s, rate_limit_burst)
            if rate_limit_file is None
            else SharedRateLimiter(rate_limit_file, rate_limit_per_s, rate_limit_burst)
        )
    if not cpu_limit_s > 0:
        raise ValueError(f"cpu_limit_s must be > 0, got cpu_limit_s={cpu_limit_s!r}")
    stream_limits = StreamLimits(max_streams, max_streams_per_tenant, max_stream_s, stream_idle_s)
    quotas = Quotas(
        ckks_memory_bytes=ckks_memory_bytes,
        ckks_tenant_memory_bytes=ckks_tenant_memory_bytes,
        max_corpora_per_tenant=max_corpora_per_tenant,
        max_corpus_bytes_per_tenant=max_corpus_bytes_per_tenant,
        max_jobs_per_tenant=max_jobs_per_tenant,
    )
    owns_ledger = ledger is None
    led = Ledger(ledger_url) if ledger is None else ledger
    tenants = KeyCache(led)
    adapters = _lora_adapters(lora_adapters)
    lora_delta_of = _server_lora_delta() if adapters else None
    ckks = bool(adapters) and importlib.util.find_spec("tenseal") is not None  # the `he` extra

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        jobs_store = getattr(app.state, "jobs", None)
        if jobs_store is not None:
            jobs_store.close()
        if owns_ledger:
            led.close()

    app = FastAPI(
        title="gaussdp",
        summary="Gaussian differential privacy as a service: per-session budgets, charged before release.",
        version=_version(),
        lifespan=lifespan,
    )
    app.state.ledger = led
    path_limits = _ckks_body_limits(ckks)
    raw_paths = [] if not ckks else [_ckks_context_path()]  # bodies that are not JSON
    if data_dir is not None:
        from gaussdp.service.finetune import CORPORA_PATH, MAX_CORPUS_BYTES

        path_limits[re.escape(CORPORA_PATH)] = MAX_CORPUS_BYTES  # corpora have their own limit
        raw_paths.append(re.escape(CORPORA_PATH))
    # inside the size limit: a body's bytes are counted first
    app.add_middleware(JSONDepthLimit, raw_paths=raw_paths)
    app.add_middleware(BodySizeLimit, max_body_bytes=max_body_bytes, path_limits=path_limits)

    def refused(reason: str) -> None:
        if stats is not None:
            stats.refusals.labels(reason).inc()

    def charged(who: Caller, receipt: Any) -> None:
        if stats is not None and not receipt.replayed:
            stats.charges.labels(who.tenant).inc()
            stats.epsilon.labels(who.tenant).inc(led.increase(receipt))

    if stats is not None:

        @app.middleware("http")
        async def _timing(request: Request, call_next: Any) -> Any:
            t0 = time.perf_counter()
            response = await call_next(request)
            route = request.scope.get("route")
            path = getattr(route, "path", "unmatched")  # the template: bounded label values
            stats.requests.labels(path, request.method, str(response.status_code)).observe(
                time.perf_counter() - t0
            )
            return response

    gate = Gate(tenants, limiter)
    needs = gate.needs
    Who = Annotated[Caller, Depends(needs("read"))]
    Releaser = Annotated[Caller, Depends(needs("release"))]
    Admin = Annotated[Caller, Depends(needs("admin"))]
    limited = bounded(cpu_limit_s)
    lane = HeavyLane()  # CPU-heavy work of async routes, one piece at a time (corpora, CKKS contexts)

    def principal(tenant: str, session_id: str) -> str:
        # Tenant names cannot contain "/", so "tenant/session" never collides across tenants.
        return f"{tenant}/{session_id}"

    def owned(tenant: str, session_id: str) -> str:
        p = principal(tenant, session_id)
        try:
            led.budget(p)
        except UnknownPrincipal:
            raise errors.Refusal("not_found", f"no session {session_id!r} for this API key") from None
        return p

    def session_out(p: str, session_id: str) -> SessionOut:
        budget, spent = led.budget(p), led.spent(p)
        return SessionOut(
            session_id=session_id,
            accountant=led.accountant(p),
            budget=Privacy(epsilon=budget.epsilon, delta=budget.delta),
            spent=Privacy(epsilon=spent.epsilon, delta=spent.delta),
            remaining=Privacy(epsilon=max(0.0, budget.epsilon - spent.epsilon), delta=budget.delta),
            charges=sum(c for _, c in led.store.groups(p).items()),
        )

    errors.install(app, refused)
    errors.document(app)

    @app.get("/healthz", tags=["meta"])
    def healthz() -> dict[str, str]:
        """Liveness probe (no key needed): the process answers; the database is not consulted."""
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["meta"],
        responses={
            200: {"description": "Ready.", "model": ReadyOut},
            503: {**error_responses(503)[503], "model": ReadyOut},  # the table's row, this body
        },
    )
    def readyz() -> JSONResponse:
        """Readiness probe (no key needed): one round trip to the ledger's database (at most 2 s)."""
        try:
            ping = getattr(led.store, "ping", None)
            if ping is not None:
                ping()
        except StoreUnavailable as exc:
            logger.warning("readiness: %s", exc)
            return JSONResponse(
                {"status": "unavailable", "error": "database_unavailable"},
                status_code=503,
                headers={"Retry-After": "1"},
            )
        return JSONResponse({"status": "ok"})

    @app.post(
        "/v1/sessions",
        status_code=201,
        response_model=SessionOut,
        tags=["sessions"],
        responses=error_responses(400, 401, 403, 409, 413, 422, 429, 503),
    )
    @limited
    def create_session(body: SessionIn, who: Releaser) -> SessionOut:
        """Open a session with a total (epsilon, delta) budget; its releases are charged to it.

        Counted against the tenant's caps, when it has some (429 ``tenant_limit_exceeded``).
        """
        session_id = body.session_id or secrets.token_urlsafe(12)
        p = principal(who.tenant, session_id)
        led.open(p, Budget(body.epsilon, body.delta), accountant=body.accountant, tenant=who.tenant)
        return session_out(p, session_id)

    @app.get("/v1/sessions", tags=["sessions"], responses=error_responses(401, 429, 503))
    def list_sessions(who: Who) -> list[str]:
        """The ids of this tenant's sessions."""
        prefix = principal(who.tenant, "")
        return [p[len(prefix) :] for p in led.principals(prefix)]

    @app.get(
        "/v1/sessions/{session_id}",
        response_model=SessionOut,
        tags=["sessions"],
        responses=error_responses(401, 404, 422, 429, 503),
    )
    @limited
    def get_session(session_id: SessionId, who: Who) -> SessionOut:
        """Budget, spent and remaining privacy of a session."""
        return session_out(owned(who.tenant, session_id), session_id)

    @app.get(
        "/v1/sessions/{session_id}/history",
        response_model=HistoryPage,
        tags=["sessions"],
        responses=error_responses(401, 404, 422, 429, 503),
    )
    def session_history(
        session_id: SessionId,
        who: Who,
        limit: Annotated[int, Query(ge=1, le=HISTORY_MAX_LIMIT, description="Charges per page.")] = (
            HISTORY_DEFAULT_LIMIT
        ),
        cursor: Annotated[
            str | None, Query(pattern=CURSOR_PATTERN, description="next_cursor of the previous page.")
        ] = None,
    ) -> HistoryPage:
        """A session's charges, oldest first, one page at a time (``next_cursor`` continues)."""
        p = owned(who.tenant, session_id)
        page = led.history_page(p, after=after_cursor(cursor), limit=limit + 1)  # one more: is there a next?
        more = len(page) > limit
        page = page[:limit]
        return HistoryPage(
            charges=[_charge_out(c) for c in page],
            next_cursor=cursor_after(page[-1].charge_id) if more else None,
        )

    @app.get(
        "/v1/audit/export",
        tags=["audit"],
        response_class=StreamingResponse,
        responses={
            200: {"content": {"application/x-ndjson": {"schema": AuditLine.model_json_schema()}}},
            **error_responses(401, 403, 422, 429, 503),
        },
    )
    def audit_export(
        who: Admin,
        cursor: Annotated[
            str | None, Query(pattern=CURSOR_PATTERN, description="next_cursor of an earlier export.")
        ] = None,
    ) -> StreamingResponse:
        """Every charge of this tenant's sessions with the key id that made it, as JSON lines, by id.

        Streamed in pages (the work per page is bounded); a line ``{"next_cursor": ...}`` ends
        the stream so that an interrupted export can continue where it stopped.
        """
        prefix = principal(who.tenant, "")
        after = after_cursor(cursor)

        def lines() -> Any:
            last = after
            while True:
                page = led.export(prefix, after=last, limit=_EXPORT_PAGE)
                for c in page:
                    line = AuditLine(session_id=c.principal[len(prefix) :], **_charge_out(c).model_dump())
                    yield line.model_dump_json() + "\n"
                if len(page) < _EXPORT_PAGE:
                    break
                last = page[-1].charge_id
            if page:
                last = page[-1].charge_id
            yield json.dumps({"next_cursor": cursor_after(last)}) + "\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post(
        "/v1/sessions/{session_id}/release",
        response_model=ReleaseOut,
        tags=["releases"],
        responses=error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503),
    )
    @limited
    def release(session_id: SessionId, body: ReleaseIn, who: Releaser) -> ReleaseOut:
        """Clip a vector to L2 norm ``sensitivity``, add calibrated Gaussian noise; charged first."""
        p = owned(who.tenant, session_id)
        x = _vector(body.vector, body.vector_b64, "vector_b64")
        mech = _mechanism(body.epsilon, body.delta, body.sigma, body.sensitivity, noise)
        receipt, out = _charge_then_release(led, p, mech, x, body.idempotency_key, who.key_id)
        with no_cpu_limit():  # charged: the answer must not fail on the limit now
            charged(who, receipt)
            budget, spent = led.budget(p), led.spent(p, as_of=receipt)
        return ReleaseOut(
            **_encode(out, "vector", b64=body.vector_b64 is not None),
            sigma=float(mech.sigma),
            sensitivity=body.sensitivity,
            charge_id=receipt.charge_id,
            spent=Privacy(epsilon=spent.epsilon, delta=spent.delta),
            remaining=Privacy(epsilon=max(0.0, budget.epsilon - spent.epsilon), delta=budget.delta),
        )

    @app.post(
        "/v1/sessions/{session_id}/hidden-state",
        response_model=HiddenStateOut,
        tags=["releases"],
        responses=error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503),
    )
    @limited
    def hidden_state(session_id: SessionId, body: HiddenStateIn, who: Releaser) -> HiddenStateOut:
        """Split mode, TRUSTED server: clip the state to ``clip_norm``, noise it, charge.

        The server sees the clean hidden state; with an honest-but-curious server use ``/lora-delta``.
        Defaults are the private inference server's per-request (epsilon=1, delta=1e-5, clip 1), calibrated
        exactly (analytic) instead of with the classical formula. ``neighbouring`` says what the epsilon
        protects: ``"replace_one"`` (default, as for the privatizer and ``/lora-delta``: any state
        against any other, sensitivity ``2 * clip_norm``) or ``"add_remove"`` (sensitivity
        ``clip_norm``: a state against its absence); the response names it. An exhausted session
        is refused (409).
        """
        p = owned(who.tenant, session_id)
        x = _vector(body.hidden_state, body.hidden_state_b64, "hidden_state_b64")
        sensitivity = _sensitivity(body.clip_norm, body.neighbouring)
        if body.neighbouring == "replace_one":
            x = _clip(x, body.clip_norm)  # clipped to C, noised for 2C (the mechanism's clip is a no-op)
        mech = _mechanism(body.epsilon, body.delta, body.sigma, sensitivity, noise)
        receipt, out = _charge_then_release(led, p, mech, x, body.idempotency_key, who.key_id)
        with no_cpu_limit():  # charged: the answer must not fail on the limit now
            charged(who, receipt)
            epsilon_spent = led.spent(p, as_of=receipt).epsilon
        return HiddenStateOut(
            **_encode(out, "noised", b64=body.hidden_state_b64 is not None),
            sigma=float(mech.sigma),
            clip_norm=body.clip_norm,
            neighbouring=body.neighbouring,
            sensitivity=sensitivity,
            epsilon_spent=epsilon_spent,
            budget_ok=True,
            charge_id=receipt.charge_id,
        )

    @app.post(
        "/v1/sessions/{session_id}/lora-delta",
        response_model=LoraDeltaOut,
        tags=["releases"],
        responses=error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503),
    )
    @limited
    def lora_delta(session_id: SessionId, body: LoraDeltaIn, who: Releaser) -> LoraDeltaOut:
        """The inference server's split mode, untrusted server: the LoRA delta of rows the CLIENT privatized.

        Each row of ``noised`` (or ``noised_b64``, row-major float32 with the adapter's hidden size)
        must already be clipped to ``clip_norm`` and noised with ``N(0, sigma^2 I)`` by the client
        (e.g. :func:`gaussdp.inference.client_forward`). The answer is ``scaling * B @ (A @ h)`` per
        row (:func:`gaussdp.inference.server_lora_delta`), post-processing of what the client sent.

        **The server cannot verify the client's clipping or noise.** ``clip_norm``, ``sigma`` and
        ``neighbouring`` are the client's declared spend: the session is charged one
        ``GaussianEvent(noise_multiplier=sigma / sensitivity)`` per row (sensitivity ``2 * clip_norm``
        for ``"replace_one"``, the default everywhere for hidden states, ``clip_norm`` for
        ``"add_remove"``; the response names it), all rows in one atomic charge before
        answering, so that the session's budget is enforced (409 once it cannot pay; nothing is
        answered then). The charge records a claim, it does not make unnoised rows private. A delta
        that overflows (float64, or float32 for ``noised_b64``) is refused with 422, uncharged.
        """
        p = owned(who.tenant, session_id)
        adapter = adapters.get(body.adapter)
        if adapter is None or lora_delta_of is None:
            raise HTTPException(422, f"adapter: no LoRA adapter named {body.adapter!r} on this server")
        a, b, scaling, backend = adapter
        h = _rows(body.noised, body.noised_b64, a.shape[1], body.adapter)
        sensitivity = _sensitivity(body.clip_norm, body.neighbouring)
        event = _row_event(body.sigma / sensitivity, h.shape[0])
        # Computed first (nothing leaves before the charge), so that a failure charges nothing.
        with np.errstate(over="ignore", invalid="ignore"):
            out = np.asarray(lora_delta_of(h, a, b, scaling, backend=backend), dtype=np.float64)
            b64 = body.noised_b64 is not None
            if not np.isfinite(out.astype(np.float32) if b64 else out).all():
                raise HTTPException(422, "noised: the delta overflows (rows far too large); nothing charged")
        receipt = led.charge(p, event, body.idempotency_key, key_id=who.key_id)
        if receipt.replayed:
            raise IdempotencyKeyUsed(
                f"idempotency_key={body.idempotency_key!r} was already charged and answered "
                "(the first response is the only one)",
            )
        with no_cpu_limit():  # charged: the answer must not fail on the limit now
            charged(who, receipt)
            budget, spent = led.budget(p), led.spent(p, as_of=receipt)
        return LoraDeltaOut(
            **_encode(out, "delta", b64=b64),
            rows=int(h.shape[0]),
            d_out=int(b.shape[0]),
            adapter=body.adapter,
            neighbouring=body.neighbouring,
            sensitivity=sensitivity,
            noise_multiplier=body.sigma / sensitivity,
            charge_id=receipt.charge_id,
            spent=Privacy(epsilon=spent.epsilon, delta=spent.delta),
            remaining=Privacy(epsilon=max(0.0, budget.epsilon - spent.epsilon), delta=budget.delta),
        )

    if ckks:  # CKKS split mode (gaussdp.service.ckks): the same adapters, charge path and key check
        from gaussdp.service.ckks import ckks_router

        app.include_router(
            ckks_router(
                adapters=adapters,
                ledger=led,
                releaser=needs("release"),
                owned=owned,
                charged=charged,
                sensitivity_of=_sensitivity,
                row_event=_row_event,
                bounded=limited,
                cpu_limit_s=cpu_limit_s,
                quotas=quotas,
                lane=lane,
            )
        )

    from gaussdp.service.streaming import generation_router

    app.include_router(
        generation_router(
            ledger=led,
            gate=gate,
            releaser=Releaser,
            owned=owned,
            noise=noise,
            cpu_limit_s=cpu_limit_s,
            on_charged=charged,
            on_refused=refused,
            responses=error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503),
            limits=stream_limits,
        )
    )
    _document_websocket(app, needs("release"))

    if stats is not None:
        deps = [Depends(needs("admin"))] if metrics == "keyed" else []
        metric_errors = error_responses(401, 403, 429) if metrics == "keyed" else {}

        @app.get(
            "/metrics",
            tags=["meta"],
            dependencies=deps,
            response_class=Response,
            responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **metric_errors},
        )
        def prometheus_metrics() -> Response:
            """Prometheus text format: charges, refusals, latency histograms, epsilon spent per tenant."""
            body, content_type = stats.render()
            return Response(body, media_type=content_type)

    if text != "off":
        keyed = [Depends(needs("release"))] if text == "keyed" else []
        _include_optional_routers(app, keyed)
    if data_dir is not None:
        from gaussdp.service.finetune import make_finetune_router
        from gaussdp.service.jobs import JobStore

        jobs = JobStore(_durable_url(led))
        app.state.jobs = jobs
        app.state.model_paths = dict(model_paths or {})
        app.include_router(
            make_finetune_router(
                ledger=led,
                jobs=jobs,
                data_dir=data_dir,
                model_paths=app.state.model_paths,
                reader=needs("read"),
                releaser=needs("release"),
                bounded=limited,
                cpu_limit_s=cpu_limit_s,
                quotas=quotas,
                lane=lane,
            )
        )
    return app


def _document_websocket(app: FastAPI, releaser: Callable[..., Caller]) -> None:
    """``GET /v1/sessions/{id}/generate``: the WebSocket stream's entry in the OpenAPI document.

    OpenAPI has no WebSocket operations; this GET is the upgrade request. Its description and its
    ``x-websocket-close-codes`` come from the error table; a plain HTTP GET (no upgrade) with a
    valid key is answered 426 Upgrade Required (its key is checked as for every route).
    """
    codes = errors.websocket_close_codes()
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

    @app.get(
        "/v1/sessions/{session_id}/generate",
        tags=["inference"],
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
        raise errors.Refusal(
            "upgrade_required",
            "this route is a WebSocket: upgrade the request (see the OpenAPI description)",
            headers={"Upgrade": "websocket", "Connection": "Upgrade"},
        )


def _durable_url(led: Ledger) -> str:
    """The database URL of ``led`` (fine-tuning keeps its jobs there), also for ``Ledger(store=...)``."""
    path = getattr(led.store, "path", None)
    if not led.url.startswith(("sqlite://", "postgresql://", "postgres://")) and isinstance(path, str):
        return f"sqlite:///{path}"
    return led.url


def create_text_app() -> FastAPI:
    """The ``/text`` page and its routes alone, without the ledger or keys (deploy apart from it:
    its perturbation runs in the browser, and submissions are not charged to any budget)."""
    app = FastAPI(title="gaussdp text", version=_version())
    _include_optional_routers(app, [])
    return app


def _ckks_body_limits(ckks: bool) -> dict[str, int]:
    """The CKKS routes' own body limits (rotation keys weigh several MB), when they are served."""
    if not ckks:
        return {}
    from gaussdp.service.ckks import BODY_LIMITS

    return dict(BODY_LIMITS)


def _ckks_context_path() -> str:
    from gaussdp.service.ckks import CONTEXT_PATH_PATTERN

    return CONTEXT_PATH_PATTERN


def _sensitivity(clip_norm: float, neighbouring: str) -> float:
    """L2 sensitivity of one row clipped to ``clip_norm``: 2C under replace, C under add/remove."""
    from gaussdp._neighbouring import hidden_state_sensitivity

    return hidden_state_sensitivity(clip_norm, neighbouring)


def _clip(x: np.ndarray, clip_norm: float) -> np.ndarray:
    from gaussdp.clipping import clip_rows

    clipped, _ = clip_rows(x.reshape(1, -1), clip_norm)
    return np.asarray(clipped).reshape(x.shape)


def _row_event(noise_multiplier: float, rows: int) -> Any:
    """One Gaussian release per row, as one event (charged atomically), as the privatizer charges."""
    from gaussdp.accounting import GaussianEvent, SelfComposedEvent

    event = GaussianEvent(noise_multiplier=noise_multiplier)
    return event if rows == 1 else SelfComposedEvent(event, rows)


def _rows(values: list[list[float]] | None, b64: str | None, d: int, adapter: str) -> np.ndarray:
    if values is not None:
        h = np.asarray(values, dtype=np.float64)
    else:
        flat = _vector(None, b64, "noised_b64")
        if flat.size % d:
            raise HTTPException(
                422, f"noised_b64 holds {flat.size} float32: not whole rows of {d} (adapter {adapter!r})"
            )
        h = flat.reshape(-1, d)
    if h.ndim != 2 or h.shape[1] != d:
        raise HTTPException(
            422, f"noised rows have {h.shape[-1]} values; adapter {adapter!r} needs {d} (its hidden size)"
        )
    return h


_Adapter = tuple[np.ndarray, np.ndarray, float, Any]


def _lora_adapters(adapters: Mapping[str, Any] | None) -> dict[str, _Adapter]:
    """Validate ``create_app(lora_adapters=...)`` once: name -> (A, B, scaling, backend)."""
    out: dict[str, _Adapter] = {}
    for name, spec in (adapters or {}).items():
        if not isinstance(name, str) or not name or len(name) > 128:
            raise ValueError(f"lora_adapters: names must be strings of 1 to 128 characters, got {name!r}")
        if not isinstance(spec, tuple | list) or not 2 <= len(spec) <= 4:
            raise TypeError(f"lora_adapters[{name!r}] must be (A, B[, scaling[, backend]])")
        a, b = (_matrix(f"lora_adapters[{name!r}] {m}", x) for m, x in zip("AB", spec[:2], strict=True))
        scaling = float(spec[2]) if len(spec) > 2 else 1.0
        backend = spec[3] if len(spec) > 3 else None
        if b.shape[1] != a.shape[0]:
            raise ValueError(f"lora_adapters[{name!r}]: B {b.shape} needs {a.shape[0]} columns (A's rank)")
        if not np.isfinite(scaling):
            raise ValueError(f"lora_adapters[{name!r}]: scaling must be finite, got {scaling!r}")
        if backend is not None:
            from gaussdp.inference.backends import LoRABackend

            if not isinstance(backend, LoRABackend):
                raise TypeError(f"lora_adapters[{name!r}]: backend must be a gaussdp.inference.LoRABackend")
        out[name] = (a, b, scaling, backend)
    return out


def _matrix(name: str, x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().double().numpy()
    arr = np.array(x, dtype=np.float64)
    if arr.ndim != 2 or not arr.size or not np.isfinite(arr).all():
        raise ValueError(f"{name} must be a finite, non-empty 2-D matrix, got shape {arr.shape}")
    return arr


def _server_lora_delta() -> Callable[..., Any]:
    """:func:`gaussdp.inference.server_lora_delta`, imported only when adapters are served (torch)."""
    from gaussdp.inference.split import server_lora_delta

    return server_lora_delta


def _charge_out(c: Any) -> ChargeOut:
    return ChargeOut(
        charge_id=c.charge_id,
        event=c.event,
        idempotency_key=c.idempotency_key,
        created_at=c.created_at,
        within_budget=c.within_budget,
        key_id=c.key_id,
    )


def _charge_then_release(
    led: Ledger, p: str, mech: Any, x: np.ndarray, key: str | None, key_id: str | None
) -> tuple[Any, Any]:
    """The ledger's charge-before-release, keeping the receipt for the response."""
    receipt = led.charge(p, mech.event, key, key_id=key_id)
    if receipt.replayed:
        raise IdempotencyKeyUsed(
            f"idempotency_key={key!r} was already charged and released; a second noisy value would not "
            "be covered by that charge (the first response is the only one)",
        )
    with no_cpu_limit():  # charged: the release must follow (its cost is bounded by the body size)
        return receipt, mech.release(x)


def _mechanism(
    epsilon: float | None, delta: float | None, sigma: float | None, sensitivity: float, noise: Any
) -> Any:
    from gaussdp.mechanism import GaussianMechanism

    if sigma is not None:
        return GaussianMechanism(sigma=sigma, sensitivity=sensitivity, noise=noise)
    return GaussianMechanism(epsilon=epsilon, delta=delta, sensitivity=sensitivity, noise=noise)


def _vector(values: list[float] | None, b64: str | None, b64_name: str) -> np.ndarray:
    if values is not None:
        return np.asarray(values, dtype=np.float64)
    if b64 is None:
        raise HTTPException(422, f"give the vector as a JSON list or as {b64_name}")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise HTTPException(422, f"{b64_name} must be standard base64 of little-endian float32") from None
    if not raw or len(raw) % 4:
        raise HTTPException(422, f"{b64_name} must decode to a whole number of float32 (4 bytes each)")
    x = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    if not np.isfinite(x).all():
        raise HTTPException(422, f"{b64_name} holds NaN or Inf")
    return x


def _encode(out: Any, name: str, *, b64: bool) -> dict[str, Any]:
    arr = np.asarray(out)
    if b64:
        return {f"{name}_b64": base64.b64encode(arr.astype("<f4").tobytes()).decode()}
    return {name: arr.astype(np.float64).tolist()}


def _include_optional_routers(app: FastAPI, dependencies: list[Any]) -> None:
    """Routers other topics contribute, when their modules (and extras) are importable."""
    try:
        from gaussdp.text.web import make_router
    except ImportError:
        return
    # The page, its scripts, the vocabulary and the guarantee are public (a browser opening a page
    # sends no key); submitting text needs the key the user types into the page.
    refusals = (
        error_responses(400, 401, 403, 413, 422, 429) if dependencies else error_responses(400, 413, 422)
    )
    app.include_router(make_router(submit_dependencies=dependencies, submit_responses=refusals))


def _version() -> str:
    from gaussdp import __version__

    return __version__
