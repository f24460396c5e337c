"""The meta routes: liveness (``/healthz``), readiness (``/readyz``), Prometheus ``/metrics`` and
the latency middleware that feeds it (``tags=["meta"]``)."""

# No "from __future__ import annotations": FastAPI resolves the local Annotated aliases at runtime.

import logging
import time
from typing import Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from gaussdp.budget import StoreUnavailable
from gaussdp.service.deps import Service
from gaussdp.service.errors import responses as error_responses
from gaussdp.service.models import ReadyOut

__all__ = ["health_router", "metrics_router", "time_requests"]

logger = logging.getLogger("gaussdp.service")


def health_router(svc: Service, router: APIRouter | None = None) -> APIRouter:
    """``/healthz`` (the process answers) and ``/readyz`` (the ledger's database answers); no key.
    On ``router`` (``create_app`` passes its own), else on a new one."""
    router = APIRouter() if router is None else router

    @router.get("/healthz", tags=["meta"])
    def healthz() -> dict[str, str]:
        """Liveness probe (no key needed): the process answers; the database is not consulted."""
        return {"status": "ok"}

    @router.get(
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
            svc.ledger.store.ping()
        except StoreUnavailable as exc:
            logger.warning("readiness: %s", exc)
            return JSONResponse(
                {"status": "unavailable", "error": "database_unavailable"},
                status_code=503,
                headers={"Retry-After": "1"},
            )
        return JSONResponse({"status": "ok"})

    return router


def metrics_router(
    svc: Service, access: Literal["keyed", "public"], router: APIRouter | None = None
) -> APIRouter:
    """``/metrics`` in Prometheus text format: an ``admin`` key unless ``access="public"``; on
    ``router`` (``create_app`` passes its own), else on a new one."""
    stats = svc.stats
    if stats is None:
        raise ValueError("metrics_router needs a Service with stats (create_app(metrics='off') has none)")
    keyed = access == "keyed"
    router = APIRouter() if router is None else router

    @router.get(
        "/metrics",
        tags=["meta"],
        dependencies=[Depends(svc.admin)] if keyed else [],
        response_class=Response,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **(error_responses(401, 403, 429) if keyed else {}),
        },
    )
    def prometheus_metrics() -> Response:
        """Prometheus text format: charges, refusals, latency histograms, epsilon spent per tenant."""
        body, content_type = stats.render()
        return Response(body, media_type=content_type)

    return router


def time_requests(app: FastAPI, stats: Any) -> None:
    """Observe every request's latency by route template, method and status (bounded label values)."""

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
