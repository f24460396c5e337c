"""The FastAPI dependencies of the service's routes: who calls (the API key, its scope, its rate),
whose session it is (:meth:`Service.owned`), and bounded work (the per-request CPU limit, in a worker
thread, off the event loop: :func:`bounded` for sync routes, :class:`CPUBudget` and
:class:`HeavyLane` for the CPU-heavy work of async ones).

Every router is made by a function of the app's :class:`Service` (what the routers share: the
ledger, the key gate with its scoped dependencies, ownership of sessions, the limits and the metrics
hooks), plus, for fine-tuning, its own stores; ``create_app`` builds the Service, keeps it in
``app.state.service`` and composes the routers over it. Nothing else is injected.

:class:`Gate` authenticates HTTP requests (``Authorization: Bearer``) and WebSocket streams, whose
key comes from the upgrade request only, before any message is read: the ``Authorization``
header, or for browsers (which cannot set headers on a WebSocket) the subprotocol
``gaussdp.key.<API key>``, offered next to ``gaussdp.v1`` (the server answers with ``gaussdp.v1``,
never echoing the key). A key in the URL or in a message is never read. Long requests re-check
their key (:meth:`Gate.alive`) so that revoking it ends them within 1 s.
"""

# No "from __future__ import annotations": FastAPI resolves the dependencies' annotations at runtime.

import asyncio
import functools
import math
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import anyio
from fastapi import Depends, Path
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gaussdp._worklimit import cpu_limit
from gaussdp.budget import Ledger, UnknownPrincipal
from gaussdp.errors import WorkLimitExceeded
from gaussdp.service.auth import Caller, KeyCache
from gaussdp.service.errors import Refusal
from gaussdp.service.keys import scope_allows
from gaussdp.service.models import SESSION_ID_PATTERN
from gaussdp.service.quotas import Quotas

__all__ = [
    "KEY_SUBPROTOCOL_PREFIX",
    "SUBPROTOCOL",
    "CPUBudget",
    "Gate",
    "HeavyLane",
    "Service",
    "SessionId",
    "bounded",
    "websocket_key",
]

#: The subprotocol a WebSocket client offers (and the server selects) for the gaussdp stream.
SUBPROTOCOL = "gaussdp.v1"
#: A browser's API key rides in the offered subprotocols as ``gaussdp.key.<key>``.
KEY_SUBPROTOCOL_PREFIX = "gaussdp.key."

if TYPE_CHECKING:
    from gaussdp.service.generation import Generations
    from gaussdp.service.streaming import StreamLimits

T = TypeVar("T")

#: The ``{session_id}`` path parameter of every session route.
SessionId = Annotated[str, Path(pattern=SESSION_ID_PATTERN, description="The session's id.")]


class Gate:
    """API keys -> callers, with scopes and rate limits (one per app). Its refusals are counted
    where they are answered (the app's handlers, a stream's error message), not here."""

    def __init__(self, tenants: KeyCache, limiter: Any) -> None:
        self.tenants = tenants
        self.limiter = limiter
        self.bearer = HTTPBearer(
            auto_error=False, description="An API key from `gaussdp keys create TENANT`."
        )

        def caller(creds: Annotated[HTTPAuthorizationCredentials | None, Depends(self.bearer)]) -> Caller:
            return self.authenticate(None if creds is None else creds.credentials)

        self.caller = caller

    def authenticate(self, key: str | None, scope: str | None = None) -> Caller:
        """The caller of ``key``, counted against its rate limit (and checked for ``scope``).

        Raises:
            Refusal: ``unauthorized``, ``rate_limited`` (with ``Retry-After``) or ``forbidden``.
        """
        who = None if key is None else self.tenants.tenant(key)
        if who is None:
            raise Refusal("unauthorized", "missing, invalid, revoked or expired API key")
        if self.limiter is not None:
            wait = self.limiter.take(who.key_id)
            if wait > 0:
                raise Refusal(
                    "rate_limited",
                    f"rate limit of this API key ({self.limiter.rate:g} requests/s) reached; retry later",
                    headers={"Retry-After": str(max(1, math.ceil(wait)))},
                )
        if scope is not None:
            self.check_scope(who, scope)
        return who

    def check_scope(self, who: Caller, scope: str) -> None:
        if not scope_allows(who.scope, scope):
            raise Refusal("forbidden", f"this API key's scope {who.scope!r} does not allow {scope!r} routes")

    def needs(self, scope: str) -> Callable[..., Caller]:
        """The dependency of a route that needs ``scope`` (``read`` < ``release`` < ``admin``)."""

        def scoped(who: Annotated[Caller, Depends(self.caller)]) -> Caller:
            self.check_scope(who, scope)
            return who

        return scoped

    def alive(self, who: Caller) -> bool:
        """Whether ``who``'s key is still valid (revocation and expiry, seen within 0.5 s)."""
        return self.tenants.alive(who)


def websocket_key(headers: Any, subprotocols: list[str]) -> tuple[str | None, str | None]:
    """(the API key of a WebSocket upgrade, the subprotocol to answer with), from the upgrade alone.

    Raises:
        Refusal: ``invalid`` when the key is given both ways.
    """
    header = headers.get("authorization")
    # one header may list several (some ASGI servers pass "a, b" as one entry): split them
    subprotocols = [p.strip() for entry in subprotocols for p in entry.split(",") if p.strip()]
    offered = [p for p in subprotocols if p.startswith(KEY_SUBPROTOCOL_PREFIX)]
    if header is not None and offered:
        raise Refusal(
            "invalid", "give the API key in the Authorization header or in the subprotocol, not both"
        )
    chosen = SUBPROTOCOL if SUBPROTOCOL in subprotocols else None
    if header is not None:
        scheme, _, credentials = header.partition(" ")
        return (credentials.strip() if scheme.lower() == "bearer" else None), chosen
    if len(offered) == 1:
        return offered[0][len(KEY_SUBPROTOCOL_PREFIX) :], chosen
    return None, chosen


def bounded(cpu_limit_s: float) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Run a (sync) route under the per-request CPU limit, in the worker thread that runs it."""

    def wrap(route: Callable[..., T]) -> Callable[..., T]:
        @functools.wraps(route)
        def limited(*args: Any, **kwargs: Any) -> T:
            with cpu_limit(cpu_limit_s):
                return route(*args, **kwargs)

        return limited

    return wrap


class HeavyLane:
    """CPU-heavy request work (a corpus block's check, a CKKS context's loading), one piece at a
    time per worker process, first come first served, each in a worker thread, busy at most
    ``duty`` of the time.

    Python runs one thread at a time (the GIL): pieces in parallel threads would not finish sooner,
    but every thread that wants the GIL makes the event loop (and the forward passes of other
    tenants' streams) wait longer for it. One at a time, they wait for at most one piece's next
    switch (1 ms of Python in ``gaussdp serve``, or one short C call); after a piece of ``t``
    seconds the lane rests ``t (1 / duty - 1)``, so that back-to-back uploads hold the GIL at most
    ``duty`` of the time. A long upload goes back in the queue after each block, so that uploads
    interleave block by block.
    """

    def __init__(self, duty: float = 0.5) -> None:
        if not 0 < duty <= 1:
            raise ValueError(f"duty must be in (0, 1], got duty={duty!r}")
        self.duty = duty
        self._state: dict[int, tuple[asyncio.Lock, list[float]]] = {}  # per event loop (tests run several)

    def _lane(self) -> tuple[asyncio.Lock, list[float]]:
        loop = id(asyncio.get_running_loop())
        if loop not in self._state:
            self._state = {loop: (asyncio.Lock(), [0.0])}
        return self._state[loop]

    async def run(self, budget: "CPUBudget", fn: Callable[..., T], *args: Any) -> T:
        lock, free_at = self._lane()
        async with lock:
            rest = free_at[0] - time.monotonic()
            if rest > 0:
                await asyncio.sleep(rest)
            t0 = time.monotonic()
            try:
                return await budget.run(fn, *args)
            finally:
                now = time.monotonic()
                free_at[0] = now + (now - t0) * (1 / self.duty - 1)


class CPUBudget:
    """The per-request CPU limit of work an async route does in several worker-thread calls (a
    corpus, block by block): each call runs under what is left, and the calls together may not use
    more than ``seconds`` (:class:`~gaussdp.errors.WorkLimitExceeded` once they have)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = float(seconds)
        self.left = float(seconds)

    def _exceeded(self) -> WorkLimitExceeded:
        return WorkLimitExceeded(
            f"the request needed more than {self.seconds:g} s of CPU, the limit of one request; "
            "nothing was stored or charged"
        )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self.left <= 0:
            raise self._exceeded()

        def call() -> T:
            t0 = time.thread_time()
            try:
                with cpu_limit(self.left):
                    return fn(*args)
            finally:
                self.left -= time.thread_time() - t0

        result = await anyio.to_thread.run_sync(call)
        if self.left < 0:
            raise self._exceeded()
        return result


class Service:
    """What the routers of one app share: built once by ``create_app``, held in ``app.state.service``.

    Attributes:
        ledger: the app's :class:`~gaussdp.budget.Ledger` (budgets, charges, keys, tenant caps).
        gate: its API keys; ``reader``, ``releaser`` and ``admin`` are the dependencies of routes
            that need the scopes ``read``, ``release`` and ``admin``.
        noise: the noise source of every release (``GaussianMechanism(noise=...)``).
        cpu_limit_s: CPU seconds of numeric work one request may use; ``bounded`` applies it to a
            sync route, ``lane`` runs the CPU-heavy pieces of async ones one at a time.
        stats: the app's :class:`~gaussdp.service.metrics.Metrics`, or None (``metrics="off"``).
        quotas: the tenants' quotas (:class:`~gaussdp.service.quotas.Quotas`).
        stream_limits: generation slots and time limits (:class:`~gaussdp.service.streaming.StreamLimits`).
        adapters: the LoRA adapters served in split mode: name -> (A, B, scaling, backend).
        generations: the generations of the app (slots, model locks, each token charged before it
            goes out), shared by every route that generates.
    """

    def __init__(
        self,
        *,
        ledger: Ledger,
        gate: Gate,
        noise: str,
        cpu_limit_s: float,
        stats: Any = None,
        quotas: Quotas | None = None,
        stream_limits: "StreamLimits | None" = None,
        adapters: Mapping[str, tuple[Any, Any, float, Any]] | None = None,
    ) -> None:
        self.ledger = ledger
        self.gate = gate
        self.noise = noise
        self.cpu_limit_s = cpu_limit_s
        self.stats = stats
        self.quotas = quotas or Quotas()
        self.stream_limits = stream_limits
        self.adapters = dict(adapters or {})
        self.reader = gate.needs("read")
        self.releaser = gate.needs("release")
        self.admin = gate.needs("admin")
        self.bounded = bounded(cpu_limit_s)
        self.lane = HeavyLane()  # CPU-heavy work of async routes, one piece at a time

    @functools.cached_property
    def generations(self) -> "Generations":
        from gaussdp.service.generation import Generations
        from gaussdp.service.streaming import StreamLimits

        lim = self.stream_limits or StreamLimits()
        return Generations(self, lim.max_streams, lim.max_streams_per_tenant)

    @staticmethod
    def principal(tenant: str, session_id: str) -> str:
        """The ledger's principal of a tenant's session."""
        # Tenant names cannot contain "/", so "tenant/session" never collides across tenants.
        return f"{tenant}/{session_id}"

    def owned(self, tenant: str, session_id: str) -> str:
        """The principal of ``tenant``'s session ``session_id``.

        Raises:
            Refusal: ``not_found`` when this tenant has no such session (another tenant's sessions
                are indistinguishable from missing ones).
        """
        p = self.principal(tenant, session_id)
        try:
            self.ledger.budget(p)
        except UnknownPrincipal:
            raise Refusal("not_found", f"no session {session_id!r} for this API key") from None
        return p

    def refused(self, code: str) -> None:
        """Count a refusal (by its code in the error table)."""
        if self.stats is not None:
            self.stats.refusals.labels(code).inc()

    def charged(self, who: Caller, receipt: Any) -> None:
        """Count a charge and the epsilon it added to its session (a replay adds nothing)."""
        if self.stats is not None and not receipt.replayed:
            self.stats.charges.labels(who.tenant).inc()
            self.stats.epsilon.labels(who.tenant).inc(self.ledger.increase(receipt))
