"""DP-SGD for PyTorch (extra ``torch``): ``PrivacyEngine`` with Opacus's ``make_private`` interface.

Per-sample gradients are clipped in the same backward pass that computes them, by hooks on the
user's module (no wrapper); Linear, Embedding and convolution layers use ghost norms where cheaper;
a custom layer can bring its own rule (:func:`register_rule`); an independence probe at
``make_private`` refuses models that mix the samples of a batch (:class:`SampleMixing`);
noise once per logical step; Poisson sampling tied to the accountant; epsilon after every step.
"""

from __future__ import annotations

from gaussdp._extras import require_extra

require_extra("torch", feature="gaussdp.torch")

from gaussdp.torch._clipper import PerSampleClipper
from gaussdp.torch._probe import ProbeReport, SampleMixing
from gaussdp.torch._rules import RuleHandle, register_rule
from gaussdp.torch.data import BatchMemoryManager, DPDataLoader, PoissonBatchSampler, split_batch
from gaussdp.torch.engine import DPLoss, PrivacyEngine
from gaussdp.torch.optimizer import DPOptimizer
from gaussdp.torch.validator import ModuleProblem, ModuleValidator, UnsupportedModule

__all__ = [
    "BatchMemoryManager",
    "DPDataLoader",
    "DPLoss",
    "DPOptimizer",
    "ModuleProblem",
    "ModuleValidator",
    "PerSampleClipper",
    "PoissonBatchSampler",
    "PrivacyEngine",
    "ProbeReport",
    "RuleHandle",
    "SampleMixing",
    "UnsupportedModule",
    "register_rule",
    "split_batch",
]
