"""One request's private generation, stepped token by token: the part that touches the model and
the ledger (the routes and the WebSocket protocol are in :mod:`gaussdp.service.streaming`).

Each step is one forward pass of the served model with a :class:`gaussdp.inference.HiddenStatePrivatizer`
hooked on one transformer block (clip, charge, noise in the hook), under the model's lock (a turn of
:class:`gaussdp.service.fairness.FairLock`: tenants take turns), with the
charge made through :class:`ChargePerToken` so that it carries the token's idempotency key
``"<stream_id>/<index>"``. A step whose forward pass did not charge anything is refused before its
token can leave. A step whose forward pass fails is never retried: it raises
:class:`GenerationFailed`, which says whether the token's charge was recorded before the failure.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gaussdp._worklimit import cpu_limit, no_cpu_limit
from gaussdp.budget import IdempotencyKeyUsed, Ledger, StoreUnavailable
from gaussdp.errors import InvalidParameter, PrivacyError, WorkLimitExceeded
from gaussdp.service.errors import Refusal, code_of, detail_of
from gaussdp.service.fairness import FairLock, TenantSlots
from gaussdp.service.models import MAX_PROMPT_TOKENS, GeneratedToken, GenerateIn, Privacy

if TYPE_CHECKING:
    from gaussdp.service.auth import Caller
    from gaussdp.service.deps import Service

__all__ = ["STEP_REFUSALS", "ChargePerToken", "Collected", "Generation", "GenerationFailed", "Generations"]

logger = logging.getLogger("gaussdp.service")

# Raised by the ledger's charge when it records nothing (BudgetExhausted, LedgerContention and
# TenantLimitExceeded are PrivacyErrors), or before it (the privatizer refuses NaN/Inf states and
# ranges it cannot release into before it charges): passed on as they are when no charge was
# recorded in the step.
_UNCHARGED = (PrivacyError, IdempotencyKeyUsed, StoreUnavailable, WorkLimitExceeded)
# What a step may be refused with, nothing charged for that token (LedgerContention and
# BudgetExhausted are PrivacyErrors).
STEP_REFUSALS = (*_UNCHARGED, Refusal)


class GenerationFailed(RuntimeError):
    """A token's forward pass failed: nothing computed from it was released, and it is not retried.

    Attributes:
        index: the token's index in the stream.
        key: the idempotency key of its charge, ``"<stream_id>/<index>"``.
        receipt: the ledger's receipt when the token's charge was recorded before the failure (the
            charge stands: charges are never refunded, over-counting is the safe side), else None.
    """

    def __init__(self, index: int, key: str, receipt: Any, cause: BaseException) -> None:
        self.index, self.key, self.receipt = index, key, receipt
        if receipt is not None:
            what = f"its charge (charge_id {receipt.charge_id}, key {key!r}) was recorded and stands"
        else:
            what = "nothing was charged for it"
        # the cause's class only: its text stays in the server's log
        super().__init__(
            f"token {index}'s forward pass failed ({type(cause).__name__}, logged on the server): "
            f"nothing from it was released; {what}"
        )

    @property
    def charged(self) -> bool:
        """Whether the failed token was charged (and not delivered)."""
        return self.receipt is not None


class ChargePerToken:
    """The ledger as the privatizer's hook sees it: each charge carries the current token's key."""

    def __init__(
        self, ledger: Ledger, key_id: str, on_charged: Callable[[Any], None], cpu_limit_s: float
    ) -> None:
        self._ledger = ledger
        self._key_id = key_id
        self._on_charged = on_charged
        self._cpu_limit_s = cpu_limit_s
        self.key: str | None = None
        self.receipt: Any = None

    def charge(self, principal: str, event: Any) -> Any:
        # The service's per-request CPU limit bounds the ledger's numeric work of each charge (the
        # forward pass around it is bounded by the caps on tokens, not by this limit).
        with cpu_limit(self._cpu_limit_s):
            # fresh: a key charged (and answered) by an earlier request releases nothing new
            receipt = self._ledger.charge(principal, event, self.key, key_id=self._key_id, fresh=True)
        self.receipt = receipt
        with no_cpu_limit():
            self._on_charged(receipt)
        return receipt

    def spent(self, principal: str) -> Any:
        return self._ledger.spent(principal)


class Generation:
    """One request's generation: a privatizer on the model's layer, stepped one token at a time."""

    def __init__(
        self,
        body: GenerateIn,
        *,
        model: Any,
        tokenizer: Any,
        lock: AbstractContextManager[Any],
        principal: str,
        charges: ChargePerToken,
        noise: str,
    ) -> None:
        from gaussdp._neighbouring import hidden_state_sensitivity
        from gaussdp.inference import HiddenStatePrivatizer, Sampler, stream_generate

        self.stream_id = body.idempotency_key or secrets.token_urlsafe(12)
        self.tokenizer = tokenizer
        self._lock = lock
        self._charges = charges
        ids = _prompt_ids(body, model, tokenizer)
        self.prompt_tokens = int(ids.shape[1])
        sensitivity = hidden_state_sensitivity(body.clip_norm, body.neighbouring)
        sigma = body.sigma if body.noise_multiplier is None else body.noise_multiplier * sensitivity
        try:
            self.privatizer = HiddenStatePrivatizer(
                model,
                body.layer,
                clip_norm=body.clip_norm,
                sigma=sigma,
                epsilon=body.epsilon,
                delta=body.delta,
                ledger=charges,
                session_id=principal,
                neighbouring=body.neighbouring,
                noise=noise,
            )
        except (LookupError, TypeError, IndexError) as exc:
            raise InvalidParameter(f"layer: {exc}") from None
        _check_block(model, self.privatizer.module, body.layer)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = eos if body.stop_at_eos else None
        # sampling is post-processing of the noised state: it adds no charge (Dwork & Roth, Prop. 2.1)
        self.sampler = Sampler(
            temperature=body.temperature or 0.0,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
        )
        self._tokens = stream_generate(
            model,
            ids,
            privatizer=self.privatizer,
            max_new_tokens=body.max_new_tokens,
            session_id=principal,
            sample=None if self.sampler.greedy else self.sampler,
        )

    def step(self, index: int) -> GeneratedToken:
        """Compute, charge (key ``stream_id/index``) and return token ``index``; runs in a worker thread.

        Raises:
            BudgetExhausted, IdempotencyKeyUsed, LedgerContention, StoreUnavailable,
            WorkLimitExceeded, PrivacyError: refused before a charge was recorded (nothing charged).
            GenerationFailed: any other failure, or any failure after the charge was recorded; the
                generation cannot continue.
        """
        key = self._charges.key = f"{self.stream_id}/{index}"
        self._charges.receipt = None
        try:
            with self._lock:
                token = next(self._tokens)
        except Exception as exc:
            if self._charges.receipt is None and isinstance(exc, _UNCHARGED):
                raise
            logger.error("generation %s: token %d failed", self.stream_id, index, exc_info=True)
            raise GenerationFailed(index, key, self._charges.receipt, exc) from exc
        receipt = self._charges.receipt
        if receipt is None:  # the hook did not run: the token would leave unprivatized
            raise RuntimeError("no charge was recorded for this token: refusing to send it")
        token_id = int(token.reshape(-1)[0])
        return GeneratedToken(
            index=index, token_id=token_id, text=self.decode([token_id]), charge_id=receipt.charge_id
        )

    @property
    def last_receipt(self) -> Any:
        """The receipt of the last token's charge (``None`` before the first)."""
        return self._charges.receipt

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else str(self.tokenizer.decode(ids))

    def describe(self) -> dict[str, Any]:
        p = self.privatizer
        return {
            "layer": str(p.layer_path),
            "sigma": float(p.sigma),
            "clip_norm": float(p.clip_norm),
            "neighbouring": p.neighbouring,
            "sensitivity": float(p.sensitivity),
            "noise_multiplier": float(p.noise_multiplier),
            "sampler_private": self.sampler.private,
        }


def revoked() -> Refusal:
    """The refusal of a generation whose API key was revoked (or expired) while it ran."""
    return Refusal(
        "unauthorized", "the API key was revoked or expired during the generation; nothing more was charged"
    )


@dataclass
class Collected:
    """The tokens of a generation run to its end (:meth:`Generations.collect`)."""

    tokens: list[GeneratedToken] = field(default_factory=list)
    finish: str = "length"  # "length", "eos", "budget_exhausted" or "error"
    error: str | None = None
    detail: str | None = None


class Generations:
    """The generations of one app, whatever route asks for them (gaussdp's ``generate`` routes and
    the OpenAI-compatible ones): the tenants' generation slots, a fair lock per model, and how one
    request's :class:`Generation` is made and stepped (each token charged before it is returned).

    Built once per app by :attr:`gaussdp.service.deps.Service.generations`.
    """

    def __init__(self, svc: Service, max_streams: int, max_streams_per_tenant: int) -> None:
        self.svc = svc
        self.slots = TenantSlots(max_streams, max_streams_per_tenant)
        self._locks: dict[str, FairLock] = {}
        self._guard = threading.Lock()

    def start(self, app: Any, body: GenerateIn, principal: str, who: Caller) -> Generation:
        """A generation of ``body`` charged to ``principal`` by ``who`` (nothing computed yet).

        Raises:
            InvalidParameter: no such model, a bad layer or prompt.
        """
        svc = self.svc
        model = (getattr(app.state, "models", None) or {}).get(body.model)
        if model is None:
            raise InvalidParameter(f"model: no model named {body.model!r} on this server")
        tokenizer = (getattr(app.state, "tokenizers", None) or {}).get(body.model)
        with self._guard:
            lock = self._locks.setdefault(body.model, FairLock())
        charges = ChargePerToken(svc.ledger, who.key_id, lambda r: svc.charged(who, r), svc.cpu_limit_s)
        return Generation(
            body,
            model=model,
            tokenizer=tokenizer,
            lock=lock.turn(who.tenant),
            principal=principal,
            charges=charges,
            noise=svc.noise,
        )

    def step(self, gen: Generation, who: Caller, index: int) -> GeneratedToken:
        """Token ``index`` of ``gen``, charged; unless ``who``'s key was revoked (checked before the
        pass that charges). Runs in a worker thread. Raises what :meth:`Generation.step` raises."""
        if not self.svc.gate.alive(who):
            raise revoked()
        return gen.step(index)

    def collect(self, gen: Generation, who: Caller, max_new_tokens: int) -> Collected:
        """Every token of ``gen`` up to ``max_new_tokens`` (or the end of sequence), each charged.

        A refusal (or failed pass) at the first token is raised: nothing was released. A later one
        ends the generation: the tokens so far were charged and are returned, with the refusal's
        code (``finish`` ``"budget_exhausted"`` or ``"error"``).
        """
        out = Collected()
        for i in range(max_new_tokens):
            try:
                tok = self.step(gen, who, i)
            except (*STEP_REFUSALS, GenerationFailed) as exc:
                if not out.tokens:
                    raise
                out.error, out.detail = code_of(exc), detail_of(exc)
                out.finish = "budget_exhausted" if out.error == "budget_exhausted" else "error"
                return out
            out.tokens.append(tok)
            if gen.eos is not None and tok.token_id == gen.eos:
                out.finish = "eos"
                return out
        return out

    def figures(self, principal: str, receipt: Any = None) -> dict[str, Privacy]:
        """What ``principal`` has spent (as of ``receipt``) and what remains of its budget."""
        ledger = self.svc.ledger
        spent = ledger.spent(principal, as_of=receipt)
        remaining = ledger.budget(principal).remaining(spent)
        return {"spent": Privacy.of(spent), "remaining": Privacy.of(remaining)}


def _check_block(model: Any, module: Any, layer: Any) -> None:
    """Refuse a layer that is not a whole transformer block.

    The guarantee covers what the rest of the model computes from the hooked module's output
    alone. A block's output is the whole residual stream; a module inside a block (an attention
    projection, a norm) has the residual path around it, so noising it alone would release the
    clean state through that path.
    """
    from gaussdp.inference import find_last_block

    path, _ = find_last_block(model)
    blocks = model.get_submodule(path.rsplit(".", 1)[0])
    if not any(module is b for b in blocks):
        raise InvalidParameter(
            f"layer must be a transformer block (an index into {path.rsplit('.', 1)[0]}, or its path), "
            f"got layer={layer!r}: a module inside a block has the residual stream around it"
        )


def _prompt_ids(body: GenerateIn, model: Any, tokenizer: Any) -> Any:
    import torch

    if body.prompt_ids is not None:
        ids = list(body.prompt_ids)
    elif tokenizer is None:
        raise InvalidParameter(
            f"prompt: model {body.model!r} has no tokenizer on this server; send prompt_ids"
        )
    else:
        ids = list(tokenizer(body.prompt, add_special_tokens=False)["input_ids"])
    if not ids:
        raise InvalidParameter("prompt: it has no tokens")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise InvalidParameter(f"prompt: {len(ids)} tokens, the limit is {MAX_PROMPT_TOKENS}")
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is not None and max(ids) >= vocab:
        raise InvalidParameter(f"prompt_ids: ids must be < {vocab} (the model's vocabulary)")
    context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if context is not None and len(ids) + body.max_new_tokens > context:
        raise InvalidParameter(
            f"max_new_tokens: prompt ({len(ids)} tokens) + max_new_tokens ({body.max_new_tokens}) exceeds "
            f"the model's context of {context}"
        )
    return torch.tensor([ids], dtype=torch.long)
