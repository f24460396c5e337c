"""``PrivacyEngine``: the Opacus-shaped entry point of DP-SGD in PyTorch.

Guarantee: (epsilon, delta)-DP of the trained parameters (and of everything computed from the noisy
gradients) with respect to adding or removing one record of the training set, when batches come
from the Poisson data loader the engine returns. Each ``optimizer.step()`` is one
``SubsampledGaussianEvent(noise_multiplier, sample_rate)``; :meth:`PrivacyEngine.get_epsilon`
composes them with the chosen accountant (PLD by default, tight).

References:
    Abadi et al. 2016, "Deep learning with differential privacy" (DP-SGD).
    Bu et al. 2023, "Differentially private optimization on large model at small cost" (book-keeping).
    Doroshenko et al. 2022, "Connect the dots: tighter discrete approximations of privacy loss
    distributions" (PLD accounting, in ``gaussdp.accounting``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from gaussdp._validate import (
    check_choice,
    check_delta,
    check_epsilon,
    check_nonnegative,
    check_positive,
)
from gaussdp.errors import InvalidParameter, NotPrivateWarning, PrivacyWarning
from gaussdp.torch._clipper import PerSampleClipper
from gaussdp.torch._random import KeystreamNormal, keystream_normal_available, torch_generator
from gaussdp.torch.data import DPDataLoader
from gaussdp.torch.optimizer import DPOptimizer, _distributed
from gaussdp.torch.validator import ModuleValidator

__all__ = ["PrivacyEngine"]


class PrivacyEngine:
    """Makes a module, optimizer and data loader private; keeps the privacy ledger of the run.

    Args:
        accountant: name for ``gaussdp.accounting.upper_bound_accountant``: "pld" (default,
            tightest), "rdp", "advanced" or "basic"; "gdp" is refused (an approximation).
        noise: "fast" (default): an AES-128-CTR keystream keyed from the OS CSPRNG, turned into
            normals by a vectorised Box-Muller (``gaussdp.torch._random.KeystreamNormal``; faster
            than ``torch.randn``); where ``cryptography`` or the compiled ``gaussdp._gauss`` is
            missing, ``torch.randn`` from a ``torch.Generator`` seeded with 63 bits from the OS CSPRNG
            (``noise_stream`` says which). "secure": normals from
            ``gaussdp.noise.noise_source("secure")`` (ChaCha20, polar method in float64; slower).
            Neither is floating-point safe; DP-SGD gradients are not released bit-exactly anyway.
        seed: fixes sampling and noise (for experiments only: NOT private, warned).

    Example::

        engine = PrivacyEngine()
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0)
        for x, y in loader:
            loss_fn(model(x), y).backward()
            optimizer.step()
            print(engine.get_epsilon(1e-5))
    """

    def __init__(self, accountant: str = "pld", *, noise: str = "fast", seed: int | None = None) -> None:
        from gaussdp.accounting import upper_bound_accountant

        check_choice("noise", noise, ("fast", "secure"))
        self.noise = noise
        self.accountant_name = accountant
        self.accountant = upper_bound_accountant(accountant)  # get_epsilon prints upper bounds only
        self.seed = seed
        self.steps = 0
        self.noise_multiplier: float | None = None
        self.sample_rate: float | None = None
        self.clipper: PerSampleClipper | None = None
        self.noise_stream: str | None = None  # where the gradient noise comes from, once made private
        self._unnoised_steps = 0  # steps taken with noise_multiplier=0 (then epsilon is inf)

    # ------------------------------------------------------------------------------------ API
    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: Optimizer,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: float | Sequence[float],
        poisson_sampling: bool = True,
        loss_reduction: str = "mean",
        batch_first: bool = True,
        clipping: str = "flat",
        **_opacus_only: Any,
    ) -> tuple[nn.Module, DPOptimizer, DataLoader]:
        """Hooks on ``module`` (returned unchanged), a DP optimizer and a Poisson data loader.

        Args:
            module: the model. Not wrapped: its class, ``state_dict`` keys and methods such as
                Hugging Face ``generate()`` are untouched; hooks are added to its submodules.
            optimizer: over the trainable (``requires_grad``) parameters; frozen ones are ignored.
            data_loader: its dataset and collate function are reused; its batch size ``b`` sets the
                sample rate ``q = 1 / len(data_loader)`` (about ``b / N``).
            noise_multiplier: ``sigma >= 0``; noise std on the clipped sum is ``sigma * max_grad_norm``.
            max_grad_norm: per-sample clip bound ``C > 0`` over all trainable parameters; with
                ``clipping="per_layer"`` also a list of one bound per trainable parameter.
            poisson_sampling: True (the accountant's assumption). False keeps the user's loader and
                warns: the epsilon reported is then not a proven bound. Each step is charged and
                averaged as one batch of the loader's ``batch_size``, so a step after more samples
                than one batch (batches accumulated over several backward passes) is refused, as
                two Poisson batches are; for larger steps use a larger ``batch_size`` and
                :func:`gaussdp.torch.split_batch`.
            loss_reduction: "mean" (default) or "sum", how the loss combines the batch.
            batch_first: must be True: the batch is dimension 0 of every layer input.
            clipping: ``"flat"`` (default) or ``"per_layer"`` (as in Opacus): each parameter's
                per-sample gradient clipped to its own bound (``C / sqrt(n)`` each for one number
                ``C``), so its clipped sum is formed during backward and peak memory stays close
                to non-private training. The noise uses the whole-gradient bound
                ``sqrt(sum C_p^2)``, so the accounting is unchanged.
            grad_sample_mode: accepted for Opacus compatibility and ignored (gaussdp picks per
                layer between ghost norms and per-sample gradients); other Opacus-only
                arguments are refused with TypeError.

        Returns:
            ``(module, optimizer, data_loader)``.

        Raises:
            UnsupportedModule: ``module`` holds a submodule that mixes the samples of a batch or
                keeps unnoised statistics of the data (any ``BatchNorm``, trainable or not), or a
                fused RNN configured so that its recurrence cannot be replayed per sample; the
                message names each by its path and replacement
                (:class:`gaussdp.torch.ModuleValidator`).
        """
        unsupported = sorted(set(_opacus_only) - {"grad_sample_mode"})
        if unsupported:  # never ignore an option that would change what the user expects
            raise TypeError(f"make_private() got unsupported arguments {unsupported}")
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, nn.parallel.DistributedDataParallel):
            raise TypeError(
                "pass the unwrapped module: gaussdp all-reduces the clipped sums itself in step()"
            )
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        ModuleValidator.validate(module, strict=True)  # before anything else is made or warned
        if not batch_first:
            raise InvalidParameter("batch_first=False is not supported: put the batch in dimension 0")
        sigma = check_nonnegative("noise_multiplier", noise_multiplier)
        if clipping == "flat" or not isinstance(max_grad_norm, Sequence):
            check_positive("max_grad_norm", max_grad_norm)  # lists are checked by the clipper
        if self.clipper is not None:
            raise InvalidParameter("this PrivacyEngine already made a model private; use a new engine")
        if not any(p.requires_grad for p in module.parameters()):
            raise InvalidParameter("module has no trainable parameters (requires_grad=True)")
        if sigma == 0:
            warnings.warn("noise_multiplier=0: training is NOT private", NotPrivateWarning, stacklevel=2)

        rank, world = _distributed()
        per_step: int | None = None  # without Poisson sampling: the most samples one step may use
        if poisson_sampling:
            loader: Any = DPDataLoader.from_data_loader(
                data_loader,
                generator=torch_generator(
                    None if self.seed is None else self.seed + 2 * rank, "Poisson sampling"
                ),
                rank=rank,
                world_size=world,
            )
            sample_rate, expected = loader.sample_rate, loader.expected_batch_size
        else:
            warnings.warn(
                "poisson_sampling=False: the accountant assumes Poisson sampling, so the epsilon it "
                "reports is not a proven bound for this loader",
                PrivacyWarning,
                stacklevel=2,
            )
            if len(data_loader) == 0:
                raise InvalidParameter("data_loader is empty")
            if data_loader.batch_size is None:
                raise InvalidParameter(
                    "poisson_sampling=False needs a data_loader with a fixed batch_size (it has a "
                    "batch_sampler): each step is charged and averaged as one batch of batch_size"
                )
            loader = data_loader
            sample_rate = 1.0 / len(data_loader)
            expected = float(data_loader.batch_size) * world
            # more samples in one step than one batch means batches were accumulated, which
            # this sample rate and denominator do not cover
            per_step = data_loader.batch_size
            with contextlib.suppress(TypeError):
                per_step = min(per_step, len(data_loader.sampler))  # type: ignore[arg-type]
        clipper = PerSampleClipper(
            module, max_grad_norm=max_grad_norm, loss_reduction=loss_reduction, clipping=clipping
        )
        noise_seed = None if self.seed is None else self.seed + 2 * rank + 1
        try:
            dp_optimizer = DPOptimizer(
                optimizer,
                clipper=clipper,
                noise_multiplier=sigma,
                expected_batch_size=expected,
                generator=self._noise_generator(noise_seed),
                on_step=self._charge,
                loader=loader if poisson_sampling else None,
                max_samples_per_step=per_step,
            )
        except BaseException:
            clipper.remove()  # refused: leave the module exactly as it was given
            raise
        self.clipper = clipper
        self.noise_multiplier, self.sample_rate = sigma, sample_rate
        self.noise_stream = _describe(dp_optimizer.generator)
        return module, dp_optimizer, loader

    def make_private_with_epsilon(
        self,
        *,
        module: nn.Module,
        optimizer: Optimizer,
        data_loader: DataLoader,
        target_epsilon: float,
        target_delta: float,
        epochs: int,
        max_grad_norm: float | Sequence[float],
        **kwargs: Any,
    ) -> tuple[nn.Module, DPOptimizer, DataLoader]:
        """As :meth:`make_private`, with the smallest noise that keeps ``epochs`` epochs within
        ``(target_epsilon, target_delta)`` under this engine's accountant."""
        from gaussdp.accounting import noise_for_epsilon

        eps = check_epsilon(target_epsilon, "target_epsilon")
        delta = check_delta(target_delta, "target_delta")
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs <= 0:
            raise InvalidParameter(f"epochs must be a positive int, got epochs={epochs!r}")
        steps_per_epoch = len(data_loader)
        if steps_per_epoch == 0:
            raise InvalidParameter("data_loader is empty")
        sigma = noise_for_epsilon(
            target_epsilon=eps,
            delta=delta,
            sample_rate=1.0 / steps_per_epoch,
            steps=epochs * steps_per_epoch,
            accountant=self.accountant_name,
        )
        self.target_delta = delta
        return self.make_private(
            module=module,
            optimizer=optimizer,
            data_loader=data_loader,
            noise_multiplier=sigma,
            max_grad_norm=max_grad_norm,
            **kwargs,
        )

    def get_epsilon(self, delta: float) -> float:
        """epsilon spent so far at ``delta`` (0 before the first step; inf without noise)."""
        delta = check_delta(delta)
        if self.steps == 0:
            return 0.0
        if self._unnoised_steps:
            return float("inf")
        return float(self.accountant.epsilon(delta))

    def detach(self) -> None:
        """Remove the hooks from the module (it is then an ordinary, non-private model again)."""
        if self.clipper is not None:
            self.clipper.remove()

    # ------------------------------------------------------------------------------- internals
    def _noise_generator(self, seed: int | None) -> Any:
        if self.noise == "secure" and seed is None:
            from gaussdp.noise import noise_source

            return noise_source("secure")
        if seed is None and keystream_normal_available():
            return KeystreamNormal()
        return torch_generator(seed, "gradient noise")

    def _charge(self, sigma: float) -> None:
        """Charge one step at the multiplier the optimizer is about to use (it may have been changed
        on the optimizer since make_private, as in Opacus); a step without noise makes the run
        non-private for good (get_epsilon is then inf)."""
        from gaussdp.accounting import SubsampledGaussianEvent

        assert self.sample_rate is not None
        if sigma > 0:
            self.accountant.compose(SubsampledGaussianEvent(sigma, self.sample_rate))
        else:
            if not self._unnoised_steps and self.noise_multiplier:
                warnings.warn(
                    "a step with noise_multiplier=0: training is NOT private from now on",
                    NotPrivateWarning,
                    stacklevel=3,
                )
            self._unnoised_steps += 1
        self.noise_multiplier = sigma
        self.steps += 1


def _describe(source: Any) -> str:
    if isinstance(source, KeystreamNormal):
        return source.stream
    if isinstance(source, torch.Generator):
        return "torch.Generator (Mersenne Twister), seeded from the OS CSPRNG unless seed= was given"
    return f"gaussdp.noise source {source.name!r}"
