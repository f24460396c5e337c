"""The DP optimizer: clipped sums (from the hooks) + Gaussian noise once per logical step, then the
user's optimizer.

One call of :meth:`DPOptimizer.step` is one release of the subsampled Gaussian mechanism: it is
charged to the accountant *before* the noisy gradient is written, then the noisy sum is divided by
the *expected* batch size ``q N`` (fixed denominator: dividing by the realised Poisson batch size
would leak it).
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

__all__ = ["DPOptimizer"]


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
        loader: the Poisson data loader, to check every served sample was clipped as one row.
        max_samples_per_step: without a Poisson loader, the most samples one step may clip (one
            batch of the user's loader): a step after more (batches accumulated) is refused,
            since the accountant charges, and the denominator averages, one batch per step.
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
        loader: Any = None,
        max_samples_per_step: int | None = None,
        check_moved: bool = True,
    ) -> None:
        # no super().__init__: param_groups and state are the wrapped optimizer's (as in Opacus)
        self.original_optimizer = optimizer
        self.clipper = clipper
        self.noise_multiplier = float(noise_multiplier)
        self.expected_batch_size = float(expected_batch_size)
        self.generator = generator
        self._on_step = on_step
        self._loader = loader
        self._max_samples = max_samples_per_step
        self._served_at_last_step = loader.samples_served if loader is not None else 0
        self._batches_at_last_step = loader.batches_served if loader is not None else 0
        self._check_moved = check_moved
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
        """Forget the clipped sums of a step not taken; gradients are always set to None."""
        self.clipper.reset()
        for p in self.params:
            p.grad = None
        self.original_optimizer.zero_grad(set_to_none=True)

    @property
    def summed_grads(self) -> dict[torch.nn.Parameter, torch.Tensor]:
        """Copies of the clipped per-sample gradient sums accumulated since the last step.

        With ``noise_multiplier > 0`` they already hold the step's noise (drawn into each sum's
        buffer before its first clipped sum is added, see :meth:`_prefill`): the clipped sums alone
        are seen with ``noise_multiplier=0``.
        """
        return {p: s * self.expected_batch_size for p, s in self.clipper.summed.items()}

    def _std(self) -> float:
        """The noise std on the averaged sum: ``sigma C / (q N)`` (0 on ranks other than 0)."""
        if not _adds_noise():
            return 0.0
        return self.noise_multiplier * self.max_grad_norm / self.expected_batch_size

    def _prefill(self, p: torch.nn.Parameter) -> tuple[torch.Tensor, float] | None:
        """The sum buffer of ``p`` for this step, holding the step's noise already.

        Called by the clipper when it forms the first clipped sum of ``p`` since the last step: the
        GEMM that forms the sum then adds into the noise (beta = 1), so the noise costs no pass of
        its own over the gradient. The noise is drawn once per step whatever the micro-batches;
        nothing leaves before :meth:`step` charges the accountant. Host parameters only.
        """
        std = self._std()
        if std <= 0 or p.device.type != "cpu":
            return None
        return noise_buffer(self.generator, p.shape, acc_dtype(p.dtype), std), std

    def _check_samples(self) -> None:
        if self._loader is None:
            if self._max_samples is not None and self.clipper.samples > self._max_samples:
                raise UnsafeInput(
                    f"{self.clipper.samples} samples were clipped since the last step, more than one "
                    f"batch of the data loader ({self._max_samples}): with poisson_sampling=False "
                    "each step is charged as one batch (sample rate 1 / len(data_loader)) and averaged "
                    "over its batch_size, so accumulated batches would be under-charged; nothing was "
                    "released (call zero_grad()). For larger steps use a larger batch_size and "
                    "gaussdp.torch.split_batch on each batch"
                )
            return
        batches = self._loader.batches_served - self._batches_at_last_step
        if batches > 1:
            raise UnsafeInput(
                f"{batches} Poisson batches were used for one step: each step must use one batch "
                "(the accountant charges one subsampled release per step, and a record drawn twice "
                "would count twice). For large batches use gaussdp.torch.split_batch on one batch"
            )
        served = self._loader.samples_served - self._served_at_last_step
        if served != self.clipper.samples:
            raise UnsafeInput(
                f"the data loader served {served} samples since the last step but {self.clipper.samples} "
                "rows were clipped: every sample must be one row of dimension 0 of each layer input "
                "(batch_first) and pass through backward once before step(); nothing was released"
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
            extra = math.sqrt(max(0.0, std * std - self.clipper.noised.get(p, 0.0) ** 2))
            if extra > 0:
                add_standard_normal_(self.generator, s, extra)  # in place, through a small host scratch
            out.append(s)
        return out

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Charge one subsampled-Gaussian release, write noisy averaged gradients, take the step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.clipper.check_no_plain_gradients()
        self._check_samples()
        sigma = check_nonnegative("noise_multiplier", self.noise_multiplier)  # nothing charged yet
        self._on_step(sigma)  # charge before release, at the multiplier the noise uses
        noisy = self._noisy_sums()
        _all_reduce(noisy)
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
        if self._loader is not None:
            self._served_at_last_step = self._loader.samples_served
            self._batches_at_last_step = self._loader.batches_served
        for p in self.params:
            p.grad = None
        return loss


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
