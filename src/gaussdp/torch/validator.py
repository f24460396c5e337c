"""Which modules DP-SGD may train: those whose output for a sample depends on that sample alone.

Per-sample clipping bounds each record's influence on the *gradient*. That bound is only the
sensitivity of the release if nothing else carries one record into another's computation or into
the released model. Two kinds of module break it, trainable or not, so they are refused whatever
their parameters (a frozen ``BatchNorm`` mixes samples as much as a trainable one):

- modules whose forward mixes the samples of a batch: ``BatchNorm1d/2d/3d``, their ``Lazy``
  variants and ``SyncBatchNorm`` normalise each sample with the statistics of the whole batch
  (train mode, or ``track_running_stats=False``), so removing one record moves every other
  record's output and gradient, by an amount clipping does not bound;
- modules that keep an unnoised aggregate of the training data in their state: ``running_mean``
  and ``running_var`` of a ``BatchNorm`` or an ``InstanceNorm(track_running_stats=True)`` are
  averages over every sample seen, saved with the model and used in eval mode; an
  ``InstanceNorm`` forward in train mode is per sample, its buffers are not. Likewise an
  ``Embedding``/``EmbeddingBag`` with ``max_norm``: its forward renormalises, in place and without
  noise, the rows each batch looks up, so the saved weights show which rows the data used.

Fused recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``, batch-first or not) are trained as
they are (their recurrence is replayed per sample, :mod:`gaussdp.torch._rnn`), except in
configurations the replay cannot follow (``proj_size``, dropout between layers, subclasses): those
are listed where they have trainable parameters, with Opacus's ``DPLSTM``/``DPGRU``/``DPRNN``
(made of linear maps) as the replacement.

What no check by module type can see (a statistic over the batch computed in ``forward`` without a
module, the sequence put in the batch dimension) is looked for on a real batch by the independence
probe of ``make_private`` (:mod:`gaussdp.torch._probe`).

:meth:`ModuleValidator.fix` returns a copy of the model with each refused module replaced: a
``BatchNorm`` by a ``GroupNorm`` over the same channels, an ``InstanceNorm`` by the same layer
without running statistics, and (where Opacus is installed) a listed recurrent layer by Opacus's
layer with the same weights.

References:
    Ioffe & Szegedy 2015, "Batch normalization" (batch statistics in train mode).
    Wu & He 2018, "Group normalization" (per-sample statistics, the replacement).
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from gaussdp.errors import InvalidParameter
from gaussdp.torch._rnn import rnn_unsupported

__all__ = ["ModuleProblem", "ModuleValidator", "UnsupportedModule"]


@dataclass(frozen=True)
class ModuleProblem:
    """One module DP-SGD cannot train as it is: where it is, why, and what to use instead."""

    path: str  # the module's name in ``model.named_modules()`` ("" for the model itself)
    kind: str  # its class name
    reason: str
    replacement: str

    def __str__(self) -> str:
        where = self.path or "<the model itself>"
        return f"{where} ({self.kind}): {self.reason}; use {self.replacement}"


class UnsupportedModule(InvalidParameter):
    """The model holds modules that break per-sample sensitivity; ``problems`` lists them."""

    def __init__(self, problems: list[ModuleProblem]) -> None:
        self.problems = list(problems)
        lines = "\n  ".join(str(p) for p in self.problems)
        super().__init__(
            f"module has {len(self.problems)} submodule(s) DP-SGD cannot train with per-sample "
            f"sensitivity (gaussdp.torch.ModuleValidator.fix(module) replaces them):\n  {lines}"
        )


def _dp_rnn(m: nn.RNNBase) -> str:
    """The name of Opacus's layer for ``m``'s recurrence: DPLSTM, DPGRU or DPRNN."""
    return "DP" + m.mode.split("_")[0]


def _problem(path: str, module: nn.Module) -> ModuleProblem | None:
    kind = type(module).__name__
    if isinstance(module, _BatchNorm):  # BatchNorm1d/2d/3d, LazyBatchNorm*, SyncBatchNorm
        return ModuleProblem(
            path,
            kind,
            "normalises each sample with statistics of the whole batch and keeps their running "
            "averages unnoised, so one record moves every other record's gradient (frozen or "
            "affine=False alike)",
            "nn.GroupNorm over the same channels",
        )
    if isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.max_norm is not None:
        return ModuleProblem(
            path,
            kind,
            f"max_norm={module.max_norm} renormalises, in place and without noise, the rows each batch "
            "looks up (trainable or frozen alike), so the saved weights show which rows the training "
            "data used",
            f"{kind}(..., max_norm=None) (per-sample clipping bounds each record already)",
        )
    if isinstance(module, _InstanceNorm) and module.track_running_stats:
        return ModuleProblem(
            path,
            kind,
            "track_running_stats=True keeps running_mean/running_var, unnoised averages over every "
            "training sample, saved with the model and used in eval mode",
            f"{kind}(..., track_running_stats=False)",
        )
    if isinstance(module, nn.RNNBase) and any(p.requires_grad for p in module.parameters()):
        # a frozen one needs no per-sample gradient: any configuration is per sample
        dp = f"opacus.layers.{_dp_rnn(module)}"
        if type(module) not in (nn.LSTM, nn.GRU, nn.RNN):
            return ModuleProblem(path, kind, "a subclass of a fused RNN has no per-sample rule", dp)
        why = rnn_unsupported(module)
        if why is not None:
            return ModuleProblem(path, kind, why[0], f"{why[1]}, or {dp} (ModuleValidator.fix)")
    return None


class ModuleValidator:
    """Checks a model for modules DP-SGD cannot train privately, and replaces them.

    ``PrivacyEngine.make_private`` (and ``PerSampleClipper``) run :meth:`validate` with
    ``strict=True`` and refuse the model if anything is listed.

    Example::

        model = ModuleValidator.fix(model)      # BatchNorm -> GroupNorm, ...
        assert ModuleValidator.validate(model) == []
    """

    @staticmethod
    def validate(module: nn.Module, *, strict: bool = False) -> list[ModuleProblem]:
        """The problems of ``module`` (empty when it can be trained), in ``named_modules`` order.

        Raises:
            TypeError: ``module`` is not an ``nn.Module``.
            UnsupportedModule: ``strict=True`` and a problem was found.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        problems = [p for name, m in module.named_modules() if (p := _problem(name, m)) is not None]
        if strict and problems:
            raise UnsupportedModule(problems)
        return problems

    @staticmethod
    def is_valid(module: nn.Module) -> bool:
        return not ModuleValidator.validate(module)

    @staticmethod
    def fix(module: nn.Module, *, max_groups: int = 32) -> nn.Module:
        """A copy of ``module`` (which is left unchanged) with each refused submodule replaced.

        - ``BatchNorm2d/3d``, ``SyncBatchNorm`` (and initialised ``LazyBatchNorm``): ``GroupNorm``
          over the same ``C`` channels with the largest number of groups that divides ``C`` and is
          at most ``max_groups`` (Wu & He use 32). ``BatchNorm1d`` gets one group: its input is
          often ``(B, C)``, where a group per channel would normalise single numbers to zero.
          ``affine`` and the affine parameters (values and ``requires_grad``) are kept.
        - ``InstanceNorm`` with ``track_running_stats=True``: the same layer without running
          statistics (it then normalises with each sample's own statistics in eval mode too).
        - ``Embedding``/``EmbeddingBag`` with ``max_norm``: a copy with ``max_norm=None`` (the same
          weights; rows are no longer renormalised when looked up).
        - a listed ``nn.LSTM``/``GRU``/``RNN`` (dropout between layers):
          Opacus's ``DPLSTM``/``DPGRU``/``DPRNN`` with the same weights and options (Opacus must be
          installed: ``pip install opacus``).

        Raises:
            InvalidParameter: ``max_groups < 1``; a lazy ``BatchNorm`` not yet initialised (run one
                forward first); an RNN subclass or ``proj_size`` (no replacement).
            ImportError: a recurrent layer to replace and Opacus not installed.
        """
        if isinstance(max_groups, bool) or not isinstance(max_groups, int) or max_groups < 1:
            raise InvalidParameter(f"max_groups must be an int >= 1, got max_groups={max_groups!r}")
        for problem in ModuleValidator.validate(module):  # before the copy: lazy ones cannot be copied
            m = module.get_submodule(problem.path)
            if isinstance(m, nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
                raise InvalidParameter(
                    f"{problem.path or '<the model itself>'} ({problem.kind}) is not initialised yet "
                    "(its number of channels is unknown): run one forward pass before "
                    "ModuleValidator.fix, or replace it by hand"
                )
        fixed = copy.deepcopy(module)
        replacements = {
            name: _replacement(name, m, max_groups)
            for name, m in fixed.named_modules()
            if _problem(name, m) is not None
        }
        if "" in replacements:
            return replacements[""]
        for name, new in replacements.items():
            parent_name, _, child = name.rpartition(".")
            fixed.get_submodule(parent_name).__setattr__(child, new)
        return fixed


def _groups(channels: int, max_groups: int) -> int:
    return max(g for g in range(1, min(channels, max_groups) + 1) if channels % g == 0)


def _replacement(name: str, m: nn.Module, max_groups: int) -> nn.Module:
    where = name or "<the model itself>"
    if isinstance(m, nn.Embedding | nn.EmbeddingBag):
        new_emb = copy.deepcopy(m)
        new_emb.max_norm = None
        return new_emb
    if isinstance(m, _BatchNorm | _InstanceNorm):
        ref = m.weight if m.weight is not None else m.running_mean
        kw: dict[str, Any] = {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}
        c = m.num_features
        new: nn.GroupNorm | _InstanceNorm
        if isinstance(m, _InstanceNorm):
            # momentum=None (a cumulative average) is valid at run time; torch's stubs say float
            new = type(m)(c, eps=m.eps, momentum=m.momentum, affine=m.affine, **kw)  # type: ignore[arg-type]
        else:
            groups = 1 if isinstance(m, nn.BatchNorm1d) else _groups(c, max_groups)
            new = nn.GroupNorm(groups, c, eps=m.eps, affine=m.affine, **kw)
        if m.affine:
            with torch.no_grad():
                new.weight.copy_(m.weight)
                new.bias.copy_(m.bias)
            new.weight.requires_grad_(m.weight.requires_grad)
            new.bias.requires_grad_(m.bias.requires_grad)
        new.train(m.training)
        return new
    return _rnn_replacement(where, m)


def _rnn_replacement(where: str, m: nn.Module) -> nn.Module:
    if not isinstance(m, nn.RNNBase):
        raise TypeError(f"{where}: expected a recurrent module (nn.RNNBase), got {type(m).__name__}")
    if type(m) not in (nn.LSTM, nn.GRU, nn.RNN):
        raise InvalidParameter(
            f"{where} ({type(m).__name__}) is a subclass of a fused RNN: replace it by hand"
        )
    if m.proj_size:
        raise InvalidParameter(f"{where} (LSTM) has proj_size={m.proj_size}: DPLSTM has no projection")
    if importlib.util.find_spec("opacus") is None:
        raise ImportError(
            f"{where} ({type(m).__name__}) is replaced by opacus.layers.{_dp_rnn(m)}, and opacus is "
            "not installed (pip install opacus)"
        )
    from opacus import layers

    kw: dict[str, Any] = {
        "num_layers": m.num_layers,
        "bias": m.bias,
        "batch_first": m.batch_first,
        "dropout": m.dropout,
        "bidirectional": m.bidirectional,
    }
    if m.mode.startswith("RNN_"):
        kw["nonlinearity"] = m.nonlinearity
    new = getattr(layers, _dp_rnn(m))(m.input_size, m.hidden_size, **kw)
    new.load_state_dict(m.state_dict())
    p = next(m.parameters())
    new.to(device=p.device, dtype=p.dtype)
    new_params = dict(new.named_parameters())
    for name, q in m.named_parameters():
        new_params[name].requires_grad_(q.requires_grad)
    new.train(m.training)
    return new
