"""The DP optimizer: clipped sums (from the hooks) + Gaussian noise once per logical step, then the
user's optimizer.

One call of :meth:`DPOptimizer.step` is one release of the subsampled Gaussian mechanism (with
fixed-size batches, one step of a pass that is charged as one Gaussian release): it is charged to
the accountant *before* the noisy gradient is written, then the noisy sum is divided by the
*expected* batch size ``q N`` (fixed denominator: dividing by the realised Poisson batch size would
leak it). Each step must have clipped exactly the samples of one batch the data loader handed out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from gaussdp._validate import check_nonnegative, check_positive
from gaussdp.errors import InvalidParameter, UnsafeInput
from gaussdp.torch._clipper import PerSampleClipper
from gaussdp.torch._parts import acc_dtype
from gaussdp.torch._random import add_standard_normal_, noise_buffer

__all__ = ["AdaptiveClipping", "DPOptimizer"]


class AdaptiveClipping:
    """Adaptive clipping (Andrew et al. 2021), as Opacus's ``AdaClipDPOptimizer`` names it.

    At each step, beside the noisy gradient, the optimizer releases how many samples were not
    clipped: ``sum_i (b_i - 1/2) + N(0, unclipped_num_std^2)`` with ``b_i = 1`` where sample ``i``'s
    norm is at most the bound. Centred this way one record moves the count by at most 1/2 (Andrew
    et al., Section 3), so the gradient (sensitivity ``C``, noise ``z_g C``) and the count together
    are one Gaussian release of noise multiplier ``z`` with ``z^-2 = z_g^-2 + (2 unclipped_num_std)^-2``
    (Theorem 1 there). The gradient's multiplier is therefore raised to
    ``z_g = (z^-2 - (2 unclipped_num_std)^-2)^(-1/2)`` and each step is charged at ``z`` (the
    ``noise_multiplier`` given): the accountant sees exactly the privacy of both releases. The bound
    then moves geometrically toward the target quantile:
    ``C <- clamp(C exp(-clipbound_learning_rate (unclipped_fraction - target_unclipped_quantile)),
    min_clipbound, max_clipbound)``, with the fraction estimated as count / (q N) + 1/2.

    Args:
        noise_multiplier: ``z``, the multiplier charged per step (> 0).
        target_unclipped_quantile: the fraction of samples to leave unclipped, in [0, 1].
        clipbound_learning_rate: the step size of the geometric update (>= 0).
        max_clipbound, min_clipbound: the range of the bound (0 < min < max).
        unclipped_num_std: the noise std on the count; must exceed ``z / 2``.

    References:
        Andrew, Thakkar, McMahan & Ramaswamy 2021, "Differentially private learning with adaptive
        clipping", NeurIPS, Algorithm 1 and Theorem 1.
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        target_unclipped_quantile: float,
        clipbound_learning_rate: float,
        max_clipbound: float,
        min_clipbound: float,
        unclipped_num_std: float,
    ) -> None:
        z = check_positive("noise_multiplier", noise_multiplier)
        self.target_unclipped_quantile = float(target_unclipped_quantile)
        if not 0.0 <= self.target_unclipped_quantile <= 1.0:
            raise InvalidParameter(
                f"target_unclipped_quantile must be in [0, 1], got {target_unclipped_quantile!r}"
            )
        self.clipbound_learning_rate = check_nonnegative("clipbound_learning_rate", clipbound_learning_rate)
        self.max_clipbound = check_positive("max_clipbound", max_clipbound)
        self.min_clipbound = check_positive("min_clipbound", min_clipbound)
        if self.min_clipbound >= self.max_clipbound:
            raise InvalidParameter(
                f"min_clipbound must be < max_clipbound, got min_clipbound={min_clipbound!r}, "
                f"max_clipbound={max_clipbound!r}"
            )
        self.unclipped_num_std = check_positive("unclipped_num_std", unclipped_num_std)
        self.check(z)

    def check(self, z: float) -> None:
        """Refuse a multiplier ``z`` that the count's noise alone would exceed."""
        if not z < 2.0 * self.unclipped_num_std:
            raise InvalidParameter(
                f"clipping='adaptive' needs noise_multiplier < 2 * unclipped_num_std, got "
                f"noise_multiplier={z!r}, unclipped_num_std={self.unclipped_num_std!r}: the count's "
                "noise alone would spend more than the whole step's budget"
            )

    def gradient_multiplier(self, z: float) -> float:
        """``z_g``: the gradient's noise multiplier that leaves the step at ``z`` in all."""
        return (z**-2 - (2.0 * self.unclipped_num_std) ** -2) ** -0.5


class DPOptimizer(Optimizer):
    """Wraps ``optimizer``; behaves like it (param groups, state, schedulers) with private steps.

    Args:
        optimizer: the user's optimizer over (at least) the module's trainable parameters.
        clipper: the hooks that leave per-sample-clipped sums after each backward pass.
        noise_multiplier: ``sigma``; the noise standard deviation on the sum is ``sigma * C``.
        expected_batch_size: ``q N``, the denominator of the average (all ranks together).
        generator: source of the noise (``gaussdp.torch._random``): a ``KeystreamNormal`` (the
            default), a ``torch.Generator`` (seeded runs, or where the keystream cannot run) or a
            :class:`gaussdp.noise.NoiseSource` (``noise="secure"``).
        on_step: called with the noise multiplier before anything is released, to charge the
            accountant at the multiplier actually used (``noise_multiplier`` may be changed between
            steps, as in Opacus).
        drawn: the batches the data loader handed out (:class:`gaussdp.torch.data.DrawnBatches`).
            Each step takes the oldest one not yet used and must have clipped exactly its
            samples, each as one row of the batch dimension: a model that moves the samples out of
            that dimension, a batch used twice, or several batches used for one step (which the
            accountant would under-charge) is refused before anything is charged. None: no check
            (a ``DPOptimizer`` made by hand, without a data loader).
        correlated: a :class:`gaussdp.mf.BandedNoise` (``noise_mechanism="banded-mf"``): each step's
            fresh N(0, std^2) is passed through the strategy's recurrence before it is added, so the
            noise is correlated across steps; None (default): independent noise (DP-SGD).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        clipper: PerSampleClipper,
        noise_multiplier: float,
        expected_batch_size: float,
        generator: Any,
        on_step: Callable[[float], None],
        drawn: Any = None,
        check_moved: bool = True,
        adaptive: AdaptiveClipping | None = None,
        correlated: Any = None,
    ) -> None:
        # no super().__init__: param_groups and state are the wrapped optimizer's (as in Opacus)
        self.original_optimizer = optimizer
        self.clipper = clipper
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = float(expected_batch_size)
        self.generator = generator
        self._on_step = on_step
        self._drawn = drawn
        self._batch_taken = False  # a refused step took the batches of the sums it left
        self._check_moved = check_moved
        self.adaptive = adaptive
        self.correlated = correlated  # a gaussdp.mf.BandedNoise: noise correlated across steps
        if adaptive is not None and clipper.clipping != "flat":
            raise InvalidParameter("clipping='adaptive' adapts one flat bound; per-layer bounds are fixed")
        self._skip_queue: list[bool] = []
        self._last_step_skipped = False
        self.steps = 0
        self._step_hooks: Any = {}
        in_opt = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [clipper.names[id(p)] for p in clipper.params if id(p) not in in_opt]
        if missing:
            raise InvalidParameter(
                f"trainable parameters {missing} are not in the optimizer: they would be clipped and "
                "noised but never trained; freeze them (requires_grad_(False)) or add them"
            )
        self.params = [p for p in clipper.params]
        clipper.sum_scale = 1.0 / self.expected_batch_size  # sums arrive already averaged
        clipper.prefill = self._prefill

    @property
    def max_grad_norm(self) -> float:
        """The clip bound ``C``: the clipper's, which is also the sensitivity the noise is scaled to."""
        return self.clipper.max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        # one number for clipping and noise: a noise scaled to a smaller C than the sums were
        # clipped to would be an under-noised release
        if self.clipper.clipping != "flat":
            raise InvalidParameter(
                "per-layer clipping bounds are fixed at make_private; max_grad_norm cannot be set"
            )
        if self.clipper.summed or self.clipper.samples:
            raise InvalidParameter(
                "max_grad_norm cannot change between backward() and step(): the pending sums were clipped "
                "to the old bound; change it after step() or zero_grad()"
            )
        self.clipper.max_grad_norm = check_positive("max_grad_norm", value)

    # delegation so that schedulers and checkpoints see the user's optimizer
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.original_optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.original_optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.original_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.original_optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"DPOptimizer({self.original_optimizer!r}, noise_multiplier={self.noise_multiplier})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the clipped sums of a step not taken; gradients are always set to None.

        The batch those sums came from is dropped with them (the next step uses the next batch of
        the loader). After a skipped step (:meth:`signal_skip_step`) the clipped sums are kept for
        the step that ends the batch, as in Opacus; ``p.grad`` and ``p.grad_sample`` are cleared.
        """
        if not self._last_step_skipped:
            if self._drawn is not None and self.clipper.samples and not self._batch_taken:
                self._drawn.take_prefix(self.clipper.samples)
            self._batch_taken = False
            self.clipper.reset()
        for p in self.params:
            p.grad = None
            if hasattr(p, "grad_sample"):
                p.grad_sample = None
        self.clipper.released.clear()
        self.original_optimizer.zero_grad(set_to_none=True)

    def signal_skip_step(self, do_skip: bool = True) -> None:
        """Whether the next :meth:`step` only ends a physical batch of a larger one (Opacus's API).

        A skipped step keeps its samples' clipped sums for the batch's last step and charges,
        noises and releases nothing; used by
        :class:`gaussdp.torch.utils.batch_memory_manager.BatchMemoryManager` and by Opacus's own.
        """
        self._skip_queue.append(bool(do_skip))

    @property
    def summed_grads(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Copies of the clipped per-sample gradient sums accumulated since the last step.

        With ``noise_multiplier > 0`` they already hold the step's noise (drawn into each sum's
        buffer before its first clipped sum is added, see :meth:`_prefill`): the clipped sums alone
        are seen with ``noise_multiplier=0``.
        """
        return {p: s * self.expected_batch_size for p, s in self.clipper.summed.items()}

    def _gradient_multiplier(self) -> float:
        """The gradient's noise multiplier: ``noise_multiplier``, raised with adaptive clipping so
        that the noisy count and the gradient together are charged at ``noise_multiplier``."""
        z = self.noise_multiplier
        if self.adaptive is None or z <= 0:
            return z
        return self.adaptive.gradient_multiplier(z)

    def _std(self) -> float:
        """The noise std on the averaged sum: ``sigma C / (q N)`` (0 on ranks other than 0)."""
        if not _adds_noise():
            return 0.0
        return self._gradient_multiplier() * self.max_grad_norm / self.expected_batch_size

    def _prefill(self, p: torch.nn.Parameter) -> tuple[torch.Tensor, float] | None:
        """The sum buffer of ``p`` for this step, holding the step's noise already.

        Called by the clipper when it forms the first clipped sum of ``p`` since the last step: the
        GEMM that forms the sum then adds into the noise (beta = 1), so the noise costs no pass of
        its own over the gradient. The noise is drawn once per step whatever the micro-batches;
        nothing leaves before :meth:`step` charges the accountant. Host parameters only.
        """
        std = self._std()
        if std <= 0 or p.device.type != "cpu" or self.correlated is not None:
            return None
        return noise_buffer(self.generator, p.shape, acc_dtype(p.dtype), std), std

    def _check_samples(self) -> None:
        """The step's samples are exactly those of the oldest batch the loader handed out and no
        step used yet (none: no samples)."""
        if self._drawn is None:
            return
        batch = self._drawn.take()
        drawn = 0 if batch is None else batch[1]
        clipped = self.clipper.samples
        if clipped == drawn:
            return
        self._batch_taken = True
        if batch is None:
            raise UnsafeInput(
                f"{clipped} samples were clipped since the last step, but the data loader handed out "
                "no batch for it: each step must use one batch of the loader make_private returned "
                "(the accountant charges its batches); nothing was released (call zero_grad())"
            )
        if clipped > drawn and self._drawn.take_prefix(clipped - drawn):
            raise UnsafeInput(
                f"{clipped} samples were clipped since the last step, more than one batch of the data "
                f"loader ({drawn}): the accountant charges, and the denominator averages, one batch per "
                "step, so batches accumulated before one step would be under-charged; nothing was "
                "released (call zero_grad()). For larger steps use a larger batch_size, and "
                "BatchMemoryManager or gaussdp.torch.split_batch to split each batch"
            )
        raise UnsafeInput(
            f"{clipped} samples were clipped since the last step, but its batch from the data loader "
            f"holds {drawn}: each sample must be one row of the batch dimension of every layer input "
            "(dimension 0 with batch_first=True, not the sequence) and pass through backward once "
            "before step(); nothing was released (call zero_grad())"
        )

    def _noisy_sums(self) -> list[torch.Tensor]:
        """Averaged clipped sums plus N(0, (sigma C / qN)^2) per coordinate.

        A sum whose noise was drawn in :meth:`_prefill` gets only what is missing if the noise
        multiplier was raised since: N(0, std^2 - drawn^2), independent, so the total is N(0, std^2).
        If it was lowered, the sum keeps the larger noise drawn, and the accountant's charge at the
        new multiplier is still an upper bound.
        """
        std = self._std()
        out = []
        for p in self.params:
            s = self.clipper.summed.get(p)
            if s is None:
                s = torch.zeros(p.shape, dtype=acc_dtype(p.dtype), device=p.device)
            if self.correlated is not None:
                # banded MF: this step's fresh N(0, std^2) through the strategy's recurrence
                if std > 0:
                    # contiguous, whatever s is; the array that left the strategy's buffer if any
                    fresh = self.correlated.scratch(p)
                    if fresh is None or fresh.shape != s.shape or fresh.dtype != s.dtype:
                        fresh = torch.empty(s.shape, dtype=s.dtype, device=s.device)
                    add_standard_normal_(self.generator, fresh.zero_(), std)
                    s.add_(self.correlated.next(p, fresh))  # the buffer keeps y_t: s gets a copy
                out.append(s)
                continue
            extra = math.sqrt(max(0.0, std * std - self.clipper.noised.get(p, 0.0) ** 2))
            if extra > 0:
                add_standard_normal_(self.generator, s, extra)  # in place, through a small host scratch
            out.append(s)
        return out

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Charge the step, write noisy averaged gradients, take the step.

        First the step's samples are checked against its batch (see ``drawn``; refused before any
        charge), then ``on_step`` charges it: one subsampled-Gaussian release with Poisson batches,
        or with fixed-size batches the pass's Gaussian release at the pass's first step.
        ``p.grad`` keeps the noisy averaged gradient after the step, as in Opacus (a plain gradient
        added to it by a later backward pass is still refused). After :meth:`signal_skip_step`,
        the samples are only kept for the batch's last step: nothing is charged or released.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.clipper.check_no_plain_gradients()
        if self._skip_queue and self._skip_queue.pop(0):
            self._last_step_skipped = True
            return loss
        self._last_step_skipped = False
        self._check_samples()
        sigma = check_nonnegative("noise_multiplier", self.noise_multiplier)  # nothing charged yet
        if self.adaptive is not None and sigma > 0:
            self.adaptive.check(sigma)  # a multiplier set since make_private: before any charge
        self._on_step(sigma)  # charge before release, at the multiplier the noise uses
        noisy = self._noisy_sums()
        count = self._noisy_unclipped_count(sigma)
        _all_reduce(noisy + ([count] if count is not None else []))
        for p, s in zip(self.params, noisy, strict=True):
            p.grad = s.to(p.dtype)  # already divided by the expected batch size
        before = None
        if self._check_moved and self.steps == 0 and _moves(self.original_optimizer):
            before = [p.detach().clone() for p in self.params]
        self.original_optimizer.step()
        if before is not None and not any(
            not torch.equal(b, p.detach()) for b, p in zip(before, self.params, strict=True)
        ):
            raise RuntimeError(
                "no trainable parameter changed in the first private step: check that the trainable "
                "parameters (e.g. LoRA adapters) are the ones in the optimizer"
            )
        self.steps += 1
        self.clipper.reset()
        if count is not None:
            self._adapt_bound(float(count))
        self.clipper.released = {p: (p.grad, p.grad._version) for p in self.params if p.grad is not None}
        return loss

    def _noisy_unclipped_count(self, sigma: float) -> torch.Tensor | None:
        """Adaptive clipping: ``sum_i (b_i - 1/2)`` plus its noise (on rank 0 only), before the
        all-reduce; released only after the step was charged."""
        if self.adaptive is None:
            return None
        count = torch.tensor([self.clipper.unclipped - 0.5 * self.clipper.samples], dtype=torch.float64)
        if sigma > 0 and _adds_noise():
            add_standard_normal_(self.generator, count, self.adaptive.unclipped_num_std)
        return count

    def _adapt_bound(self, count: float) -> None:
        a = self.adaptive
        if a is None:
            raise RuntimeError("_adapt_bound called without clipping='adaptive'")
        fraction = count / self.expected_batch_size + 0.5
        c = self.clipper.max_grad_norm * math.exp(
            -a.clipbound_learning_rate * (fraction - a.target_unclipped_quantile)
        )
        self.clipper.max_grad_norm = min(a.max_clipbound, max(a.min_clipbound, c))


def _moves(optimizer: Optimizer) -> bool:
    return all(float(g.get("lr", 1.0)) > 0 for g in optimizer.param_groups)


def _distributed() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _adds_noise() -> bool:
    """In a distributed run only rank 0 adds the noise, so the all-reduced sum carries it once."""
    return _distributed()[0] == 0


def _all_reduce(tensors: list[torch.Tensor]) -> None:
    if _distributed()[1] == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n
