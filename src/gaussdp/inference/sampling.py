"""Choosing the next token from the logits of a privatized forward pass: greedy, or sampled with a
temperature, top-k and top-p (nucleus).

The privacy of a generated token is the privacy of the noised hidden state it is computed from.
Everything after the noise (the rest of the model, the logits, this sampler) is post-processing,
so sampling costs no budget, whatever its parameters and its randomness, as long as it reads
nothing private but the noised state (Dwork & Roth 2014, Proposition 2.1: post-processing of an
(epsilon, delta)-DP output is (epsilon, delta)-DP; the sampler's randomness is independent of the
data).

The sampler's random numbers come from OS entropy by default. ``seed=`` (by name only) makes the
sampling reproducible: the choice of token is then predictable from the logits, which is fine for
the guarantee (the noise in the hidden state is not seeded) but marks the sampler as not private
(:attr:`Sampler.private` is False), so that an answer can say so.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

import torch

from gaussdp.errors import InvalidParameter

__all__ = ["Sampler"]


class Sampler:
    """The next token of each row of logits: argmax when ``temperature`` is 0, else a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely tokens and to the
    smallest set whose probability reaches ``top_p``.

    Post-processing of the noised hidden state: no charge (Dwork & Roth 2014, Proposition 2.1).

    Args:
        temperature: 0 (greedy, the default) or a number in (0, 100].
        top_p: in (0, 1]; 1 keeps every token.
        top_k: >= 0; 0 keeps every token.
        seed: reproducible draws (the sampler is then marked not private); default OS entropy.

    Raises:
        InvalidParameter: a value out of range (named).

    >>> Sampler()(torch.tensor([[0.0, 3.0, 1.0]])).tolist()
    [1]
    >>> Sampler(temperature=1.0, top_k=1, seed=0)(torch.tensor([[0.0, 3.0, 1.0]])).tolist()
    [1]

    References:
        Dwork, C. and Roth, A. (2014). The Algorithmic Foundations of Differential Privacy,
        Proposition 2.1 (post-processing).
        Holtzman, A. et al. (2020). The Curious Case of Neural Text Degeneration (top-p sampling).
    """

    def __init__(
        self, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None
    ) -> None:
        for name, value in (("temperature", temperature), ("top_p", top_p)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise InvalidParameter(f"{name} must be a finite number, got {name}={value!r}")
        if not 0 <= temperature <= 100:
            raise InvalidParameter(f"temperature must be in [0, 100], got temperature={temperature!r}")
        if not 0 < top_p <= 1:
            raise InvalidParameter(f"top_p must be in (0, 1], got top_p={top_p!r}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise InvalidParameter(f"top_k must be an integer >= 0, got top_k={top_k!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InvalidParameter(f"seed must be an integer, got seed={seed!r}")
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.top_k = top_k
        self.private = seed is None
        self._seed = seed if seed is not None else secrets.randbits(63)
        self._generators: dict[Any, torch.Generator] = {}

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
            gen.manual_seed(self._seed % (1 << 63))
        return gen

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token of each row of ``logits`` ``(batch, vocab)``: a ``(batch,)`` long tensor."""
        if self.greedy:
            return logits.argmax(dim=-1)
        scores = logits.float() / self.temperature
        if 0 < self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p < 1:
            ordered, order = scores.sort(dim=-1, descending=True)
            probs = ordered.softmax(dim=-1)
            # drop a token when the tokens before it already reach top_p (the first always stays)
            drop = probs.cumsum(dim=-1) - probs >= self.top_p
            ordered = ordered.masked_fill(drop, float("-inf"))
            scores = torch.full_like(scores, float("-inf")).scatter(-1, order, ordered)
        probs = scores.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self._generator(probs.device)).squeeze(-1)
