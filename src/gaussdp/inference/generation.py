"""Streaming generation through a privatized model: every forward pass is charged before it returns.

With a key/value cache (Hugging Face models), the first pass releases one row per prompt token and
each later pass one row per sequence (the new token), so a session is charged per request and then
per generated token; without a cache every pass re-releases the whole sequence and is charged for
all of it. Whether the model takes a cache is read from its ``forward`` signature before the first
pass (:func:`takes_cache`), never guessed from an exception: an error inside a forward pass (the
privatizer's included) leaves the generator as it is, and is never retried as another code path
(a retry would charge the same token a second time). When the budget runs out mid-stream,
:class:`~gaussdp.errors.BudgetExhausted` leaves the generator; the tokens already yielded were
charged, nothing else was released.

The privatizer needs not be attached: :func:`stream_generate` activates its hook around each
forward pass (``with privatizer:``) and never across a ``yield``, so the caller's own forward passes
between two tokens stay clean (and uncharged) unless the caller attached the privatizer itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from gaussdp.errors import InvalidParameter
from gaussdp.inference.privatizer import HiddenStatePrivatizer

__all__ = ["stream_generate", "takes_cache"]


def _fresh_cache(model: nn.Module) -> Any:
    """An empty ``DynamicCache`` for a transformers model (the base model under a PEFT wrapper), or
    ``None`` for any other model (its forward builds its own cache on the first pass)."""
    try:
        from transformers import DynamicCache, PreTrainedModel
    except ImportError:
        return None
    base = getattr(model, "get_base_model", None)
    target = base() if callable(base) else model
    if not isinstance(target, PreTrainedModel):
        return None
    try:
        return DynamicCache(config=target.config)  # per-layer kinds (sliding windows) from the config
    except TypeError:  # transformers before 4.56: no config argument
        return DynamicCache()


def takes_cache(model: nn.Module) -> str | None:
    """The name under which ``model``'s forward takes a key/value cache, or ``None`` if it takes none.

    Read from the signature of ``model.forward`` (of the base model under a PEFT wrapper, which
    passes its keyword arguments through): a model takes a cache when its forward names a
    ``use_cache`` parameter and a cache parameter, ``cache`` (current transformers) or
    ``past_key_values`` (older releases, and the name current ones deprecate).
    """
    base = getattr(model, "get_base_model", None)
    target = base() if callable(base) else model
    try:
        params = inspect.signature(target.forward).parameters
    except (TypeError, ValueError):  # a forward with no introspectable signature: no cache
        return None
    if "use_cache" not in params:
        return None
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def stream_generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    privatizer: HiddenStatePrivatizer,
    max_new_tokens: int,
    session_id: str | None = None,
    use_cache: bool = True,
    sample: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[torch.Tensor]:
    """Decoding (greedy by default) that yields each new token id tensor ``(batch,)`` as soon as it
    is computed.

    Args:
        model: the model ``privatizer`` is hooked into; called as ``model(ids)``, or, when it takes a
            key/value cache (:func:`takes_cache`), with ``use_cache=True`` and the cache the model
            returned on the previous pass (a transformers ``Cache`` such as ``DynamicCache``, built
            by the model on the first pass) under the name its forward takes.
        input_ids: ``(batch, T)`` prompt token ids.
        privatizer: a :class:`HiddenStatePrivatizer` hooked on a module of ``model`` (attached or
            not: it is active during every forward pass of the generation).
        max_new_tokens: number of tokens to generate, >= 1.
        session_id: the session charged (default: the privatizer's current session).
        use_cache: use the model's key/value cache when it takes one. A model that takes one but
            returns none is run without it from then on (each pass re-releases, and is charged
            for, the whole sequence).
        sample: picks the next token of each row of the last position's logits ``(batch, vocab)``
            (a :class:`gaussdp.inference.sampling.Sampler`); default argmax. Post-processing of the
            noised state: it adds no charge (Dwork & Roth 2014, Proposition 2.1).

    Raises:
        BudgetExhausted: the session's budget refused a step (propagates from the hook).
        InvalidParameter: ``privatizer`` is not a privatizer of a module of ``model`` (the
            generation would run clean).
        Exception: whatever a forward pass raised, unchanged and not retried; the rows of that
            pass may have been charged (the hook charges before it noises).
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
    # the prompt goes where the model's weights are (gaussdp serve --device)
    device = next((p.device for p in model.parameters()), None)
    ids = torch.as_tensor(input_ids, dtype=torch.long, device=device)
    if ids.dim() == 1:
        ids = ids[None, :]
    session = session_id or privatizer.session_id
    cache_name = takes_cache(model) if use_cache else None
    # a transformers model starts from an empty Cache object of its own (never a legacy tuple, whose
    # use transformers deprecates with a warning on every stream); other models build their own
    cache: Any = _fresh_cache(model) if cache_name is not None else None
    step_input = ids
    for _ in range(max_new_tokens):
        # The session is set around each pass only, never across a yield (the consumer's context
        # may differ between two resumptions of this generator).
        with privatizer, privatizer.session(session), torch.no_grad():
            if cache_name is None:
                out = model(step_input)
            else:
                out = model(step_input, use_cache=True, **{cache_name: cache})
        logits = out if isinstance(out, torch.Tensor) else out.logits if hasattr(out, "logits") else out[0]
        last = logits[:, -1, :]
        next_token = last.argmax(dim=-1) if sample is None else sample(last)
        yield next_token
        ids = torch.cat([ids, next_token[:, None]], dim=1)
        if cache_name is not None:
            # read under the name it was passed as (the other name is a deprecated alias that warns)
            cache = None if isinstance(out, torch.Tensor) else getattr(out, cache_name, None)
            if cache is None:
                cache_name = None
        step_input = next_token[:, None] if cache_name is not None else ids
