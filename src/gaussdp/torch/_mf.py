"""Banded matrix-factorisation noise in the PyTorch engine: the cyclic loader and the per-step charge.

``make_private(..., noise_mechanism="banded-mf", bands=b, epochs=k)`` trains on fixed batches in a
fixed order, the same every epoch (:class:`CyclicLoader`): each record is in one batch, at the same
position of every epoch, so it takes part in at most ``k`` steps, ``steps_per_epoch`` apart. The
strategy is :class:`gaussdp.mf.BandedMFPlan` for those steps; each step's noise is
``(C^{-1} z)_t`` (:class:`gaussdp.mf.BandedNoise`, a buffer of ``b - 1`` noise tensors per trainable
parameter) and :class:`MFCharge` charges the accountant before each epoch's first release.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from gaussdp.accounting import GaussianEvent
from gaussdp.accounting.events import NOISE_MULTIPLIER_MAX
from gaussdp.errors import InvalidParameter
from gaussdp.mf import BandedMFPlan
from gaussdp.torch.data import DrawnBatches

__all__ = ["CyclicLoader", "MFCharge"]


class CyclicLoader:
    """Fixed batches in a fixed order, every epoch the same: the participation banded MF assumes.

    The order is the user's sampler's, taken once when the run is made private (a shuffled loader's
    first permutation; it depends on no record). Each ``for batch in loader`` hands out the rest of
    the current epoch; an iteration left early resumes where it stopped, so positions never repeat
    within an epoch. Every batch handed out is recorded in :attr:`drawn` as ``(position, size)``,
    ``position`` counting batches from the start of the run: the step that uses it must be step
    ``position``, and no batch may be handed out before the previous one is used (checked by
    :class:`MFCharge`): a batch skipped would bring a record's later steps closer than an epoch.
    """

    def __init__(self, loader: DataLoader) -> None:
        if loader.batch_size is None:
            raise InvalidParameter(
                "noise_mechanism='banded-mf' needs a data_loader with a fixed batch_size (it has a "
                "batch_sampler): the batches are fixed once and reused every epoch"
            )
        order = [int(i) for i in loader.sampler]
        bs = int(loader.batch_size)
        self.batches = [order[i : i + bs] for i in range(0, len(order), bs)]
        if loader.drop_last and self.batches and len(self.batches[-1]) < bs:
            self.batches.pop()
        if not self.batches:
            raise InvalidParameter("data_loader is empty")
        self.loader = loader
        self.batch_size = bs
        self.dataset = loader.dataset
        self.drawn = DrawnBatches()
        self.position = 0  # batches handed out since the start of the run

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        self.drawn.begin_pass()  # batches handed out but never used are forgotten (and refused)
        start = self.position % len(self.batches)
        inner = DataLoader(
            self.loader.dataset,
            batch_sampler=self.batches[start:],
            collate_fn=self.loader.collate_fn,
            num_workers=self.loader.num_workers,
            pin_memory=self.loader.pin_memory,
        )
        for idx, batch in zip(self.batches[start:], inner, strict=True):
            self.drawn.add(self.position, len(idx))
            self.position += 1
            yield batch


class MFCharge:
    """Charges a banded-MF run to a :class:`gaussdp.torch._run_accountant.RunAccountant`.

    Before the first release of epoch ``e`` it charges the release of every step up to the end of
    that epoch: the plan's event for that prefix of ``C`` (the accounting's
    :func:`gaussdp.accounting.banded_matrix_factorization_event`) less what was charged before, as
    one Gaussian: Gaussian releases compose exactly in mu-GDP (mu^2 adds; Dong, Roth & Su 2019,
    Corollary 3.3), so after the last epoch the accountant holds exactly the whole run's event (up
    to rounding, always upward). Steps past the plan, a changed noise multiplier or clip norm, or a
    step that does not use the batch at its position, are refused before anything is released.
    """

    def __init__(self, plan: BandedMFPlan, *, noise_multiplier: float, clip_norm: float) -> None:
        self.plan = plan
        self.noise_multiplier = noise_multiplier
        self.clip_norm = clip_norm
        self.charged_upto = 0
        self.mu2 = 0.0

    def charge(
        self, accountant: Any, step: int, sigma: float, clip_norm: float, batch: Any, unused: int
    ) -> None:
        """Charge step ``step`` (0-based) before its release; ``batch`` is the loader's record of the
        batch it used, ``unused`` how many batches were handed out after it and not used yet."""
        plan = self.plan
        if step >= plan.steps:
            raise InvalidParameter(
                f"noise_mechanism='banded-mf' was planned for {plan.steps} steps (epochs x steps per "
                f"epoch); step {step + 1} is past it and was refused (nothing released): make a new "
                "engine with more epochs"
            )
        if sigma != self.noise_multiplier or clip_norm != self.clip_norm:
            raise InvalidParameter(
                "noise_mechanism='banded-mf' needs the same noise_multiplier and max_grad_norm at every "
                f"step (the strategy's noise is correlated across steps), got noise_multiplier={sigma} "
                f"and max_grad_norm={clip_norm} after {self.noise_multiplier} and {self.clip_norm}"
            )
        position = batch[0] if batch is not None else None
        if position != step or unused:
            raise InvalidParameter(
                f"noise_mechanism='banded-mf': step {step + 1} used the batch at position "
                f"{None if position is None else position + 1} of the cyclic loader; each step must "
                "use the next batch, in order, and the batch handed out last (a record's steps must "
                "stay one epoch apart); nothing was released"
            )
        epoch_len = plan.min_separation
        upto = min(plan.steps, (step // epoch_len + 1) * epoch_len)
        if upto <= self.charged_upto:
            return
        need = 1.0 / plan.event(sigma, upto=upto).noise_multiplier ** 2
        # need - mu2 rounded up (a relative 2^-50 covers the subtraction's half ulp), then the
        # multiplier rounded down over the sqrt and the division
        inc = (need - self.mu2) * (1.0 + 2.0**-50)
        nm = 1.0 / math.sqrt(inc)
        for _ in range(2):
            nm = math.nextafter(nm, 0.0)
        # an increment too small to state is charged at the largest multiplier the accountants
        # certify: more than is owed, never less
        accountant.compose(GaussianEvent(min(nm, NOISE_MULTIPLIER_MAX)))
        self.mu2 += inc
        self.charged_upto = upto
