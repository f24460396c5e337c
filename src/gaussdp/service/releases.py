"""The release routes over plain vectors: ``/release`` (a Gaussian release of a clipped vector),
and split mode, ``/hidden-state`` (TRUSTED server: it clips and noises the clean state) and
``/lora-delta`` (honest-but-curious server: the LoRA delta of rows the client privatized, charged
as the client declares). Each charges the session through the ledger before anything leaves:
:meth:`gaussdp.budget.Ledger.release` (value, receipt, spent and remaining in one call) or, when the
answer is computed first, ``Ledger.charge(..., fresh=True)``.
"""

# No "from __future__ import annotations": FastAPI resolves the local Annotated aliases at runtime.

import base64
import binascii
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, HTTPException

from gaussdp._worklimit import no_cpu_limit
from gaussdp.service.auth import Caller
from gaussdp.service.deps import Service, SessionId
from gaussdp.service.errors import responses as error_responses
from gaussdp.service.models import (
    HiddenStateIn,
    HiddenStateOut,
    LoraDeltaIn,
    LoraDeltaOut,
    Privacy,
    ReleaseIn,
    ReleaseOut,
)

__all__ = ["lora_adapters", "releases_router", "sensitivity_of"]


def releases_router(svc: Service, router: APIRouter | None = None) -> APIRouter:
    """``/release``, ``/hidden-state`` and ``/lora-delta`` (with ``svc.adapters``; without, 422), on
    ``router`` (``create_app`` passes its own, as for :func:`~gaussdp.service.sessions.sessions_router`),
    else on a new one."""
    led = svc.ledger
    adapters = svc.adapters
    lora_delta_of = _server_lora_delta() if adapters else None
    Releaser = Annotated[Caller, Depends(svc.releaser)]
    router = APIRouter() if router is None else router

    @router.post(
        "/v1/sessions/{session_id}/release",
        response_model=ReleaseOut,
        tags=["releases"],
        responses=error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503),
    )
    @svc.bounded
    def release(session_id: SessionId, body: ReleaseIn, who: Releaser) -> ReleaseOut:
        """Clip a vector to L2 norm ``sensitivity``, add calibrated Gaussian noise; charged first."""
        p = svc.owned(who.tenant, session_id)
        x = _vector(body.vector, body.vector_b64, "vector_b64")
        mech = _mechanism(body.epsilon, body.delta, body.sigma, body.sensitivity, svc.noise)
        released = led.release(p, mech, x, idempotency_key=body.idempotency_key, key_id=who.key_id)
        with no_cpu_limit():  # charged: the answer must not fail on the limit now
            svc.charged(who, released.receipt)
            return ReleaseOut(
                **_encode(released.value, "vector", b64=body.vector_b64 is not None),
                sigma=float(mech.sigma),
                sensitivity=body.sensitivity,
                charge_id=released.charge_id,
                spent=Privacy.of(released.spent),
                remaining=Privacy.of(released.remaining),
            )

    @router.post(
        "/v1/sessions/{session_id}/hidden-state",
        response_model=HiddenStateOut,
        tags=["releases"],
        responses=error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503),
    )
    @svc.bounded
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
        p = svc.owned(who.tenant, session_id)
        x = _vector(body.hidden_state, body.hidden_state_b64, "hidden_state_b64")
        sensitivity = sensitivity_of(body.clip_norm, body.neighbouring)
        if body.neighbouring == "replace_one":
            x = _clip(x, body.clip_norm)  # clipped to C, noised for 2C (the mechanism's clip is a no-op)
        mech = _mechanism(body.epsilon, body.delta, body.sigma, sensitivity, svc.noise)
        released = led.release(p, mech, x, idempotency_key=body.idempotency_key, key_id=who.key_id)
        with no_cpu_limit():  # charged: the answer must not fail on the limit now
            svc.charged(who, released.receipt)
            return HiddenStateOut(
                **_encode(released.value, "noised", b64=body.hidden_state_b64 is not None),
                sigma=float(mech.sigma),
                clip_norm=body.clip_norm,
                neighbouring=body.neighbouring,
                sensitivity=sensitivity,
                epsilon_spent=released.spent.epsilon,
                budget_ok=True,
                charge_id=released.charge_id,
            )

    @router.post(
        "/v1/sessions/{session_id}/lora-delta",
        response_model=LoraDeltaOut,
        tags=["releases"],
        responses=error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503),
    )
    @svc.bounded
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
        from gaussdp.inference.privatizer import row_event

        p = svc.owned(who.tenant, session_id)
        adapter = adapters.get(body.adapter)
        if adapter is None or lora_delta_of is None:
            raise HTTPException(422, f"adapter: no LoRA adapter named {body.adapter!r} on this server")
        a, b, scaling, backend = adapter
        h = _rows(body.noised, body.noised_b64, a.shape[1], body.adapter)
        sensitivity = sensitivity_of(body.clip_norm, body.neighbouring)
        event = row_event(body.sigma / sensitivity, h.shape[0])
        # Computed first (nothing leaves before the charge), so that a failure charges nothing.
        with np.errstate(over="ignore", invalid="ignore"):
            out = np.asarray(lora_delta_of(h, a, b, scaling, backend=backend), dtype=np.float64)
            b64 = body.noised_b64 is not None
            if not np.isfinite(out.astype(np.float32) if b64 else out).all():
                raise HTTPException(422, "noised: the delta overflows (rows far too large); nothing charged")
        receipt = led.charge(p, event, body.idempotency_key, key_id=who.key_id, fresh=True)
        with no_cpu_limit():  # charged: the answer must not fail on the limit now
            svc.charged(who, receipt)
            spent = led.spent(p, as_of=receipt)
            remaining = led.budget(p).remaining(spent)
        return LoraDeltaOut(
            **_encode(out, "delta", b64=b64),
            rows=int(h.shape[0]),
            d_out=int(b.shape[0]),
            adapter=body.adapter,
            neighbouring=body.neighbouring,
            sensitivity=sensitivity,
            noise_multiplier=body.sigma / sensitivity,
            charge_id=receipt.charge_id,
            spent=Privacy.of(spent),
            remaining=Privacy.of(remaining),
        )

    return router


def sensitivity_of(clip_norm: float, neighbouring: str) -> float:
    """L2 sensitivity of one row clipped to ``clip_norm``: 2C under replace, C under add/remove."""
    from gaussdp._neighbouring import hidden_state_sensitivity

    return hidden_state_sensitivity(clip_norm, neighbouring)


def _clip(x: np.ndarray, clip_norm: float) -> np.ndarray:
    from gaussdp.clipping import clip_rows

    clipped, _ = clip_rows(x.reshape(1, -1), clip_norm)
    return np.asarray(clipped).reshape(x.shape)


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


def lora_adapters(adapters: Mapping[str, Any] | None) -> dict[str, _Adapter]:
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
