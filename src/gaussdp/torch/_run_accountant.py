"""What one DP-SGD run has spent: ``engine.accountant``, with Opacus's ``get_epsilon(delta)``.

A thin face over a :mod:`gaussdp.accounting` accountant (every one it builds prints upper bounds):
it adds what a run needs beyond the events composed, namely the optimizer steps taken, the steps
taken without noise (after which nothing is private), and a ``state_dict`` that a checkpoint saves
so that a resumed run reports the whole spend.
"""

from __future__ import annotations

import math
from typing import Any

from gaussdp._validate import check_delta
from gaussdp.accounting.events import Event, event_from_dict

__all__ = ["RunAccountant"]

# Opacus's accountant names that gaussdp computes with another (tighter or equal) upper bound.
_BACKEND = {"prv": "pld"}


class RunAccountant:
    """The privacy spend of one run (``PrivacyEngine.accountant``).

    Args:
        name: ``"pld"`` (default), ``"rdp"``, ``"advanced"``, ``"basic"``, or Opacus's ``"prv"``,
            which is computed with the PLD accountant: the privacy loss distribution of the same
            events, discretised pessimistically (Doroshenko et al. 2022), so it is a proven upper
            bound as PRV's is (Gopi et al. 2021), and at least as tight at the same discretisation.
            ``repr`` and :attr:`backend` say which computes it. ``"gdp"`` is refused (an
            approximation, not a bound).
    """

    def __init__(self, name: str = "pld") -> None:
        from gaussdp.accounting import accountant as make_accountant

        if not isinstance(name, str):
            raise TypeError(f"accountant must be a string, got accountant={name!r}")
        self.requested = name
        self.backend = _BACKEND.get(name.lower(), name.lower())
        self._acc = make_accountant(self.backend)
        self.steps = 0  # optimizer steps charged
        self.unnoised_steps = 0  # steps with noise_multiplier=0: epsilon is inf from then on

    # ------------------------------------------------------------------------------ charging
    def compose(self, event: Event, count: int = 1) -> RunAccountant:
        self._acc.compose(event, count)
        return self

    def step(self, *, noised: bool) -> None:
        """Count one optimizer step (its events, if any, were composed before it released)."""
        self.steps += 1
        self.unnoised_steps += not noised

    # ------------------------------------------------------------------------------- answers
    def get_epsilon(self, delta: float) -> float:
        """epsilon spent so far at ``delta``: an upper bound (0 before any release; inf if a step
        was taken without noise). Opacus's name for :meth:`epsilon`."""
        delta = check_delta(delta)
        if self.unnoised_steps:
            return math.inf
        return float(self._acc.epsilon(delta))

    epsilon = get_epsilon

    def delta(self, epsilon: float) -> float:
        """delta spent so far at ``epsilon`` (an upper bound; 1 if a step was taken without noise)."""
        if self.unnoised_steps:
            return 1.0
        return float(self._acc.delta(epsilon))

    @property
    def history(self) -> tuple[tuple[Event, int], ...]:
        """The events composed, in order, consecutive repeats merged into ``(event, count)``."""
        return self._acc.history

    def mechanism(self) -> str:
        """The accountant that computes the answers (Opacus's ``accountant.mechanism()``)."""
        return self.backend

    def __len__(self) -> int:
        return self.steps

    def __repr__(self) -> str:
        via = f", computed with {self.backend!r}" if self.backend != self.requested else ""
        return f"RunAccountant({self.requested!r}{via}, steps={self.steps}, events={self._acc.steps})"

    # ---------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain values only (loads with ``torch.load(weights_only=True)``)."""
        return {
            "accountant": self.requested,
            "steps": self.steps,
            "unnoised_steps": self.unnoised_steps,
            "events": [[e.to_dict(), c] for e, c in self._acc.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Add a saved run's spend to this accountant, which must not have been charged yet.

        Every event is parsed before any is composed: a bad state leaves this one unchanged.
        """
        from gaussdp.accounting import accountant as make_accountant

        if self.steps or self._acc.steps:
            raise ValueError("this accountant was charged already; load the checkpoint before the first step")
        events = [(event_from_dict(e), int(c)) for e, c in state["events"]]
        acc = make_accountant(self.backend)
        for e, c in events:
            acc.compose(e, c)
        self._acc = acc
        self.steps = int(state["steps"])
        self.unnoised_steps = int(state["unnoised_steps"])
