"""Streaming generation through a privatized model: every forward pass is charged before it returns.

With a key/value cache (Hugging Face models), the first pass releases one row per prompt token and
each later pass one row per sequence (the new token), so a session is charged per request and then
per generated token; without a cache every pass re-releases the whole sequence and is charged for
all of it. When the budget runs out mid-stream, :class:`~gaussdp.errors.BudgetExhausted` leaves the
generator; the tokens already yielded were charged, nothing else was released.

The privatizer needs not be attached: :func:`stream_generate` activates its hook around each
forward pass (``with privatizer:``) and never across a ``yield``, so the caller's own forward passes
between two tokens stay clean (and uncharged) unless the caller attached the privatizer itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gaussdp.errors import InvalidParameter
from gaussdp.inference.privatizer import HiddenStatePrivatizer

__all__ = ["stream_generate"]


def stream_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    privatizer: HiddenStatePrivatizer,
    max_new_tokens: int,
    session_id: str | None = None,
    use_cache: bool = True,
) -> Iterator[torch.Tensor]:
    """Greedy decoding that yields each new token id tensor ``(batch,)`` as soon as it is computed.

    Args:
        model: the model ``privatizer`` is hooked into; called as ``model(ids)`` (or with
            ``past_key_values`` and ``use_cache=True`` for Hugging Face models).
        input_ids: ``(batch, T)`` prompt token ids.
        privatizer: a :class:`HiddenStatePrivatizer` hooked on a module of ``model`` (attached or
            not: it is active during every forward pass of the generation).
        max_new_tokens: number of tokens to generate, >= 1.
        session_id: the session charged (default: the privatizer's current session).
        use_cache: use the model's key/value cache when it returns one.

    Raises:
        BudgetExhausted: the session's budget refused a step (propagates from the hook).
        InvalidParameter: ``privatizer`` is not a privatizer of a module of ``model`` (the
            generation would run clean).
    """
    if not isinstance(privatizer, HiddenStatePrivatizer):
        raise InvalidParameter(f"privatizer must be a HiddenStatePrivatizer, got {type(privatizer).__name__}")
    if privatizer.module is None or not any(m is privatizer.module for m in model.modules()):
        raise InvalidParameter(
            "stream_generate needs a HiddenStatePrivatizer hooked on a module of this model "
            f"(its layer is {privatizer.layer_path!r}): otherwise the generation would run clean"
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidParameter(
            f"max_new_tokens must be an integer >= 1, got max_new_tokens={max_new_tokens!r}"
        )
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None, :]
    session = session_id or privatizer.session_id
    past: Any = None
    step_input = ids
    for _ in range(max_new_tokens):
        # The session is set around each pass only, never across a yield (the consumer's context
        # may differ between two resumptions of this generator).
        with privatizer, privatizer.session(session), torch.no_grad():
            if use_cache and past is not None:
                out = model(step_input, past_key_values=past, use_cache=True)
            elif use_cache:
                try:
                    out = model(step_input, use_cache=True)
                except TypeError:  # a plain nn.Module without a cache
                    use_cache = False
                    out = model(step_input)
            else:
                out = model(step_input)
        logits = out if isinstance(out, torch.Tensor) else out.logits if hasattr(out, "logits") else out[0]
        next_token = logits[:, -1, :].argmax(dim=-1)
        yield next_token
        ids = torch.cat([ids, next_token[:, None]], dim=1)
        past = getattr(out, "past_key_values", None) if use_cache else None
        if use_cache and past is None:
            use_cache = False
        step_input = next_token[:, None] if use_cache else ids
