"""Split inference: the client privatizes a hidden state, the server adds a LoRA delta.

The client runs the model up to ``layer``, privatizes the hidden state of the positions it sends
(:func:`client_forward`: clip, charge, noise), and sends the noised vectors. The server, which holds
a LoRA adapter ``(A, B, scaling)``, returns ``scaling * B @ (A @ h_noised)`` (:func:`server_lora_delta`;
the computation itself goes through a :class:`LoRABackend`). The server's answer is post-processing
of the noised vectors, so it costs no more privacy. The client adds the delta to its clean hidden
state and finishes the forward pass (:func:`client_finish`).

Because the server only sees clipped vectors (norm <= C), ``B A clip(h)`` is ``min(1, C/||h||)``
times the adapter's delta on the real state. The client knows ``||h||`` and may undo that scale
locally (``rescale=True``, the default); that is post-processing on the client and changes no privacy
figure, but it scales the noise in the delta by the same factor: the signal-to-noise ratio is fixed
by ``C / (sigma sqrt(d))`` before the server sees anything (see :mod:`gaussdp.inference.diagnostics`).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from gaussdp._validate import real_number
from gaussdp.errors import UnsafeInput
from gaussdp.inference._layers import resolve_layer, split_output
from gaussdp.inference.backends import LoRABackend, PlainLoRABackend
from gaussdp.inference.privatizer import HiddenStatePrivatizer

__all__ = [
    "LoRABackend",
    "PlainLoRABackend",
    "client_finish",
    "client_forward",
    "server_lora_delta",
]

Positions = Literal["last", "all"]


class _StopForward(Exception):
    """Raised by the capture hook so the client does not run the layers it does not need."""


def _model_call(model: nn.Module, input_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> Any:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    return model(input_ids, **model_kwargs)


def _select(hidden: torch.Tensor, positions: Positions) -> torch.Tensor:
    if positions == "all":
        return hidden
    if positions == "last":
        if hidden.dim() < 2:
            raise UnsafeInput(f"positions='last' needs a (batch, seq, dim) state, got {tuple(hidden.shape)}")
        return hidden[..., -1, :] if hidden.dim() >= 3 else hidden[-1:, :]
    raise ValueError(f"positions must be 'last' or 'all', got positions={positions!r}")


def client_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    layer: str | int | nn.Module | None,
    privatizer: HiddenStatePrivatizer,
    *,
    positions: Positions = "last",
    session_id: str | None = None,
    **model_kwargs: Any,
) -> torch.Tensor:
    """Client half: run ``model`` up to ``layer``, privatize the chosen positions, return them.

    The forward pass stops right after ``layer`` (later layers are not run). If ``privatizer`` is
    also hooked into the model it is paused during this pass, so only what is returned is charged:
    one row per position sent (``positions="last"``: one per sequence, as in the private inference server;
    ``"all"``: every token). The neighbouring relation is the privatizer's (default replace-one,
    sensitivity ``2 * clip_norm``, the default of ``/lora-delta`` too): send ``privatizer.sigma``,
    ``privatizer.clip_norm`` and ``privatizer.neighbouring`` with the rows and the server charges the
    session exactly the privatizer's per-row epsilon.

    Returns:
        The noised hidden state: ``(batch, dim)`` for ``positions="last"`` on a batched state,
        otherwise the selected slice's shape. This is the only thing that leaves the client. Its
        dtype is the privatizer's working precision (float32 for a bfloat16, float16 or float32
        model, float64 for float64): the release itself, not its rounding to a half-precision
        model's dtype, which would only lose signal.

    Raises:
        BudgetExhausted: the session's budget refused the charge; nothing to send.
    """
    if not isinstance(privatizer, HiddenStatePrivatizer):
        raise TypeError(f"privatizer must be a HiddenStatePrivatizer, got {type(privatizer).__name__}")
    if layer is None and privatizer.module is not None:
        module = privatizer.module
    else:
        _, module = resolve_layer(model, layer)
    captured: list[torch.Tensor] = []

    def capture(mod: nn.Module, inputs: Any, output: Any) -> Any:
        hidden, _ = split_output(output)
        captured.append(hidden)
        raise _StopForward

    handle = module.register_forward_hook(capture)
    try:
        with privatizer.paused(), torch.no_grad():
            _model_call(model, input_ids, model_kwargs)
    except _StopForward:
        pass
    finally:
        handle.remove()
    if not captured:
        raise LookupError("the chosen layer did not run during the forward pass")
    selected = _select(captured[0], positions)
    return privatizer._privatize_rows(selected, session_id, cast_to=None).reshape(selected.shape)


def client_finish(
    model: nn.Module,
    input_ids: torch.Tensor,
    layer: str | int | nn.Module | None,
    delta: torch.Tensor | np.ndarray,
    *,
    positions: Positions = "last",
    clip_norm: float | None = None,
    rescale: bool = True,
    per: Literal["token", "sequence"] = "token",
    **model_kwargs: Any,
) -> Any:
    """Client, after the server answered: add ``delta`` to the clean state at ``layer``, finish.

    Args:
        delta: the server's answer for the positions sent by :func:`client_forward`.
        clip_norm: the privatizer's clip norm; needed when ``rescale`` is True.
        rescale: multiply each delta row by ``max(1, ||h||/C)`` (the clip's scale, known only to the
            client), so that the delta is the adapter's delta on the real state plus scaled noise.
        per: the privatizer's unit (``"sequence"`` with ``positions="all"``: one scale per sequence).

    Returns:
        The model's output (e.g. a Hugging Face ``CausalLMOutput`` with ``logits``).
    """
    _, module = resolve_layer(model, layer)
    delta_t = torch.as_tensor(np.asarray(delta) if isinstance(delta, np.ndarray) else delta)
    if rescale and clip_norm is None:
        raise ValueError("rescale=True needs clip_norm= (the privatizer's clip norm)")
    c = None if clip_norm is None else real_number("clip_norm", clip_norm)

    def add_delta(mod: nn.Module, inputs: Any, output: Any) -> Any:
        hidden, put_back = split_output(output)
        sel = _select(hidden, positions)
        d = delta_t.to(device=hidden.device, dtype=hidden.dtype).reshape(sel.shape)
        if rescale and c is not None:
            if per == "sequence" and positions == "all" and sel.dim() >= 3:
                norms = torch.linalg.vector_norm(sel.reshape(sel.shape[0], -1), dim=-1, dtype=torch.float64)
                shape = (sel.shape[0],) + (1,) * (sel.dim() - 1)
            else:
                norms = torch.linalg.vector_norm(sel, dim=-1, dtype=torch.float64)
                shape = (*sel.shape[:-1], 1)
            scale = torch.clamp(norms / c, min=1.0).to(hidden.dtype).reshape(shape)
            d = d * scale
        out = hidden.clone()
        if positions == "all":
            out = out + d
        elif hidden.dim() >= 3:
            out[..., -1, :] = out[..., -1, :] + d
        else:
            out[-1:, :] = out[-1:, :] + d
        return put_back(out)

    handle = module.register_forward_hook(add_delta)
    try:
        with torch.no_grad():
            return _model_call(model, input_ids, model_kwargs)
    finally:
        handle.remove()


def _as_matrix(name: str, x: Any) -> np.ndarray:
    arr = (
        x.detach().cpu().double().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)
    )
    if arr.ndim != 2:
        raise UnsafeInput(f"{name} must be a 2-D matrix, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise UnsafeInput(f"{name} contains NaN or Inf")
    return arr


def server_lora_delta(
    h_noised: torch.Tensor | np.ndarray,
    A: torch.Tensor | np.ndarray,
    B: torch.Tensor | np.ndarray,
    scaling: float = 1.0,
    *,
    backend: LoRABackend | None = None,
) -> torch.Tensor | np.ndarray:
    """Server half: ``scaling * B @ (A @ h)`` for each noised row ``h`` (PEFT shapes: A (r, d), B (d_out, r)).

    Accepts one vector ``(d,)`` or rows ``(..., d)``; returns the same type (tensor or array) and
    leading shape, with last dimension ``d_out``. Computed in float64 by ``backend`` (plain numpy by
    default; see :class:`LoRABackend`).

    Raises:
        UnsafeInput: shapes do not match, or NaN/Inf anywhere.
    """
    s = real_number("scaling", scaling)
    if isinstance(h_noised, torch.Tensor):
        h = h_noised.detach().cpu().double().numpy()
    else:
        h = np.asarray(h_noised, dtype=np.float64)
    if h.ndim == 0 or h.size == 0:
        raise UnsafeInput(f"h_noised must have at least one row, got shape {h.shape}")
    a = _as_matrix("A", A)
    b = _as_matrix("B", B)
    if a.shape[1] != h.shape[-1]:
        raise UnsafeInput(f"A has shape {a.shape}: it needs {h.shape[-1]} columns (the hidden size)")
    if b.shape[1] != a.shape[0]:
        raise UnsafeInput(f"B has shape {b.shape}: it needs {a.shape[0]} columns (the LoRA rank)")
    if not np.isfinite(h).all():
        raise UnsafeInput("h_noised contains NaN or Inf")
    rows = h.reshape(-1, h.shape[-1])
    out = (backend or PlainLoRABackend()).delta(rows, a, b, s)
    out = np.asarray(out, dtype=np.float64).reshape(*h.shape[:-1], b.shape[0])
    if isinstance(h_noised, torch.Tensor):
        return torch.as_tensor(out, dtype=h_noised.dtype, device=h_noised.device)
    return out
