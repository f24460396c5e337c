"""The sessions routes: open a session with a budget, read it, page through its charges, and the
tenant's audit export (``tags=["sessions"]`` and ``["audit"]``)."""

# No "from __future__ import annotations": FastAPI resolves the local Annotated aliases at runtime.

import json
import secrets
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import StreamingResponse

from gaussdp.budget import Budget
from gaussdp.service.auth import Caller
from gaussdp.service.deps import Service, SessionId
from gaussdp.service.errors import responses as error_responses
from gaussdp.service.models import AuditLine, ChargeOut, HistoryPage, Privacy, SessionIn, SessionOut
from gaussdp.service.responses import CURSOR_PATTERN, after_cursor, cursor_after

__all__ = ["HISTORY_DEFAULT_LIMIT", "HISTORY_MAX_LIMIT", "sessions_router"]

HISTORY_DEFAULT_LIMIT = 100
HISTORY_MAX_LIMIT = 1000
_EXPORT_PAGE = 1000


def sessions_router(svc: Service, router: APIRouter | None = None) -> APIRouter:
    """``/v1/sessions`` (create, list, read, history) and ``/v1/audit/export`` over ``svc``'s ledger,
    on ``router`` (``create_app`` passes its own: the routes are the app's, with no included router
    to walk for each request), else on a new one."""
    led = svc.ledger
    Who = Annotated[Caller, Depends(svc.reader)]
    Releaser = Annotated[Caller, Depends(svc.releaser)]
    Admin = Annotated[Caller, Depends(svc.admin)]
    router = APIRouter() if router is None else router

    def session_out(p: str, session_id: str) -> SessionOut:
        budget, spent = led.budget(p), led.spent(p)
        return SessionOut(
            session_id=session_id,
            accountant=led.accountant(p),
            budget=Privacy.of(budget),
            spent=Privacy.of(spent),
            remaining=Privacy.of(budget.remaining(spent)),
            charges=sum(c for _, c in led.store.groups(p).items()),
        )

    @router.post(
        "/v1/sessions",
        status_code=201,
        response_model=SessionOut,
        tags=["sessions"],
        responses=error_responses(400, 401, 403, 409, 413, 422, 429, 503),
    )
    @svc.bounded
    def create_session(body: SessionIn, who: Releaser) -> SessionOut:
        """Open a session with a total (epsilon, delta) budget; its releases are charged to it.

        Counted against the tenant's caps, when it has some (429 ``tenant_limit_exceeded``).
        """
        session_id = body.session_id or secrets.token_urlsafe(12)
        p = svc.principal(who.tenant, session_id)
        led.open(p, Budget(body.epsilon, body.delta), accountant=body.accountant, tenant=who.tenant)
        return session_out(p, session_id)

    @router.get("/v1/sessions", tags=["sessions"], responses=error_responses(401, 429, 503))
    def list_sessions(who: Who) -> list[str]:
        """The ids of this tenant's sessions."""
        prefix = svc.principal(who.tenant, "")
        return [p[len(prefix) :] for p in led.principals(prefix)]

    @router.get(
        "/v1/sessions/{session_id}",
        response_model=SessionOut,
        tags=["sessions"],
        responses=error_responses(401, 404, 422, 429, 503),
    )
    @svc.bounded
    def get_session(session_id: SessionId, who: Who) -> SessionOut:
        """Budget, spent and remaining privacy of a session."""
        return session_out(svc.owned(who.tenant, session_id), session_id)

    @router.get(
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
        p = svc.owned(who.tenant, session_id)
        page = led.history_page(p, after=after_cursor(cursor), limit=limit + 1)  # one more: is there a next?
        more = len(page) > limit
        page = page[:limit]
        return HistoryPage(
            charges=[_charge_out(c) for c in page],
            next_cursor=cursor_after(page[-1].charge_id) if more else None,
        )

    @router.get(
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
        prefix = svc.principal(who.tenant, "")
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

    return router


def _charge_out(c: Any) -> ChargeOut:
    return ChargeOut(
        charge_id=c.charge_id,
        event=c.event,
        idempotency_key=c.idempotency_key,
        created_at=c.created_at,
        within_budget=c.within_budget,
        key_id=c.key_id,
    )
