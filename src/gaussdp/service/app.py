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

# No "from __future__ import annotations": FastAPI resolves the dependencies' annotations at runtime.

import importlib.util
import logging
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal

from gaussdp._extras import require_extra

require_extra("service", feature="gaussdp.service")

from fastapi import Depends, FastAPI

from gaussdp.budget import Ledger
from gaussdp.service import errors
from gaussdp.service.auth import KeyCache
from gaussdp.service.bounds import JSONDepthLimit
from gaussdp.service.deps import Gate, Service
from gaussdp.service.limits import BodySizeLimit, RateLimiter, SharedRateLimiter
from gaussdp.service.meta import health_router, metrics_router, time_requests
from gaussdp.service.metrics import Metrics
from gaussdp.service.openai_api import openai_router
from gaussdp.service.quotas import Quotas
from gaussdp.service.releases import lora_adapters as check_lora_adapters
from gaussdp.service.releases import releases_router
from gaussdp.service.responses import responses as error_responses
from gaussdp.service.sessions import HISTORY_DEFAULT_LIMIT as HISTORY_DEFAULT_LIMIT
from gaussdp.service.sessions import HISTORY_MAX_LIMIT as HISTORY_MAX_LIMIT
from gaussdp.service.sessions import sessions_router
from gaussdp.service.streaming import StreamLimits, generation_router

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
TEXT_SUBMIT_PATH = "/text/submit"
DEFAULT_CPU_LIMIT_S = 1.0


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
    if text not in ("keyed", "public", "off"):
        raise ValueError(f"text must be 'keyed', 'public' or 'off', got text={text!r}")
    if not cpu_limit_s > 0:
        raise ValueError(f"cpu_limit_s must be > 0, got cpu_limit_s={cpu_limit_s!r}")
    limiter = _rate_limiter(rate_limit_per_s, rate_limit_burst, rate_limit_file)
    stream_limits = StreamLimits(max_streams, max_streams_per_tenant, max_stream_s, stream_idle_s)
    quotas = Quotas(
        ckks_memory_bytes=ckks_memory_bytes,
        ckks_tenant_memory_bytes=ckks_tenant_memory_bytes,
        max_corpora_per_tenant=max_corpora_per_tenant,
        max_corpus_bytes_per_tenant=max_corpus_bytes_per_tenant,
        max_jobs_per_tenant=max_jobs_per_tenant,
    )
    adapters = check_lora_adapters(lora_adapters)
    owns_ledger = ledger is None
    led = Ledger(ledger_url) if ledger is None else ledger
    svc = Service(
        ledger=led,
        gate=Gate(KeyCache(led), limiter),
        noise=noise,
        cpu_limit_s=cpu_limit_s,
        stats=None if metrics == "off" else Metrics(),
        quotas=quotas,
        stream_limits=stream_limits,
        adapters=adapters,
    )
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
    app.state.service = svc
    _limit_bodies(app, max_body_bytes, ckks=ckks, corpora=data_dir is not None)
    if svc.stats is not None:
        time_requests(app, svc.stats)
    errors.install(app, svc.refused)
    errors.document(app)

    # The topics' routes go on the app's own router (no included router to walk per request); the
    # optional topics' routers are included whole, with their tags.
    health_router(svc, app.router)
    sessions_router(svc, app.router)
    releases_router(svc, app.router)
    if ckks:  # CKKS split mode: the same adapters, charge path and key check
        from gaussdp.service.ckks import ckks_router

        app.include_router(ckks_router(svc))
    app.include_router(generation_router(svc))
    app.include_router(openai_router(svc))
    if metrics != "off":
        metrics_router(svc, metrics, app.router)
    if text != "off":
        _include_optional_routers(app, [Depends(svc.releaser)] if text == "keyed" else [])
    if data_dir is not None:
        from gaussdp.service.finetune import make_finetune_router
        from gaussdp.service.jobs import JobStore

        app.state.jobs = JobStore(_durable_url(led))
        app.state.model_paths = dict(model_paths or {})
        finetune = make_finetune_router(
            svc, jobs=app.state.jobs, data_dir=data_dir, model_paths=app.state.model_paths
        )
        app.include_router(finetune)
    return app


def _rate_limiter(
    per_s: float | None, burst: int | None, shared_file: str | None
) -> RateLimiter | SharedRateLimiter | None:
    """The API keys' token buckets: per process, or shared by this host's workers through a file."""
    if per_s is None:
        return None
    if shared_file is None:
        return RateLimiter(per_s, burst)
    return SharedRateLimiter(shared_file, per_s, burst)


def _limit_bodies(app: FastAPI, max_body_bytes: int, *, ckks: bool, corpora: bool) -> None:
    """Bound every request body before it is read, and its JSON nesting before it is parsed."""
    from gaussdp.text.tokenize import MAX_INPUT_BYTES

    path_limits = _ckks_body_limits(ckks)
    raw_paths = [] if not ckks else [_ckks_context_path()]  # bodies that are not JSON
    # One upload limit for text everywhere: 20 MB (decimal) of UTF-8, as the /text page promises.
    # /text/submit carries it in a JSON string, where a newline or a quote takes two bytes: the body
    # may be twice the text; the route itself refuses text over 20 MB (413, saying so).
    twenty_mb = f"the text limit is {MAX_INPUT_BYTES} bytes (20 MB) of UTF-8; split the text"
    path_limits[re.escape(TEXT_SUBMIT_PATH)] = 2 * MAX_INPUT_BYTES + 65_536
    path_notes = {re.escape(TEXT_SUBMIT_PATH): twenty_mb}
    if corpora:
        from gaussdp.service.finetune import CORPORA_PATH, MAX_CORPUS_BYTES

        path_limits[re.escape(CORPORA_PATH)] = MAX_CORPUS_BYTES  # corpora have their own limit
        path_notes[re.escape(CORPORA_PATH)] = twenty_mb
        raw_paths.append(re.escape(CORPORA_PATH))
    # inside the size limit: a body's bytes are counted first
    app.add_middleware(JSONDepthLimit, raw_paths=raw_paths)
    app.add_middleware(
        BodySizeLimit, max_body_bytes=max_body_bytes, path_limits=path_limits, path_notes=path_notes
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
