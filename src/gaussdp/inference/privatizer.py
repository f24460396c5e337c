"""Privatize the hidden states of a PyTorch model at one layer: clip, charge, noise, release.

:class:`HiddenStatePrivatizer` registers a forward hook on one module (by default the last
transformer block of a Hugging Face model) **only while it is active**: inside ``with privatizer:``
or between :meth:`~HiddenStatePrivatizer.attach` and :meth:`~HiddenStatePrivatizer.detach`.
Constructing a privatizer changes nothing: the model's forward passes outside that window are the
clean model's and charge nothing. While the hook is registered it applies to *every* forward pass
of the module, in any thread (a hook on a module cannot tell its callers apart; privatizing a pass
that did not ask for it costs budget, leaving one clean that did ask would leak). Each time the
module runs with the hook active, the hook takes its output
hidden state, clips every token's vector (or every sequence's whole matrix) to L2 norm ``clip_norm``
(:func:`gaussdp.clipping.clip_rows`), charges the session's ledger for every vector it is about to
release, adds Gaussian noise, and returns the noised state in place of the clean one. If the charge
is refused (:class:`~gaussdp.errors.BudgetExhausted`) the exception leaves the forward pass and
nothing computed from this request's hidden state is released.

What is protected (the neighbouring relation)
---------------------------------------------
The unit released is one row: one token's hidden state (``per="token"``) or one sequence's whole
hidden-state matrix (``per="sequence"``). Every released row is clipped to ``clip_norm = C``.

* ``neighbouring="replace_one"`` (default, everywhere for hidden states: the privatizer, split mode,
  the service's ``/hidden-state`` and ``/lora-delta`` and the CLI share
  :data:`gaussdp._neighbouring.DEFAULT_HIDDEN_STATE_NEIGHBOURING`, so a sigma calibrated with the
  default is charged the same epsilon on every path): two requests are neighbours whatever their
  content (a request's rows are always present; what it hides is what they say); a row
  can move from any point of the C-ball to any other, so its L2 sensitivity is ``2C``. Because
  every row of a request is charged (one :class:`~gaussdp.accounting.GaussianEvent` per row,
  composed by the ledger's accountant), the epsilon the ledger reports covers the *whole* request
  (all its tokens) and, composed over requests, the whole session.
* ``neighbouring="add_remove"``: a row is neighbour to its absence (the zero vector), sensitivity
  ``C``. This is the relation under which the private inference server's ``Delta_f = 1`` for a clip of 1 is
  right; it protects the presence of a hidden state, not its content against any other content.

The guarantee covers everything computed *from the hooked module's output alone* (post-processing):
for a decoder-only transformer hooked at a block, the rest of the model only sees the residual
stream through that block's output. A model with a path around the hooked layer (cross-attention to
an encoder, embeddings re-read later) is not covered.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from gaussdp._format import format_exact, format_upper
from gaussdp._neighbouring import (
    DEFAULT_HIDDEN_STATE_NEIGHBOURING,
    HiddenStateNeighbouring,
    check_neighbouring,
    hidden_state_sensitivity,
)
from gaussdp._validate import SetOnce, check_choice, check_delta, check_epsilon, check_positive
from gaussdp.errors import InvalidParameter, NotPrivateWarning, UnsafeInput
from gaussdp.inference._layers import resolve_layer, split_output

__all__ = ["HiddenStatePrivatizer", "ReleaseStats", "row_event", "working_dtype"]

Per = Literal["token", "sequence"]
Neighbouring = HiddenStateNeighbouring


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision a hidden state of ``dtype`` is clipped and noised in: float64 for float64,
    float32 for every narrower floating-point dtype (bfloat16, float16, float32, float8 ...).

    Half-precision states are widened, never clipped or noised in their own dtype: the core's
    float-safe noise works on float32/float64 values, and float32 holds every bfloat16 and float16
    value exactly, so the widening changes nothing that is released.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class ReleaseStats:
    """What the last release looked like, on the client side (never sent anywhere).

    Attributes:
        rows: number of vectors released (tokens or sequences) and charged.
        dim: length of each released vector.
        mean_norm: mean L2 norm of the rows before clipping.
        fraction_clipped: share of rows whose norm was above ``clip_norm``.
        mean_clipped_norm: mean L2 norm after clipping (<= clip_norm): the signal that survives.
        mean_noise_norm: mean L2 norm of the noise added to a row (0 when noise is off).
        snr: ``mean_clipped_norm / mean_noise_norm`` (inf when noise is off).
    """

    rows: int
    dim: int
    mean_norm: float
    fraction_clipped: float
    mean_clipped_norm: float
    mean_noise_norm: float
    snr: float


class HiddenStatePrivatizer(SetOnce):
    """A forward hook that clips and noises one layer's hidden states and charges a session's budget.

    The noise is calibrated for one row (one token's hidden state, or one sequence) under the
    relation chosen by ``neighbouring`` (see the module docstring): with ``epsilon`` and ``delta``
    given, ``sigma = sigma_for(epsilon, delta, sensitivity)`` (analytic by default), so each row is an
    exact ``(epsilon, delta)``-DP release; the ledger composes all rows of all requests of a session
    (PLD accountant by default) and refuses a request that would take it past its budget.

    Args:
        model: the model to hook, or ``None`` for a detached privatizer (call :meth:`privatize`).
        layer: ``None`` (the last transformer block, found by name), a block index, a module path
            such as ``"model.layers.3"``, or a module.
        clip_norm: L2 bound C of each released row, > 0.
        epsilon, delta: per-row target; give these, or ``sigma`` (then ``delta`` is optional and
            only used for reporting).
        sigma: noise standard deviation per coordinate, > 0.
        ledger: a :class:`gaussdp.budget.Ledger`; each request's rows are charged to the session's
            principal before the hook returns. ``None``: tracked locally with ``accountant``, never
            refused.
        session_id: the default principal charged; switch per request with :meth:`session`.
        budget: a :class:`gaussdp.budget.Budget`: open ``session_id`` on ``ledger`` with it (and
            ``accountant``) if it is new; without it the session must already be open.
        per: ``"token"`` (default) or ``"sequence"`` (dim 0 of the hidden state is the batch).
        accountant: accountant of the local tracking when ``ledger`` is None, and of a session
            opened through ``budget=``.
        neighbouring: ``"replace_one"`` (default, sensitivity 2C) or ``"add_remove"`` (sensitivity C).
        method: calibration method, ``"analytic"`` (default) or ``"classical"``.
        noise: ``"secure"`` (default, OS entropy) or ``"fast"``; ``False`` switches noise off for
            tests of the deterministic parts: NOT PRIVATE, warns, charges nothing, refuses a ledger.
        seed: fixed seed for reproducible experiments only: NOT PRIVATE (warns NotPrivateWarning).

    Raises:
        InvalidParameter: a parameter out of range; both or neither of sigma and epsilon.
        LookupError: the layer could not be found.
    """

    # calibrated together at construction (gaussdp._validate.SetOnce): never reassigned
    _CALIBRATED = frozenset(
        {
            "clip_norm",
            "sensitivity",
            "neighbouring",
            "per",
            "sigma",
            "noise_multiplier",
            "delta",
            "epsilon_per_row",
            "noise_enabled",
            "private",
        }
    )

    def __init__(
        self,
        model: nn.Module | None,
        layer: str | int | nn.Module | None = None,
        *,
        clip_norm: float,
        epsilon: float | None = None,
        delta: float | None = None,
        sigma: float | None = None,
        ledger: Any = None,
        session_id: str = "default",
        budget: Any = None,
        per: Per = "token",
        accountant: str = "pld",
        neighbouring: Neighbouring = DEFAULT_HIDDEN_STATE_NEIGHBOURING,
        method: str = "analytic",
        noise: str | bool = "secure",
        seed: int | None = None,
    ) -> None:
        from gaussdp.calibration import epsilon_for, sigma_for

        self.layer_path: str | None = None
        self.module: nn.Module | None = None
        self._handle: Any = None
        self.clip_norm = check_positive("clip_norm", clip_norm)
        check_choice("per", per, ("token", "sequence"))
        if not isinstance(session_id, str) or not session_id:
            raise InvalidParameter(f"session_id must be a non-empty string, got session_id={session_id!r}")
        self.per: Per = per
        self.neighbouring: Neighbouring = check_neighbouring(neighbouring).value
        self.sensitivity = hidden_state_sensitivity(self.clip_norm, self.neighbouring)
        self.delta = None if delta is None else check_delta(delta)
        self.noise_enabled = noise is not False
        if self.noise_enabled:
            if (sigma is None) == (epsilon is None):
                raise InvalidParameter("give either sigma=, or epsilon= and delta=, not both or neither")
            if sigma is not None:
                self.sigma = check_positive("sigma", sigma)
            else:
                if self.delta is None:
                    raise InvalidParameter("epsilon= needs delta= to calibrate sigma")
                self.sigma = sigma_for(
                    epsilon=check_epsilon(epsilon),
                    delta=self.delta,
                    sensitivity=self.sensitivity,
                    method=method,  # type: ignore[arg-type]
                )
            self.noise_multiplier = self.sigma / self.sensitivity
            from gaussdp.accounting.events import NOISE_MULTIPLIER_MAX, NOISE_MULTIPLIER_MIN

            if not NOISE_MULTIPLIER_MIN <= self.noise_multiplier <= NOISE_MULTIPLIER_MAX:
                # refused here, before any release, naming what the caller gave
                raise InvalidParameter(
                    f"sigma / sensitivity must be in [{NOISE_MULTIPLIER_MIN:g}, {NOISE_MULTIPLIER_MAX:g}], "
                    "got "
                    f"sigma={self.sigma!r}, sensitivity={self.sensitivity!r} (clip_norm={clip_norm!r}): "
                    "outside it no accountant certifies a bound"
                )
            self.epsilon_per_row = (
                None
                if self.delta is None
                else epsilon_for(sigma=self.sigma, delta=self.delta, sensitivity=self.sensitivity)
            )
        else:
            if ledger is not None:
                raise InvalidParameter("noise=False releases clean hidden states: it refuses a ledger")
            warnings.warn(
                "HiddenStatePrivatizer(noise=False) clips but adds no noise: NOT PRIVATE (tests only)",
                NotPrivateWarning,
                stacklevel=2,
            )
            self.sigma = 0.0
            self.noise_multiplier = 0.0
            self.epsilon_per_row = None
        self.private = self.noise_enabled and seed is None
        self._source = self._make_source(noise, seed) if self.noise_enabled else None
        self.ledger = ledger
        from gaussdp.accounting import accountant as make_accountant

        make_accountant(accountant)  # the name, now: an approximation ("gdp") is refused
        self.accountant_name = accountant
        if budget is not None:
            if ledger is None:
                raise InvalidParameter("budget= needs a ledger= to open the session on")
            ledger.open(session_id, budget, accountant=accountant)
        self._accountants: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._session: contextvars.ContextVar[str] = contextvars.ContextVar(
            f"gaussdp_inference_session_{id(self)}", default=session_id
        )
        self._paused: contextvars.ContextVar[bool] = contextvars.ContextVar(
            f"gaussdp_inference_paused_{id(self)}", default=False
        )
        self.last_release: ReleaseStats | None = None
        self.model = model
        # Entered ``with`` blocks (any thread) and explicit attach(): the hook is registered while
        # either holds, and only then (constructing a privatizer must not privatize, nor charge).
        self._entered = 0
        self._explicit = False
        self._attach_lock = threading.Lock()
        if model is not None or isinstance(layer, nn.Module):
            self.layer_path, self.module = resolve_layer(model, layer)

    # ------------------------------------------------------------------ lifecycle

    @staticmethod
    def _make_source(noise: str | bool, seed: int | None) -> Any:
        from gaussdp.noise import noise_source

        if seed is not None:
            return noise_source(seed=seed)
        if noise is True:
            noise = "secure"
        if noise not in ("secure", "fast"):
            raise InvalidParameter(f"noise must be 'secure', 'fast' or False, got noise={noise!r}")
        return noise_source(noise)

    @property
    def attached(self) -> bool:
        """Whether the hook is registered now (inside ``with``, or after :meth:`attach`)."""
        return self._handle is not None

    def _register(self) -> None:
        if self.module is None:
            raise InvalidParameter(
                "this privatizer has no module to hook (model=None and no layer module): "
                "use privatize() directly, or pass a model or a module as layer="
            )
        if self._handle is None:
            self._handle = self.module.register_forward_hook(self._hook)

    def _unregister_if_unused(self) -> None:
        if self._handle is not None and not self._explicit and self._entered == 0:
            self._handle.remove()
            self._handle = None

    def attach(self) -> HiddenStatePrivatizer:
        """Register the hook until :meth:`detach`: every forward pass of the module is privatized
        and charged from now on (in every thread). Idempotent; returns ``self``.

        Raises:
            InvalidParameter: the privatizer was built without a module (``model=None``).
        """
        with self._attach_lock:
            self._register()
            self._explicit = True
        return self

    def detach(self) -> None:
        """Undo :meth:`attach`: the module runs clean again (unless a ``with`` block is still
        open on this privatizer, which keeps the hook until it exits). Idempotent."""
        with self._attach_lock:
            self._explicit = False
            self._unregister_if_unused()

    def remove(self) -> None:
        """Remove the hook now, whatever attached it; the model is back to its clean forward pass.

        Idempotent. Open ``with`` blocks stay counted: the hook is registered again on the next
        :meth:`attach` or ``with``.
        """
        with self._attach_lock:
            self._explicit = False
            if self._handle is not None:
                self._handle.remove()
                self._handle = None

    def __enter__(self) -> HiddenStatePrivatizer:
        """Register the hook for the block (nested and concurrent blocks share one hook)."""
        with self._attach_lock:
            self._register()
            self._entered += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._attach_lock:
            self._entered = max(0, self._entered - 1)
            self._unregister_if_unused()

    @contextlib.contextmanager
    def session(self, session_id: str) -> Iterator[HiddenStatePrivatizer]:
        """Charge ``session_id`` for everything released inside the block (thread- and task-local)."""
        if not isinstance(session_id, str) or not session_id:
            raise InvalidParameter(f"session_id must be a non-empty string, got session_id={session_id!r}")
        token = self._session.set(session_id)
        try:
            yield self
        finally:
            self._session.reset(token)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Let the hooked module's clean output through inside the block (client-side use only)."""
        token = self._paused.set(True)
        try:
            yield
        finally:
            self._paused.reset(token)

    @property
    def session_id(self) -> str:
        """The session charged in the current thread / task."""
        return self._session.get()

    # ------------------------------------------------------------------ the release

    def _hook(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        if self._paused.get():
            return None
        hidden, put_back = split_output(output)
        return put_back(self.privatize(hidden))

    def _rows(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.dim() == 1:
            return hidden.reshape(1, -1)
        if self.per == "token":
            return hidden.reshape(-1, hidden.shape[-1])
        return hidden.reshape(hidden.shape[0], -1)

    def privatize(self, hidden: torch.Tensor, *, session_id: str | None = None) -> torch.Tensor:
        """Clip, charge, noise and return ``hidden`` (same shape, dtype and device; no gradient).

        Rows are the last dimension (``per="token"``) or everything after dim 0 (``"sequence"``).
        Any floating-point dtype is taken: the rows are clipped and noised in the working precision
        (:func:`working_dtype`: float32 for bfloat16, float16 and float32 states, float64 for
        float64), then cast back to ``hidden.dtype``. The cast rounds the release itself, so it is
        post-processing and costs no privacy; the norm bound ``clip_norm`` holds for the
        working-precision values that are noised.

        Raises:
            TypeError: ``hidden`` is not a floating-point tensor.
            UnsafeInput: NaN/Inf or an empty tensor (nothing charged, nothing released).
            InvalidParameter: noised values could overflow ``hidden``'s dtype (float16 with a large
                ``sigma`` or ``clip_norm``; nothing charged, nothing released).
            BudgetExhausted: the session's ledger refused the charge (nothing released).
            FloatingPointError: the noised state overflowed ``hidden``'s dtype all the same (only
                possible with ``noise="fast"``, whose deviates are unbounded): nothing released,
                but the rows were charged (charges are made before the noise is drawn).
        """
        dtype = hidden.dtype if isinstance(hidden, torch.Tensor) else None  # else refused below
        released = self._privatize_rows(hidden, session_id, cast_to=dtype)
        out = released.reshape(hidden.shape).to(hidden.dtype)
        if out.dtype != released.dtype and not bool(torch.isfinite(out).all()):
            raise FloatingPointError(
                f"the noised hidden state overflows {hidden.dtype} (sigma={self.sigma:g}); nothing "
                f"released, but its {released.shape[0]} rows were charged"
            )
        return out

    def _privatize_rows(
        self, hidden: Any, session_id: str | None, *, cast_to: torch.dtype | None
    ) -> torch.Tensor:
        """The release as rows ``(n, d)`` in the working precision: clip, charge, noise.

        ``cast_to``: the dtype the caller will cast the release to (its range is checked before
        anything is charged), or ``None``. Split mode sends the rows as they are (rounding them to
        a half-precision model's dtype would only lose signal); :meth:`privatize` casts them back
        for the model.
        """
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"hidden must be a torch.Tensor, got {type(hidden).__name__}")
        if not hidden.is_floating_point():
            raise TypeError(f"hidden must be a floating-point tensor, got dtype {hidden.dtype}")
        if hidden.dim() == 0 or hidden.numel() == 0:
            raise UnsafeInput(f"hidden must have at least one row, got shape {tuple(hidden.shape)}")
        if cast_to is not None:
            self._check_range(cast_to)
        from gaussdp.clipping import clip_rows

        with torch.no_grad():
            # Exact: every bfloat16 and float16 value is a float32 value. The rows are clipped in
            # the working precision, so the norm bound holds for exactly what is noised.
            rows = self._rows(hidden.detach()).to(working_dtype(hidden.dtype))
            clipped, norms = clip_rows(rows, self.clip_norm)  # UnsafeInput on NaN/Inf
            self._charge(session_id or self._session.get(), rows.shape[0])
            if self.noise_enabled:
                released = self._release(clipped)
                noise = released - clipped  # one temporary in the working dtype; norms in float64
                noise_norms = torch.linalg.vector_norm(noise, dim=1, dtype=torch.float64).cpu().numpy()
            else:
                released = clipped
                noise_norms = np.zeros(rows.shape[0])
        clipped_norms = np.minimum(norms, self.clip_norm)
        mean_noise = float(noise_norms.mean())
        self.last_release = ReleaseStats(
            rows=int(rows.shape[0]),
            dim=int(rows.shape[1]),
            mean_norm=float(norms.mean()),
            fraction_clipped=float((norms > self.clip_norm).mean()),
            mean_clipped_norm=float(clipped_norms.mean()),
            mean_noise_norm=mean_noise,
            snr=float(clipped_norms.mean() / mean_noise) if mean_noise > 0 else float("inf"),
        )
        return released

    def _check_range(self, dtype: torch.dtype) -> None:
        """Refuse, before any charge, a release whose values could overflow the model's ``dtype``.

        Each released value is a clipped value (``|x| <= clip_norm``) plus noise on the float-safe
        grid, ``|noise| <= _ZMAX * sigma + g`` with ``g <= sigma * 2**-20`` (the polar method's
        deviates stay below ``_ZMAX``: :mod:`gaussdp.noise`). Below the dtype's largest value the
        cast back cannot overflow; float16 (largest 65504) is the dtype where this bites.
        """
        from gaussdp.noise import _ZMAX

        largest = float(torch.finfo(dtype).max)
        bound = self.clip_norm + (_ZMAX + 2.0**-20) * self.sigma
        if not bound < largest:
            raise InvalidParameter(
                f"sigma={self.sigma:g} with clip_norm={self.clip_norm:g}: noised values could reach "
                f"{bound:.4g}, past the largest {dtype} ({largest:.6g}); serve the model in float32 "
                "or bfloat16, or lower clip_norm and sigma together"
            )

    def _release(self, clipped: torch.Tensor) -> torch.Tensor:
        """Each clipped row plus N(0, sigma^2 I), floating-point safe unless ``noise="fast"``."""
        from gaussdp.noise import add_gaussian_rows

        if self._source is None:  # only called with noise on
            raise RuntimeError("internal: noise requested from a privatizer without a noise source")
        with self._lock:  # one noise source per privatizer; sources are not thread-safe
            # One norm-bounded release per row (the core's row path): the grid rounding keeps each
            # row's norm <= C, so the sensitivity (2C or C) has no discretisation cost.
            released = add_gaussian_rows(clipped, self.sigma, sensitivity=self.clip_norm, source=self._source)
        return released.to(device=clipped.device, dtype=clipped.dtype)

    def _event(self, count: int) -> Any:
        return row_event(self.noise_multiplier, count)

    def _charge(self, session_id: str, count: int) -> Any:
        """Charge ``count`` Gaussian releases to ``session_id``, atomically, before any release."""
        if not self.noise_enabled:
            return None
        event = self._event(count)
        if self.ledger is not None:
            return self.ledger.charge(session_id, event)
        from gaussdp.accounting import accountant

        with self._lock:
            acc = self._accountants.get(session_id)
            if acc is None:
                acc = self._accountants[session_id] = accountant(self.accountant_name)
            acc.compose(event)
        return None

    # ------------------------------------------------------------------ reporting

    def spent(self, *, delta: float | None = None, session_id: str | None = None) -> float:
        """Epsilon spent so far by a session (an upper bound), at ``delta`` (default: the ledger's).

        With a ledger this is the ledger's figure; without, the local accountant's at ``delta`` (or
        the privatizer's ``delta``). 0 when nothing was released.
        """
        session = session_id or self._session.get()
        if self.ledger is not None:
            spent = self.ledger.spent(session)
            return float(getattr(spent, "epsilon", spent))
        d = delta if delta is not None else self.delta
        if d is None:
            raise InvalidParameter("spent() needs delta= (no ledger, and the privatizer has no delta)")
        with self._lock:
            acc = self._accountants.get(session)
        return 0.0 if acc is None else float(acc.epsilon(check_delta(d)))

    def __repr__(self) -> str:
        sigma = getattr(self, "sigma", None)
        shown = "unset" if sigma is None or sigma != sigma else format_upper(sigma)  # rounded up
        return (
            f"HiddenStatePrivatizer(layer={self.layer_path!r}, clip_norm={format_exact(self.clip_norm)}, "
            f"sigma={shown}, per={self.per!r}, "
            f"neighbouring={self.neighbouring!r}, "
            f"attached={self.attached}, private={self.private})"
        )


def row_event(noise_multiplier: float, rows: int) -> Any:
    """One Gaussian release per row, as one event (charged atomically): what a privatizer charges
    for ``rows`` hidden states, and what the service charges for rows a client declares it noised."""
    from gaussdp.accounting import GaussianEvent, SelfComposedEvent

    event = GaussianEvent(noise_multiplier=noise_multiplier)
    return event if rows == 1 else SelfComposedEvent(event, rows)
