"""``PrivacyEngine``: the Opacus-shaped entry point of DP-SGD in PyTorch.

Guarantee: (epsilon, delta)-DP of the trained parameters (and of everything computed from the noisy
gradients) with respect to adding or removing one record of the training set, when batches come
from the Poisson data loader the engine returns. Each ``optimizer.step()`` is one
``SubsampledGaussianEvent(noise_multiplier, sample_rate)``; :meth:`PrivacyEngine.get_epsilon`
composes them with the chosen accountant (PLD by default, tight). With ``poisson_sampling=False``
the guarantee is under replace-one of a record; participation: each record is in at most one batch
per pass over the loader, each pass charged as one ``GaussianEvent(noise_multiplier / 2)``, passes
composed (see :meth:`PrivacyEngine.make_private`).

References:
    Abadi et al. 2016, "Deep learning with differential privacy" (DP-SGD).
    Bu et al. 2023, "Differentially private optimization on large model at small cost" (book-keeping).
    Doroshenko et al. 2022, "Connect the dots: tighter discrete approximations of privacy loss
    distributions" (PLD accounting, in ``gaussdp.accounting``).

Over 600 lines on purpose: :meth:`PrivacyEngine.make_private` keeps Opacus's signature and adds
gaussdp's options (noise mechanism, banded MF, the independence probe), each one validation and
wiring; the work is in the modules it calls (clipper, optimizer, data, ``gaussdp.mf``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader

from gaussdp._validate import (
    check_choice,
    check_counts,
    check_delta,
    check_epsilon,
    check_nonnegative,
    check_positive,
)
from gaussdp.accounting.events import NOISE_MULTIPLIER_MAX, NOISE_MULTIPLIER_MIN
from gaussdp.errors import InvalidParameter, NotPrivateWarning
from gaussdp.mf import BandedMFPlan, BandedNoise
from gaussdp.torch._clipper import PerSampleClipper
from gaussdp.torch._mf import CyclicLoader, MFCharge
from gaussdp.torch._probe import ProbeReport, run_probe
from gaussdp.torch._random import KeystreamNormal, keystream_normal_available, torch_generator
from gaussdp.torch._run_accountant import RunAccountant
from gaussdp.torch.data import DPDataLoader, PassCountingLoader, check_once_per_pass
from gaussdp.torch.optimizer import AdaptiveClipping, DPOptimizer, _distributed
from gaussdp.torch.validator import ModuleValidator

__all__ = ["DPLoss", "PrivacyEngine"]


# Opacus's grad_sample_mode values: every one gives the same clipped sums (the per-sample gradients
# of the same loss), which gaussdp computes its own way per layer; the ghost modes also return the
# criterion. "ghost_fsdp" is Opacus's ghost clipping for a module sharded by FSDP; gaussdp takes it
# for a module that is not sharded (FSDP removed), where it is "ghost", and refuses sharded ones.
_GRAD_SAMPLE_MODES = ("hooks", "functorch", "ew", "ghost", "ghost_fsdp")
_GHOST_MODES = ("ghost", "ghost_fsdp")
# Opacus's arguments of clipping="adaptive" (AdaClipDPOptimizer), all required there as here.
_ADAPTIVE_ARGS = (
    "target_unclipped_quantile",
    "clipbound_learning_rate",
    "max_clipbound",
    "min_clipbound",
    "unclipped_num_std",
)


class PrivacyEngine:
    """Makes a module, optimizer and data loader private; keeps the privacy ledger of the run.

    Opacus's ``PrivacyEngine`` with only the import changed: ``PrivacyEngine(accountant=...,
    secure_mode=...)``, ``make_private``, ``make_private_with_epsilon``, ``accountant.get_epsilon``,
    ``get_epsilon``, ``save_checkpoint`` and ``load_checkpoint``.

    Args:
        accountant: ``"pld"`` (default, tightest), ``"rdp"``, ``"advanced"``, ``"basic"``, or
            Opacus's default ``"prv"``, which is computed with the PLD accountant (a proven upper
            bound; ``engine.accountant`` says so in its ``repr``). ``"gdp"`` is refused (an
            approximation). See :class:`gaussdp.torch._run_accountant.RunAccountant`.
        secure_mode: Opacus's switch for cryptographically secure noise. gaussdp's default noise
            already is: an AES-128-CTR keystream keyed from the OS CSPRNG. ``True`` only makes sure
            of it: where that keystream cannot run, noise comes from ``noise="secure"`` (ChaCha20)
            instead of ``torch.randn`` seeded from the OS; a ``seed`` or ``noise_generator`` is then
            refused. ``False`` (default) is accepted and changes nothing. Poisson sampling always
            draws from a generator seeded from the OS CSPRNG. Neither mode is floating-point safe
            (Opacus's secure mode is not either, Mironov 2012; DP-SGD gradients are not released
            bit-exactly).
        noise: "fast" (default): an AES-128-CTR keystream keyed from the OS CSPRNG, turned into
            normals by a vectorised Box-Muller (``gaussdp.torch._random.KeystreamNormal``; faster
            than ``torch.randn``); where ``cryptography`` or the compiled ``gaussdp._gauss`` is
            missing, ``torch.randn`` from a ``torch.Generator`` seeded with 63 bits from the OS CSPRNG
            (``noise_stream`` says which). "secure": normals from
            ``gaussdp.noise.noise_source("secure")`` (ChaCha20, polar method in float64; slower).
        seed: fixes sampling and noise (for experiments only: NOT private, warned).

    Example::

        engine = PrivacyEngine()
        model, optimizer, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader,
            noise_multiplier=1.0, max_grad_norm=1.0)
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            print(engine.accountant.get_epsilon(delta=1e-5))
    """

    def __init__(
        self,
        accountant: str = "pld",
        *,
        secure_mode: bool = False,
        noise: str = "fast",
        seed: int | None = None,
    ) -> None:
        check_choice("noise", noise, ("fast", "secure"))
        if not isinstance(secure_mode, bool):
            raise TypeError(f"secure_mode must be a bool, got secure_mode={secure_mode!r}")
        if secure_mode and seed is not None:
            raise InvalidParameter("secure_mode=True cannot take a seed (a seeded run is not private)")
        self.noise = noise
        self.secure_mode = secure_mode
        self.accountant_name = accountant
        self.accountant = RunAccountant(accountant)  # get_epsilon prints upper bounds only
        self.seed = seed
        self.noise_multiplier: float | None = None
        self.sample_rate: float | None = None
        self.poisson_sampling = True
        self.clipper: PerSampleClipper | None = None
        self.optimizer: DPOptimizer | None = None
        self.noise_stream: str | None = None  # where the gradient noise comes from, once made private
        self.probe_report: ProbeReport | None = None  # what the independence probe found and cost
        self._drawn: Any = None  # the batches the loader handed out (gaussdp.torch.data.DrawnBatches)
        self._pass_seen = -1
        self._pass_mu2 = 0.0  # mu^2 of the Gaussian releases charged in the current pass
        self.mf: MFCharge | None = None  # the charge of noise_mechanism="banded-mf"

    @property
    def steps(self) -> int:
        """Optimizer steps charged so far (including those of a run resumed from a checkpoint)."""
        return self.accountant.steps

    # ------------------------------------------------------------------------------------ API
    def make_private(
        self,
        *,
        module: nn.Module,
        optimizer: Optimizer,
        data_loader: DataLoader,
        noise_multiplier: float,
        max_grad_norm: float | Sequence[float],
        criterion: nn.Module | None = None,
        poisson_sampling: bool = True,
        loss_reduction: str = "mean",
        batch_first: bool = True,
        clipping: str = "flat",
        noise_generator: torch.Generator | None = None,
        grad_sample_mode: str = "hooks",
        keep_grad_sample: bool = False,
        independence_probe: bool | Callable[[nn.Module, Any], Any] = True,
        noise_mechanism: str = "gaussian",
        bands: int | None = None,
        epochs: int | None = None,
        **adaptive: Any,
    ) -> Any:
        """Hooks on ``module`` (returned unchanged), a DP optimizer and the private data loader.

        Guarantee: with ``poisson_sampling=True`` (default), (epsilon, delta)-DP of everything
        computed from the noisy gradients under add/remove of one record, each step charged as a
        ``SubsampledGaussianEvent(noise_multiplier, 1 / len(data_loader))``. With
        ``poisson_sampling=False``, under replace-one of a record (the batch size is fixed), each
        pass over the loader charged as one ``GaussianEvent(noise_multiplier / 2)`` (no
        amplification; see below).

        Args:
            module: the model. Not wrapped: its class, ``state_dict`` keys and methods such as
                Hugging Face ``generate()`` are untouched; hooks are added to its submodules. A
                ``torch.nn.parallel.DistributedDataParallel`` or Opacus ``DPDDP`` wrapper is
                accepted and returned as given: the hooks go on the module inside, and DDP's own
                gradient all-reduce is switched off (``require_backward_grad_sync=False``), since the
                optimizer all-reduces the clipped sums itself.
            optimizer: over the trainable (``requires_grad``) parameters; frozen ones are ignored.
                Not ``SparseAdam``: the noisy gradient is dense (an ``Embedding(sparse=True)`` is
                trained as a dense one).
            data_loader: its dataset and collate function are reused; its batch size ``b`` sets the
                sample rate ``q = 1 / len(data_loader)`` (about ``b / N``).
            noise_multiplier: ``sigma >= 0``; noise std on the clipped sum is ``sigma * max_grad_norm``.
            max_grad_norm: per-sample clip bound ``C > 0`` over all trainable parameters; with
                ``clipping="per_layer"`` also a list of one bound per trainable parameter; with
                ``clipping="adaptive"`` the initial bound.
            criterion: the loss (Opacus's fast gradient clipping). With ``grad_sample_mode="ghost"``
                a 4-tuple ``(module, optimizer, criterion, data_loader)`` is returned as Opacus
                does, ``criterion`` wrapped in :class:`DPLoss` (``loss.backward()`` works as before:
                gaussdp's clipping already runs in the one backward pass). Its ``reduction`` must
                match ``loss_reduction``.
            poisson_sampling: True (the accountant's assumption). Participation: each record
                joins each step independently with probability ``q``. False keeps the user's loader
                (wrapped only to record its passes and batches). Participation: each record is in
                at most one batch per pass over the loader (its sampler must be sequential or
                shuffled without replacement, and is checked), and the passes compose. Each step is
                averaged over the loader's ``batch_size``, so replacing one record moves one
                batch's clipped sum by at most ``2 C``: each pass is one Gaussian release of noise
                multiplier ``sigma / 2`` with respect to that sensitivity, charged at the first
                step that uses a batch of the pass (and topped up, by the exact composition of
                Gaussians, if a later step of the pass uses a smaller ``sigma``). Shuffling gives
                no proven amplification that is tighter in general (Chua et al. 2024), so none is
                claimed. Every step must use exactly one batch of the loader, each of its samples
                one row of the batch dimension in every hooked layer (the last, smaller batch of a
                pass holds fewer): anything else is refused before a charge. For larger steps use
                a larger ``batch_size`` and :class:`BatchMemoryManager` (gaussdp's or Opacus's).
            loss_reduction: "mean" (default) or "sum", how the loss combines the batch.
            batch_first: True (default): the batch is dimension 0 of every layer input. False:
                dimension 1 (as in Opacus), supported for ``Linear`` (inputs of 3 or more
                dimensions), ``Embedding`` and Opacus's ``DPLSTM``/``DPGRU``/``DPRNN``; any other
                layer is refused at its first backward pass with a message naming it.
                ``nn.LSTM``/``GRU``/``RNN`` follow their own ``batch_first`` either way.
            clipping: ``"flat"`` (default), ``"per_layer"`` (as in Opacus): each parameter's
                per-sample gradient clipped to its own bound (``C / sqrt(n)`` each for one number
                ``C``), the noise scaled to ``sqrt(sum C_p^2)``; or ``"adaptive"`` (Andrew et al.
                2021, as Opacus's ``AdaClipDPOptimizer``): the bound follows a private estimate of
                the ``target_unclipped_quantile`` of the per-sample norms; the extra release (the
                noisy count of unclipped samples) is paid for by a larger gradient noise, so the
                whole step is still charged at ``noise_multiplier`` (see
                :class:`gaussdp.torch.optimizer.AdaptiveClipping`). Takes the keyword arguments
                ``target_unclipped_quantile``, ``clipbound_learning_rate``, ``max_clipbound``,
                ``min_clipbound`` and ``unclipped_num_std``.
            noise_generator: a ``torch.Generator`` for the gradient noise, as in Opacus. Whoever
                knows its state can remove the noise: the run is warned as NOT private (refused
                with ``secure_mode=True``).
            grad_sample_mode: Opacus's ``"hooks"`` (default), ``"functorch"``, ``"ew"`` or
                ``"ghost"``: all give the same clipped sums, which gaussdp computes by its own
                hooks, per layer by ghost norms or per-sample gradients (whichever is cheaper);
                ``"ghost"`` also returns the criterion. ``"ghost_fsdp"`` is ``"ghost"`` for a
                module that is not sharded (Opacus's FSDP examples with FSDP removed); a module
                sharded by FSDP is refused in every mode. Other values (``"no_op"``: per-sample
                gradients supplied by the user, which gaussdp cannot check) are refused.
            keep_grad_sample: set ``p.grad_sample`` after each backward pass to the per-sample
                gradients of each trainable parameter (shape ``(B, *p.shape)``, unclipped, as
                in Opacus). Off by default: gaussdp does not materialise them where ghost norms
                suffice, and this costs their memory.
            independence_probe: True (default): before returning, run a quarter of a batch of
                the dataset (at most 32 records, collated by the loader's ``collate_fn``) forward
                and backward twice, the second time with its first record replaced by another
                record of the dataset, and refuse the module (:class:`SampleMixing`) if any
                hooked layer sees other than one row per sample, or if the change moves another
                sample's output or per-sample gradient (``x - x.mean(0)``, the sequence in the
                batch dimension, ...). It costs about half a forward and backward pass of a batch
                and leaves no trace (torch's random state, buffers, train/eval flags and
                gradients restored); ``engine.probe_report`` says what it measured. The batch is
                run, on the module's device, as ``module(batch)`` (a tensor),
                ``module(*batch[:-1])`` and else ``module(batch[0])`` (a tuple or list: the last
                element is the target), or ``module(**batch)`` without the keys ``label(s)``,
                ``target(s)``, ``y`` (a dict); a function ``fn(module, batch) -> output`` runs it
                otherwise. False skips it. What it cannot catch is listed in
                :mod:`gaussdp.torch._probe` and the DP-SGD guide (a loss that mixes samples,
                behaviour that depends on the batch).
            noise_mechanism: ``"gaussian"`` (default: DP-SGD, independent noise at each step) or
                ``"banded-mf"``: banded matrix-factorisation noise, correlated across steps
                (:mod:`gaussdp.mf`; docs/guides/matrix-factorization.md). It needs
                ``poisson_sampling=False`` (amplification by Poisson sampling is not claimed for it:
                refused otherwise), ``bands`` and ``epochs``. The loader becomes a
                :class:`gaussdp.torch._mf.CyclicLoader`: fixed batches in the order of the given
                sampler's first pass, the same every epoch, so a record takes part in at most
                ``epochs`` steps, ``len(data_loader)`` apart. The strategy ``C`` is a ``bands``-banded
                Toeplitz matrix optimised for ``epochs * len(data_loader)`` steps; each step's noise
                is ``(C^{-1} z)_t`` with ``z ~ N(0, (noise_multiplier * max_grad_norm)^2)`` per
                coordinate, drawn from the engine's noise source, through a buffer of ``bands - 1``
                noise tensors per trainable parameter (memory ``bands x`` the trainable parameters).
                Guarantee: under zero-out of one record (its gradients replaced by zero; the
                relation of DP-FTRL and MF training), the release ``C x + z``, charged epoch by epoch
                before the epoch's first step as the accounting's
                :func:`gaussdp.accounting.banded_matrix_factorization_event` of the steps up to the
                end of that epoch; after the last epoch the accountant holds exactly the whole run's
                event. ``noise_multiplier`` and ``max_grad_norm`` must stay fixed; a step past
                ``epochs`` epochs, or one that does not use the next batch, is refused before release.
                Not with ``clipping="adaptive"`` or in a distributed run.
            bands: the number of bands ``b`` of ``C`` (1 is DP-SGD with cyclic batches), at most
                ``len(data_loader)``; only with ``noise_mechanism="banded-mf"``.
            epochs: the passes over the data the run will take; only with
                ``noise_mechanism="banded-mf"``.

        Returns:
            ``(module, optimizer, data_loader)``, or ``(module, optimizer, criterion, data_loader)``
            with ``grad_sample_mode="ghost"`` or ``"ghost_fsdp"``.

        Raises:
            UnsupportedModule: ``module`` holds a submodule that mixes the samples of a batch or
                keeps unnoised statistics of the data (any ``BatchNorm``, trainable or not; an
                ``Embedding`` with ``max_norm``), or a fused RNN configured so that its recurrence
                cannot be replayed per sample; the message names each by its path and replacement
                (:class:`gaussdp.torch.ModuleValidator`). Also a module sharded by FSDP (a
                parameter that is a ``DTensor`` or an FSDP ``FlatParameter``): each rank would clip
                the norm of its own shard only, smaller than the sample's whole norm.
            SampleMixing: the independence probe saw one sample move another's output or
                per-sample gradient, or the batch dimension hold other than the samples.
            UnsafeInput: the probe's batch reached a refusal of the clipper (a layer without a
                rule for ``batch_first=False``, a ``PackedSequence``, ...), named in the message.
            InvalidParameter, TypeError: a bad or unsupported argument, named in the message
                (also: the probe could not run the module on a batch the default way).

        References:
            Abadi et al. 2016, "Deep learning with differential privacy" (DP-SGD).
            Andrew, Thakkar, McMahan & Ramaswamy 2021, "Differentially private learning with
            adaptive clipping", NeurIPS (adaptive clipping; Theorem 1 for its accounting).
            Dong, Roth & Su 2019, "Gaussian differential privacy", Corollary 3.3 (composition of
            Gaussian releases, used for the passes of ``poisson_sampling=False``).
            Chua, Ghazi, Kamath, Kumar, Manurangsi, Sinha & Zhang 2024, "How private are DP-SGD
            implementations?", ICML (shuffled batches are not Poisson batches).
            Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta & Xu 2023, "(Amplified) Banded
            Matrix Factorizations: A unified approach to private training", NeurIPS (banded MF);
            Denisov, McMahan, Rush, Smith & Thakurta 2022, "Improved differential privacy for SGD
            via optimal private linear operators on adaptive streams", Theorem 2.1 (adaptivity).
        """
        check_choice("noise_mechanism", noise_mechanism, ("gaussian", "banded-mf"))
        if noise_mechanism == "banded-mf":
            if poisson_sampling:
                raise InvalidParameter(
                    "noise_mechanism='banded-mf' needs poisson_sampling=False: its accounting assumes "
                    "cyclic participation (fixed batches, each record once per epoch), and gaussdp does "
                    "not claim amplification by Poisson sampling for correlated noise (amplified banded "
                    "MF needs sampling within b-min-separated groups); pass poisson_sampling=False"
                )
            if clipping == "adaptive":
                raise InvalidParameter(
                    "noise_mechanism='banded-mf' cannot use clipping='adaptive': the strategy's "
                    "noise needs one clip norm for the whole run"
                )
            if bands is None or epochs is None:
                raise InvalidParameter(
                    f"noise_mechanism='banded-mf' needs bands and epochs, got bands={bands!r}, "
                    f"epochs={epochs!r}"
                )
            check_counts(bands=bands, epochs=epochs)
        elif bands is not None or epochs is not None:
            raise InvalidParameter(
                f"bands and epochs are arguments of noise_mechanism='banded-mf', got bands={bands!r}, "
                f"epochs={epochs!r} with noise_mechanism={noise_mechanism!r}"
            )
        if clipping != "adaptive" and adaptive:
            raise TypeError(f"make_private() got unsupported arguments {sorted(adaptive)}")
        if clipping == "adaptive":
            extra = sorted(set(adaptive) - set(_ADAPTIVE_ARGS))
            missing = [a for a in _ADAPTIVE_ARGS if a not in adaptive]
            if extra:
                raise TypeError(f"make_private() got unsupported arguments {extra}")
            if missing:
                raise TypeError(f"clipping='adaptive' needs the arguments {missing}")
        check_choice("clipping", clipping, ("flat", "per_layer", "adaptive"))
        if grad_sample_mode not in _GRAD_SAMPLE_MODES:
            raise InvalidParameter(
                f"grad_sample_mode={grad_sample_mode!r} is not supported: use one of "
                f"{list(_GRAD_SAMPLE_MODES)} (gaussdp computes the per-sample gradients itself; it "
                "cannot check per-sample gradients supplied from outside)"
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        inner = _unwrap_ddp(module)
        _check_not_sharded(inner)
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, torch.optim.SparseAdam):
            raise InvalidParameter(
                "optimizer is a torch.optim.SparseAdam, which takes sparse gradients only; the noisy "
                "gradient of DP-SGD is dense (noise on every row, so that it does not show which rows "
                "the batch used): use a dense optimizer (SGD, Adam, ...); Embedding(sparse=True) is "
                "trained as a dense one"
            )
        if not (isinstance(independence_probe, bool) or callable(independence_probe)):
            raise TypeError(
                "independence_probe must be True, False or a function (module, batch) -> output, got "
                f"independence_probe={independence_probe!r}"
            )
        ModuleValidator.validate(inner, strict=True)  # before anything else is made or warned
        if not isinstance(batch_first, bool):
            raise TypeError(f"batch_first must be a bool, got batch_first={batch_first!r}")
        sigma = check_nonnegative("noise_multiplier", noise_multiplier)
        _check_noise_domain(sigma, poisson_sampling)
        if clipping != "per_layer" or not isinstance(max_grad_norm, Sequence):
            check_positive("max_grad_norm", max_grad_norm)  # lists are checked by the clipper
        if self.clipper is not None:
            raise InvalidParameter("this PrivacyEngine already made a model private; use a new engine")
        if not any(p.requires_grad for p in inner.parameters()):
            raise InvalidParameter("module has no trainable parameters (requires_grad=True)")
        if noise_generator is not None:
            if not isinstance(noise_generator, torch.Generator):
                raise TypeError(
                    f"noise_generator must be a torch.Generator, got {type(noise_generator).__name__}"
                )
            if self.secure_mode:
                raise InvalidParameter(
                    "noise_generator cannot be used with secure_mode=True: its state (a Mersenne "
                    "Twister's) would let anyone who knows it remove the noise"
                )
        if grad_sample_mode in _GHOST_MODES:
            criterion = nn.CrossEntropyLoss() if criterion is None else criterion
            dp_loss = DPLoss(criterion, loss_reduction=loss_reduction)
        adaptive_clip = None
        if clipping == "adaptive":
            adaptive_clip = AdaptiveClipping(noise_multiplier=sigma, **adaptive)
        if sigma == 0:
            warnings.warn("noise_multiplier=0: training is NOT private", NotPrivateWarning, stacklevel=2)
        if noise_generator is not None:
            warnings.warn(
                "noise_generator: the gradient noise comes from a torch.Generator whose state, if "
                "known, removes it: this run is NOT private (use the default OS-entropy noise)",
                NotPrivateWarning,
                stacklevel=2,
            )

        rank, world = _distributed()
        probe_report: ProbeReport | None = None
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
        elif noise_mechanism == "banded-mf":
            if world > 1:
                raise InvalidParameter("noise_mechanism='banded-mf' is not supported in a distributed run")
            if len(data_loader) == 0:
                raise InvalidParameter("data_loader is empty")
            check_once_per_pass(data_loader)
            loader = CyclicLoader(data_loader)
            bands, epochs = int(bands or 0), int(epochs or 0)  # checked above: ints >= 1
            if bands > len(loader):
                raise InvalidParameter(
                    f"bands must be <= the steps per epoch (len(data_loader) = {len(loader)}), got "
                    f"bands={bands}: a record's participations must be at least bands steps apart"
                )
            plan = BandedMFPlan.cyclic(steps_per_epoch=len(loader), epochs=epochs, bands=bands)
            if sigma > 0:
                try:  # the run's event is a Gaussian of multiplier sigma / sensitivity: in the domain?
                    plan.event(sigma)
                except InvalidParameter:
                    raise InvalidParameter(
                        f"noise_multiplier={sigma!r} over the strategy's sensitivity "
                        f"{plan.sensitivity():.6g} is outside the domain the accountants certify"
                    ) from None
            sample_rate = 1.0 / len(loader)
            expected = float(loader.batch_size)
        else:
            if len(data_loader) == 0:
                raise InvalidParameter("data_loader is empty")
            if data_loader.batch_size is None:
                raise InvalidParameter(
                    "poisson_sampling=False needs a data_loader with a fixed batch_size (it has a "
                    "batch_sampler): each step is charged and averaged as one batch of batch_size"
                )
            check_once_per_pass(data_loader)
            loader = PassCountingLoader(data_loader)
            sample_rate = 1.0 / len(data_loader)
            expected = float(data_loader.batch_size) * world
        clipper = PerSampleClipper(
            inner,
            max_grad_norm=max_grad_norm,
            loss_reduction=loss_reduction,
            clipping="flat" if clipping == "adaptive" else clipping,
            batch_first=batch_first,
        )
        clipper.keep_grad_sample = bool(keep_grad_sample)
        noise_seed = None if self.seed is None else self.seed + 2 * rank + 1
        try:
            dp_optimizer = DPOptimizer(
                optimizer,
                clipper=clipper,
                noise_multiplier=sigma,
                expected_batch_size=expected,
                generator=noise_generator
                if noise_generator is not None
                else self._noise_generator(noise_seed),
                on_step=self._charge,
                drawn=loader.drawn,
                adaptive=adaptive_clip,
                correlated=BandedNoise(plan.coefficients) if noise_mechanism == "banded-mf" else None,
            )
            if independence_probe is not False:
                probe_report = run_probe(
                    inner,
                    clipper,
                    data_loader,
                    run=None if independence_probe is True else independence_probe,
                    batch_first=batch_first,
                    expected_batch_size=expected / world,
                )
        except BaseException:
            clipper.remove()  # refused: leave the module exactly as it was given
            raise
        if isinstance(module, nn.parallel.DistributedDataParallel):
            module.require_backward_grad_sync = False  # the optimizer all-reduces the clipped sums
        self.clipper, self.optimizer = clipper, dp_optimizer
        self.probe_report = probe_report
        self.noise_multiplier, self.sample_rate = sigma, sample_rate
        self.poisson_sampling = poisson_sampling
        self._drawn = loader.drawn
        if noise_mechanism == "banded-mf":
            self.mf = MFCharge(plan, noise_multiplier=sigma, clip_norm=dp_optimizer.max_grad_norm)
        self.noise_stream = (
            "a user torch.Generator (noise_generator): NOT private"
            if noise_generator is not None
            else _describe(dp_optimizer.generator)
        )
        if grad_sample_mode in _GHOST_MODES:
            return module, dp_optimizer, dp_loss, loader
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
    ) -> Any:
        """As :meth:`make_private`, with the smallest noise that keeps ``epochs`` epochs within
        ``(target_epsilon, target_delta)`` under this engine's accountant (and the charge
        :meth:`make_private` describes for ``poisson_sampling``, or for ``noise_mechanism="banded-mf"``
        with ``bands``: the whole run's MF event)."""
        from gaussdp.accounting import accountant, noise_for_epsilon

        eps = check_epsilon(target_epsilon, "target_epsilon")
        delta = check_delta(target_delta, "target_delta")
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs <= 0:
            raise InvalidParameter(f"epochs must be a positive int, got epochs={epochs!r}")
        steps_per_epoch = len(data_loader)
        if steps_per_epoch == 0:
            raise InvalidParameter("data_loader is empty")
        if kwargs.get("noise_mechanism", "gaussian") == "banded-mf":
            # one Gaussian release of the whole run, noise multiplier sigma / sensitivity(C)
            plan = BandedMFPlan.cyclic(
                steps_per_epoch=steps_per_epoch, epochs=epochs, bands=check_count_arg(kwargs.get("bands"))
            )
            sigma = plan.sensitivity() * noise_for_epsilon(
                target_epsilon=eps, delta=delta, sample_rate=1.0, steps=1, accountant=self.accountant.backend
            )
            while accountant(self.accountant.backend).compose(plan.event(sigma)).epsilon(delta) > eps:
                sigma *= 1.0 + 1e-12  # the event's rounding: nudge up until the target holds
            kwargs["epochs"] = epochs
        elif kwargs.get("poisson_sampling", True):
            sigma = noise_for_epsilon(
                target_epsilon=eps,
                delta=delta,
                sample_rate=1.0 / steps_per_epoch,
                steps=epochs * steps_per_epoch,
                accountant=self.accountant.backend,
            )
        else:  # one Gaussian of multiplier sigma / 2 per epoch (see make_private)
            sigma = 2.0 * noise_for_epsilon(
                target_epsilon=eps,
                delta=delta,
                sample_rate=1.0,
                steps=epochs,
                accountant=self.accountant.backend,
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
        return self.accountant.get_epsilon(delta)

    def detach(self) -> None:
        """Remove the hooks from the module (it is then an ordinary, non-private model again)."""
        if self.clipper is not None:
            self.clipper.remove()

    # ---------------------------------------------------------------------------- checkpoints
    def save_checkpoint(
        self,
        *,
        path: Any,
        module: nn.Module,
        optimizer: Optimizer | None = None,
        checkpoint_dict: dict[str, Any] | None = None,
        module_state_dict_kwargs: dict[str, Any] | None = None,
        torch_save_kwargs: dict[str, Any] | None = None,
        **schedulers: Any,
    ) -> None:
        """Save ``module`` (and ``optimizer``) with the privacy spent so far, as Opacus does.

        The accountant's state (every event charged, the steps, and the charge of the current pass
        without Poisson sampling) is saved as plain values beside the states of the module and
        optimizer, so :meth:`load_checkpoint` on a fresh engine resumes the spend: epsilon printed
        after resuming covers the steps before the checkpoint too. Opacus's ``noise_scheduler``
        and ``grad_clip_scheduler`` are saved when given.
        """
        _check_schedulers(schedulers)
        if self.mf is not None:
            raise InvalidParameter(
                "save_checkpoint is not supported with noise_mechanism='banded-mf': resuming needs the "
                "strategy's noise buffer (the last bands - 1 noise tensors), which a checkpoint would "
                "have to keep secret; train the run in one go"
            )
        state: dict[str, Any] = dict(checkpoint_dict or {})
        state["module_state_dict"] = module.state_dict(**(module_state_dict_kwargs or {}))
        state["privacy_accountant_state_dict"] = self._state_dict()
        if optimizer is not None:
            state["optimizer_state_dict"] = optimizer.state_dict()
        for name, sched in schedulers.items():
            if sched is not None:
                state[f"{name}_state_dict"] = sched.state_dict()
        torch.save(state, path, **(torch_save_kwargs or {}))

    def load_checkpoint(
        self,
        *,
        path: Any,
        module: nn.Module,
        optimizer: Optimizer | None = None,
        module_load_dict_kwargs: dict[str, Any] | None = None,
        torch_load_kwargs: dict[str, Any] | None = None,
        **schedulers: Any,
    ) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` saved; returns the rest of the checkpoint dict.

        Call it before the first step of this engine (its accountant must be empty): the spend
        saved is then this engine's, and every epsilon it reports includes it.
        """
        _check_schedulers(schedulers)
        kwargs = {"weights_only": True, **(torch_load_kwargs or {})}
        state = torch.load(path, **kwargs)
        self._load_state_dict(state.pop("privacy_accountant_state_dict"))
        module.load_state_dict(state.pop("module_state_dict"), **(module_load_dict_kwargs or {}))
        opt_state = state.pop("optimizer_state_dict", None)
        if optimizer is not None and opt_state is not None:
            optimizer.load_state_dict(opt_state)
        for name, sched in schedulers.items():
            saved = state.pop(f"{name}_state_dict", None)
            if sched is not None and saved is not None:
                sched.load_state_dict(saved)
        return state

    def _state_dict(self) -> dict[str, Any]:
        return {
            **self.accountant.state_dict(),
            "pass_mu2": self._pass_mu2,
        }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.load_state_dict(state)
        # a resumed run starts a new pass over its loader; it is charged anew
        self._pass_seen, self._pass_mu2 = -1, 0.0

    # ------------------------------------------------------------------------------- internals
    def _noise_generator(self, seed: int | None) -> Any:
        if self.noise == "secure" and seed is None:
            from gaussdp.noise import noise_source

            return noise_source("secure")
        if seed is None and keystream_normal_available():
            return KeystreamNormal()
        if self.secure_mode:  # no keystream here: ChaCha20 rather than a Mersenne Twister
            from gaussdp.noise import noise_source

            return noise_source("secure")
        return torch_generator(seed, "gradient noise")

    def _charge(self, sigma: float) -> None:
        """Charge one step at the multiplier the optimizer is about to use (it may have been changed
        on the optimizer since make_private, as in Opacus); a step without noise makes the run
        non-private for good (get_epsilon is then inf)."""
        from gaussdp.accounting import GaussianEvent, SubsampledGaussianEvent

        if self.sample_rate is None:
            raise RuntimeError("a step was charged before make_private set the sample rate")
        if sigma <= 0:
            if not self.accountant.unnoised_steps and self.noise_multiplier:
                warnings.warn(
                    "a step with noise_multiplier=0: training is NOT private from now on",
                    NotPrivateWarning,
                    stacklevel=3,
                )
        elif self.mf is not None:
            batch = self._drawn.current if self._drawn is not None else None
            unused = len(self._drawn) if self._drawn is not None else 0
            clip = self.optimizer.max_grad_norm if self.optimizer is not None else math.nan
            self.mf.charge(self.accountant, self.accountant.steps, sigma, clip, batch, unused)
        elif self.poisson_sampling:
            self.accountant.compose(SubsampledGaussianEvent(sigma, self.sample_rate))
        else:
            # Within a pass over the loader a record is in one batch: the pass is one Gaussian
            # release of sensitivity 2C (replace-one), i.e. mu = 2 / sigma-GDP at that batch's
            # sigma, charged at the first step using a batch of the pass. mu^2 adds under
            # composition (Dong, Roth & Su 2019, Corollary 3.3), so a later batch of the pass with a
            # smaller sigma is charged the missing mu^2 only. A step without a batch (no samples)
            # belongs to the pass charged last.
            batch = self._drawn.current if self._drawn is not None else None
            pass_id = batch[0] if batch is not None else self._pass_seen
            if pass_id != self._pass_seen:
                self._pass_seen, self._pass_mu2 = pass_id, 0.0
            need = (2.0 / sigma) ** 2
            if need > self._pass_mu2 * (1.0 + 1e-12):
                # a missing mu^2 too small to state is charged at the largest multiplier the
                # accountants certify: a smaller multiplier, so more than is owed, never less
                missing = 1.0 / math.sqrt(need - self._pass_mu2)
                self.accountant.compose(GaussianEvent(min(missing, NOISE_MULTIPLIER_MAX)))
                self._pass_mu2 = need
        self.accountant.step(noised=sigma > 0)
        self.noise_multiplier = sigma


def check_count_arg(value: Any) -> int:
    """``bands`` of ``noise_mechanism="banded-mf"``: an int >= 1 (named in the error)."""
    check_counts(bands=value)
    return int(value)


def _check_noise_domain(sigma: float, poisson_sampling: bool) -> None:
    """Refuse, at make_private, a multiplier whose steps no accountant certifies: Poisson steps
    are charged at ``sigma``, fixed-batch passes at ``sigma / 2`` (sensitivity 2C)."""
    if sigma == 0:
        return  # not private, and said so by a NotPrivateWarning
    lo, hi = (
        (NOISE_MULTIPLIER_MIN, NOISE_MULTIPLIER_MAX)
        if poisson_sampling
        else (2 * NOISE_MULTIPLIER_MIN, 2 * NOISE_MULTIPLIER_MAX)
    )
    if not lo <= sigma <= hi:
        raise InvalidParameter(
            f"noise_multiplier must be 0 or in [{lo:g}, {hi:g}] with poisson_sampling={poisson_sampling}, "
            f"got noise_multiplier={sigma!r}: outside it no accountant certifies a bound"
        )


class DPLoss(nn.Module):
    """The criterion that Opacus's fast gradient clipping returns: here the loss itself.

    gaussdp's hooks already clip in the one backward pass that ``loss.backward()`` runs (ghost norms
    where cheaper), so nothing is packaged: calling it returns ``criterion(input, target)``. It
    checks that the loss combines the batch as the engine was told (``loss_reduction``): a sum
    read as a mean would scale every per-sample gradient by the batch size before clipping.
    """

    def __init__(self, criterion: nn.Module, *, loss_reduction: str = "mean") -> None:
        super().__init__()
        if not callable(criterion):
            raise TypeError(f"criterion must be callable, got {type(criterion).__name__}")
        reduction = getattr(criterion, "reduction", loss_reduction)
        if reduction != loss_reduction:
            raise InvalidParameter(
                f"criterion has reduction={reduction!r} but loss_reduction={loss_reduction!r}: "
                "they must agree"
            )
        self.criterion = criterion
        self.loss_reduction = loss_reduction

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.criterion(*args, **kwargs)


def _unwrap_ddp(module: nn.Module) -> nn.Module:
    """The module inside ``DistributedDataParallel`` or Opacus's ``DPDDP`` (checked by name: Opacus
    is not a dependency), else ``module``."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        return module.module
    inner = getattr(module, "module", None)
    dpddp = type(module).__name__ == "DifferentiallyPrivateDistributedDataParallel"
    if dpddp and isinstance(inner, nn.Module):
        return inner
    return module


def _check_not_sharded(module: nn.Module) -> None:
    """Refuse a module sharded by FSDP (FSDP2's ``DTensor`` or FSDP1's ``FlatParameter``
    parameters, told by class name: torch.distributed may be missing). A per-sample norm taken on
    one rank's shard is smaller than the sample's norm over all of its parameters, so clipping it
    would not bound the sensitivity."""
    for name, p in module.named_parameters():
        kind = type(p).__name__
        if kind in ("DTensor", "FlatParameter"):
            raise InvalidParameter(
                f"module parameter {name!r} is a {kind} (sharded by FSDP): gaussdp clips per-sample "
                "norms over whole parameters and cannot clip sharded ones; pass the module unsharded "
                "(for Opacus's FSDP examples: without FSDP2Wrapper)"
            )


def _check_schedulers(schedulers: dict[str, Any]) -> None:
    unknown = sorted(set(schedulers) - {"noise_scheduler", "grad_clip_scheduler"})
    if unknown:
        raise TypeError(f"unsupported arguments {unknown}")


def _describe(source: Any) -> str:
    if isinstance(source, KeystreamNormal):
        return source.stream
    if isinstance(source, torch.Generator):
        return "torch.Generator (Mersenne Twister), seeded from the OS CSPRNG unless seed= was given"
    return f"gaussdp.noise source {source.name!r}"
