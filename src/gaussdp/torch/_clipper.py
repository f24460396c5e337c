"""Per-sample clipping in one backward pass, by hooks on the user's own module (no wrapper).

How it works (book-keeping, Bu et al. 2023, "Differentially private optimization on large model at
small cost", ICML):

1. While a module that owns trainable parameters runs forward, those parameters are switched to
   ``requires_grad=False``: autograd then never computes their (unclipped, summed) gradient, which is
   the work we would throw away. The module's input is kept, and a tensor hook on its output keeps
   the output gradient when backward reaches it. When the input needs no gradient (a first layer),
   the output is made to need one by adding a zero scalar that does.
2. At the end of that backward pass (an autograd engine callback) every kept (input, output grad)
   becomes a per-parameter *part* (:mod:`gaussdp.torch._parts`); the per-sample gradient norms over
   all trainable parameters are summed from the parts, each sample's clip factor
   ``min(1, C / ||g_i||)`` follows, and each parameter's clipped sum is one weighted matmul.
3. Clipped sums accumulate over backward passes (micro-batches, each holding distinct samples) until
   the optimizer step. The step's noise is drawn once, into each sum's buffer before its first
   clipped sum is added (:attr:`PerSampleClipper.prefill`, set by the optimizer), so the GEMM that
   forms the sum adds into the noise; the optimizer charges the accountant before anything leaves.

Memory: what is kept through the pass is each layer's input and output gradient (or its per-sample
gradients, where smaller). Two things keep less: self-attention keeps the gradients autograd forms
for its q/k/v projections (no copy; see ``_split_self_attention``), and a linear layer whose output
goes only through ReLU into another linear layer keeps no output gradient when that is larger than
its weight: it is recomputed at the end from the next layer's part
(:class:`gaussdp.torch._parts.ReluFedPart`, one GEMM), except for the last such gradient to arrive
in a pass where others are recomputed (:meth:`PerSampleClipper._kept_anyway`).

A trainable parameter that receives an ordinary gradient (used outside the module owning it) cannot
be clipped per sample: that fails closed with an error naming it.

Over 600 lines on purpose: :class:`PerSampleClipper` is one state machine over one backward pass
(hooks, taps, the end-of-pass callback, accumulation over micro-batches), and the helpers above it
are used by it alone.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from gaussdp._validate import check_choice, check_positive
from gaussdp.errors import InvalidParameter, PrivacyError, UnsafeInput
from gaussdp.torch._mha import mha_capture, mha_captured_parts
from gaussdp.torch._parts import DensePart, LinearPart, Part, ReluFedPart, combine, same_elements
from gaussdp.torch._rules import owned_parameters, rule_for, vmap_parts
from gaussdp.torch.validator import ModuleValidator

__all__ = ["PerSampleClipper"]


class _Call:
    """One forward call of an owning module: its inputs and, after backward, its output gradients."""

    __slots__ = (
        "args",
        "capture",
        "grads",
        "kwargs",
        "module",
        "out_node",
        "pairs",
        "pending",
        "reached",
        "relu",
        "used",
        "versions",
    )

    def __init__(self, module: nn.Module, args: tuple, kwargs: dict, n_out: int) -> None:
        self.module, self.args, self.kwargs = module, args, kwargs
        self.grads: list[torch.Tensor | None] = [None] * n_out
        self.used = False
        self.reached = False  # backward reached one of its outputs
        self.pending = 0  # hooked outputs whose gradient has not arrived yet
        self.versions = _versions(args) + _versions(kwargs)
        self.capture: Any = None  # what the call's autograd graph offers (attention: see _rules)
        self.out_node: Any = None  # a linear layer's output node (to find a ReLU and layer after it)
        self.relu: _ReluLink | None = None  # the linear layer this one's output feeds through ReLU
        # (parameter, part, squared norms or None) once built, possibly during the backward pass
        # part None: summed at once under per-layer clipping (only its squared norms are kept)
        self.pairs: list[tuple[nn.Parameter, Part | None, torch.Tensor | None]] | None = None

    def release(self) -> None:
        """Drop the kept inputs and gradients (the parts hold what they need)."""
        self.args, self.kwargs, self.grads, self.capture = (), {}, [], None

    def check_unmodified(self) -> None:
        """The kept inputs must not have been changed in place since the forward call."""
        if _versions(self.args) + _versions(self.kwargs) != self.versions:
            raise UnsafeInput(
                f"an input of {type(self.module).__name__} was modified in place after its forward "
                "call; its per-sample gradients cannot be computed (use an out-of-place operation)"
            )


class _Tap(torch.autograd.Function):
    """``x`` itself, made part of the graph: its gradient passes through unchanged, the anchor's is
    None. No copy and no pass over ``x`` in either direction (``x + anchor`` costs one of each, a
    copy of the first layer's output and a reduction of its gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        ctx.mark_dirty(x)  # x's history becomes this node (it has none: nothing in it needs grad)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _into_graph(t: torch.Tensor, anchor: torch.Tensor, inputs: tuple) -> torch.Tensor:
    """A module output that needs no gradient (its inputs need none and its parameters were switched
    off), made to need one so that a hook sees its gradient: in place where ``t`` is a fresh tensor
    of its own (not a view, sharing no storage with an input), else ``t + 0``."""
    shared = t._base is not None or any(
        isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
        for x in _flatten(inputs)[0]
    )
    if shared or t.is_inference() or torch.is_inference_mode_enabled():
        return t + anchor.to(t.dtype)
    return _Tap.apply(t, anchor)


class _ReluLink:
    """A linear layer ``l2`` whose input is ``relu(output of this call)`` and nothing else's.

    Set up in ``l2``'s forward: ``l2`` is given an alias of the ReLU output, and two gradient hooks
    compare what reaches the alias (``l2``'s contribution) with the total that reaches the ReLU
    output. Only if they are one tensor (no other consumer added anything) is the first layer's
    output gradient recomputable from ``l2``'s part (:class:`gaussdp.torch._parts.ReluFedPart`).
    """

    __slots__ = ("contribution", "l2", "sole")

    def __init__(self, l2: _Call) -> None:
        self.l2 = l2
        self.contribution: torch.Tensor | None = None
        self.sole = False

    def keep(self, grad: torch.Tensor) -> None:
        self.contribution = grad

    def compare(self, total: torch.Tensor) -> None:
        mine, self.contribution = self.contribution, None
        self.sole = mine is not None and same_elements(total, mine)


def _compact(part: Part) -> Part:
    """A linear part whose per-sample gradients are the cheaper form keeps only those."""
    if isinstance(part, LinearPart) and part.a.shape[1] > 1 and part.materialises():
        return DensePart(part.materialise(), part.shape)
    return part


_TENSOR, _TUPLE = object(), object()  # specs of the fast paths of _flatten


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    """``tree_flatten``, with fast paths for what most layers take and return: a tensor, a tuple of
    tensors, no keyword arguments (pytree costs tens of microseconds per call, per layer)."""
    if isinstance(tree, torch.Tensor):
        return [tree], _TENSOR
    if type(tree) is tuple and all(isinstance(t, torch.Tensor) for t in tree):
        return list(tree), _TUPLE
    if type(tree) is dict and not tree:
        return [], None
    return tree_flatten(tree)


def _unflatten(flat: list[Any], spec: Any) -> Any:
    if spec is _TENSOR:
        return flat[0]
    if spec is _TUPLE:
        return tuple(flat)
    if spec is None:
        return {}
    return tree_unflatten(flat, spec)


def _versions(tree: Any) -> list[int]:
    return [t._version for t in _flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _detach(tree: Any) -> Any:
    flat, spec = _flatten(tree)
    return _unflatten([t.detach() if isinstance(t, torch.Tensor) else t for t in flat], spec)


def _split_self_attention(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> Any:
    """Batch-first self-attention gets its input as three aliases, stored position-major: the same
    values, as a ``(B, T, E)`` view of ``(T, B, E)`` storage (one copy, unless already so).

    Given one tensor as query, key and value, ``nn.MultiheadAttention`` runs one packed projection
    to ``(T, B, 3E)`` and selects q, k and v from it; backward then pads each of their gradients
    with zeros to the packed shape and adds the three: passes over three times the packed gradient
    to form it. Given three aliases, it runs the projections of the weight's three row chunks (the
    same values up to float rounding), and each gradient stays ``(T, B, E)``, kept as it arrives
    (about 4% off the step of the encoder benchmark, ``benchmarks/bench_dpsgd.py`` (b)).
    Position-major: the attention works in ``(T, B, E)`` and transposes its input to get there;
    with the weights switched out of autograd (see the module docstring), ``matmul`` does not fold
    a transposed view into one GEMM but runs ``T`` small ones (``bmm``), about 15% slower.
    """
    if not (module.batch_first and module._qkv_same_embed_dim and len(args) >= 3):
        return None
    x = args[0]
    if not isinstance(x, torch.Tensor) or x is not args[1] or x is not args[2] or x.dim() != 3:
        return None
    if not x.transpose(0, 1).is_contiguous():
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    return (x, x.view_as(x), x.view_as(x), *args[3:]), kwargs


class _Hook:
    """A module hook of the clipper. A copy of the module (``copy.deepcopy``, pickling) gets an
    inert one: the copy is an ordinary model, since its parameters are not the ones this clipper
    clips and the optimizer steps (copying the clipper along would copy the optimizer too)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any] | None) -> None:
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return None if self.fn is None else self.fn(*args)

    def __deepcopy__(self, memo: dict) -> _Hook:
        return _Hook(None)

    def __reduce__(self) -> tuple:
        return (_Hook, (None,))


def _owners(root: nn.Module) -> dict[nn.Module, dict[str, nn.Parameter]]:
    """The modules whose calls give per-sample gradients, each with the parameters it owns.

    A parameter is owned by the modules that hold it (see :func:`owned_parameters`), except one
    that a descendant also holds: a layer that re-registers its submodules' parameters under its
    own names (Opacus's ``DPLSTM`` holds every weight of its inner ``RNNLinear`` maps) does not use
    them itself, and two owners would count every per-sample gradient twice. Unrelated holders
    (tied weights: an embedding and an output layer) both own it; their parts are combined.
    """
    found: dict[nn.Module, dict[str, nn.Parameter]] = {}
    skip: set[int] = set()
    for _, m in root.named_modules(remove_duplicate=False):
        if id(m) in skip or m in found:
            continue
        if isinstance(m, nn.MultiheadAttention):
            skip.update(id(s) for s in m.modules() if s is not m)
        owned = dict(owned_parameters(m))
        if owned:
            found[m] = owned
    holders: dict[int, list[nn.Module]] = {}
    for m, owned in found.items():
        for p in owned.values():
            holders.setdefault(id(p), []).append(m)
    drop: dict[nn.Module, set[int]] = {}
    below: dict[nn.Module, set[int]] = {}  # descendants, only of modules sharing a parameter
    for pid, ms in holders.items():
        for m in ms if len(ms) > 1 else ():
            if m not in below:
                below[m] = {id(s) for s in m.modules() if s is not m}
            if any(id(other) in below[m] for other in ms if other is not m):
                drop.setdefault(m, set()).add(pid)
    for m, pids in drop.items():
        found[m] = {n: p for n, p in found[m].items() if id(p) not in pids}
    return {m: owned for m, owned in found.items() if owned}


def _is_released(grad: torch.Tensor, released: tuple[torch.Tensor, int] | None) -> bool:
    """``grad`` is the noisy gradient the optimizer wrote, unchanged since (no plain gradient added)."""
    return released is not None and grad is released[0] and grad._version == released[1]


def _is_rnn_linear(module: nn.Module) -> bool:
    """Opacus's ``RNNLinear``: the maps of its DP RNNs, applied to one time step ``(B, D)`` at a
    time whatever the RNN's ``batch_first`` (told by name: Opacus is not a dependency)."""
    cls = type(module)
    return cls.__name__ == "RNNLinear" and cls.__module__.startswith("opacus.")


def _to_batch_first(module: nn.Module, args: tuple, grads: list) -> tuple[tuple, list]:
    """Inputs and output gradients of a call made with the batch in dimension 1, batch-first.

    A fused RNN says where its batch is itself (its rule reads ``batch_first``), and Opacus's
    ``RNNLinear`` always gets the batch in dimension 0: those are left as they are.
    """
    x = args[0] if args else None
    if isinstance(module, nn.RNNBase) or _is_rnn_linear(module):
        return args, grads
    if isinstance(module, nn.Linear) and isinstance(x, torch.Tensor) and x.dim() >= 3:
        pass
    elif isinstance(module, nn.Embedding) and isinstance(x, torch.Tensor) and x.dim() >= 2:
        pass
    else:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else None
        raise UnsafeInput(
            f"batch_first=False: {type(module).__name__} (input shape {shape}) has no rule for the "
            "batch in dimension 1; supported are Linear with inputs of 3 or more dimensions, "
            "Embedding, nn.LSTM/GRU/RNN and Opacus's DPLSTM/DPGRU/DPRNN (or make the model "
            "batch-first and use batch_first=True)"
        )
    args = (x.transpose(0, 1), *args[1:])
    grads = [g.transpose(0, 1) if g is not None else None for g in grads]
    return args, grads


class PerSampleClipper:
    """Hooks on ``module`` that leave, after each backward pass, the per-sample-clipped gradient sums.

    Args:
        module: the model; hooks are registered on its submodules, the module itself is unchanged.
        max_grad_norm: ``"flat"``: the clip bound ``C`` on each sample's gradient over all trainable
            parameters together. ``"per_layer"``: one bound per trainable parameter (in
            ``module.parameters()`` order), or one number ``C`` shared as ``C / sqrt(n)`` by the
            ``n`` parameters; either way each sample's whole gradient has norm at most
            ``sqrt(sum C_p^2)``, which is :attr:`max_grad_norm` (the sensitivity the noise uses).
        loss_reduction: ``"mean"`` if the loss averages over the batch (the output gradients are then
            rescaled by the batch size to recover each sample's gradient), ``"sum"`` otherwise.
        clipping: ``"flat"`` (default; Abadi et al. 2016) or ``"per_layer"`` (McMahan et al. 2018):
            each parameter's per-sample gradient is clipped to its own bound, so its clipped sum is
            formed as soon as its layer's backward is done and nothing waits for the end of the pass
            (peak memory close to non-private training; tied or reused parameters still wait).
        batch_first: False: the batch is dimension 1 of every layer input (as Opacus's
            ``batch_first=False``); supported for ``Linear`` with inputs of 3 or more dimensions and
            ``Embedding``, whose inputs and output gradients are transposed to batch-first before
            their rule runs, ``nn.LSTM``/``GRU``/``RNN`` (which say where their batch is by their
            own ``batch_first``, either way) and Opacus's ``DPLSTM``/``DPGRU``/``DPRNN`` (whose
            maps get one time step ``(B, D)`` at a time); any other layer is refused at its first
            backward pass, by name.

    Attributes:
        keep_grad_sample: when True, each trainable ``p.grad_sample`` is set after each backward
            pass to its per-sample gradients ``(B, *p.shape)``, unclipped (as Opacus's).
        unclipped: samples whose gradient norm was within the bound since the last reset (the
            count that adaptive clipping releases, noised).
        released: the gradients the optimizer's last step wrote into ``p.grad`` (with their
            versions): left there as in Opacus, and not mistaken for a plain gradient.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        max_grad_norm: float | Sequence[float],
        loss_reduction: str = "mean",
        clipping: str = "flat",
        batch_first: bool = True,
    ) -> None:
        check_choice("loss_reduction", loss_reduction, ("mean", "sum"))
        check_choice("clipping", clipping, ("flat", "per_layer"))
        # modules that mix samples (BatchNorm) or keep unnoised aggregates of the data are refused
        # whether or not they own trainable parameters: the hooks below see only those that do
        ModuleValidator.validate(module, strict=True)
        self.module = module
        self.loss_reduction = loss_reduction
        self.clipping = clipping
        if not isinstance(batch_first, bool):
            raise TypeError(f"batch_first must be a bool, got batch_first={batch_first!r}")
        self.batch_first = batch_first
        self.keep_grad_sample = False
        self.unclipped = 0
        self.released: dict[nn.Parameter, tuple[torch.Tensor, int]] = {}
        self.names = {id(p): n for n, p in module.named_parameters() if p.requires_grad}
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._bounds: dict[nn.Parameter, float] = {}
        if clipping == "flat":
            self.max_grad_norm = check_positive("max_grad_norm", max_grad_norm)
        else:
            if isinstance(max_grad_norm, Sequence):
                if len(max_grad_norm) != len(self.params):
                    raise InvalidParameter(
                        f"max_grad_norm has {len(max_grad_norm)} bounds for {len(self.params)} trainable "
                        "parameters (per_layer clipping needs one per parameter, or one number)"
                    )
                bounds = [check_positive(f"max_grad_norm[{i}]", c) for i, c in enumerate(max_grad_norm)]
            else:
                c = check_positive("max_grad_norm", max_grad_norm)
                bounds = [c / math.sqrt(max(1, len(self.params)))] * len(self.params)
            self._bounds = dict(zip(self.params, bounds, strict=True))
            self.max_grad_norm = math.sqrt(sum(b * b for b in bounds))
        self.poisoned = False  # a backward pass failed half-way: no step until the sums are reset
        self._owned: dict[nn.Module, dict[str, nn.Parameter]] = {}
        self._handles: list[Any] = []
        self._calls: list[_Call] = []
        self._enabled = True
        self._queued = False
        self._batch: int | None = None
        self._link_pending: tuple[nn.Module, _Call, torch.Tensor] | None = None
        self._uses: dict[nn.Parameter, int] | None = None
        self._anchor = torch.zeros((), requires_grad=True)
        self.summed: dict[nn.Parameter, torch.Tensor] = {}
        # the sums are kept multiplied by this (the optimizer sets 1 / expected batch size, which
        # saves a pass over every gradient at each step)
        self.sum_scale = 1.0
        # set by the optimizer: a parameter's sum buffer pre-filled with the step's noise, drawn when
        # its first clipped sum is formed (so the GEMM adds into it), or None; ``noised`` records the
        # noise std already in each sum
        self.prefill: Callable[[nn.Parameter], tuple[torch.Tensor, float] | None] | None = None
        self.noised: dict[nn.Parameter, float] = {}
        self.samples = 0  # samples clipped since the last reset (all micro-batches)
        self.last_norms: torch.Tensor | None = None
        self._probe: Any = None  # the independence probe's record while it runs (see probing())
        self._register(module)

    # ----------------------------------------------------------------------------------- hooks
    def _register(self, root: nn.Module) -> None:
        covered: set[int] = set()
        for m, owned in _owners(root).items():
            covered.update(id(p) for p in owned.values())
            self._owned[m] = owned
            self._handles.append(m.register_forward_pre_hook(_Hook(self._pre), with_kwargs=True))
            self._handles.append(
                m.register_forward_hook(_Hook(self._post), with_kwargs=True, always_call=True)
            )
        missing = [self.names[id(p)] for p in self.params if id(p) not in covered]
        if missing:  # pragma: no cover - every parameter belongs to some module
            raise InvalidParameter(f"no module owns the trainable parameters {missing}")

    def remove(self) -> None:
        """Remove every hook; the module is exactly as before."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        old, self._enabled = self._enabled, False
        try:
            yield
        finally:
            self._enabled = old

    def _active(self) -> bool:
        return self._enabled and torch.is_grad_enabled()

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if not self._active():
            return None
        for p in self._owned[module].values():
            p.requires_grad_(False)
        if isinstance(module, nn.Linear) and self.clipping == "flat" and args:
            return self._alias_relu_input(module, args, kwargs)
        if isinstance(module, nn.MultiheadAttention):
            return _split_self_attention(module, args, kwargs)
        # Position ids of shape (1, T) broadcast against a batch of B (Hugging Face GPT-2): the
        # output gradient would arrive summed over the batch, so per-sample gradients would be lost.
        # The lookup is made per sample instead (an expand, no copy), as if the ids were expanded.
        if isinstance(module, nn.Embedding) and self._batch not in (None, 1) and args:
            idx = args[0]
            if isinstance(idx, torch.Tensor) and idx.dim() >= 1 and idx.shape[0] == 1:
                return (idx.expand(self._batch, *idx.shape[1:]), *args[1:]), kwargs
        return None

    def _alias_relu_input(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """If the input is ``relu(y)`` for the output ``y`` of a linear layer hooked here, give this
        layer an alias of it, to tell its gradient contribution from others' (see :class:`_ReluLink`)."""
        x = args[0]
        node = getattr(x, "grad_fn", None)
        if node is None or node.name() != "ReluBackward0":
            return None
        src = node.next_functions[0][0]
        l1 = next((c for c in reversed(self._calls[-4:]) if c.out_node is src), None)
        if l1 is None or l1.relu is not None:
            return None
        w1 = getattr(l1.module, "weight", None)
        if not isinstance(w1, torch.Tensor) or x.numel() <= w1.numel():
            return None  # the gradient to recompute would be no larger than the weight: keep it
        self._link_pending = (module, l1, x)
        return (x.view_as(x), *args[1:]), kwargs

    def _post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if not self._active():
            return None
        for p in self._owned[module].values():
            p.requires_grad_(True)
        if output is None:  # the forward raised (this hook always runs): nothing to keep
            return None
        flat, spec = _flatten(output)
        call = _Call(module, _detach(args), _detach(kwargs), len(flat))
        if isinstance(module, nn.MultiheadAttention):
            call.capture = mha_capture(module, args, kwargs, output)
            if call.capture is not None:
                call.capture.on_ready = lambda: self._maybe_early(call)
        changed = False
        for i, t in enumerate(flat):
            if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
                continue
            if not t.requires_grad:
                t = _into_graph(t, self._anchor, call.args)
                flat[i], changed = t, True
            t.register_hook(self._grad_hook(call, i))
            call.pending += 1
        if isinstance(module, nn.Linear):
            call.out_node = flat[0].grad_fn
            pending, self._link_pending = self._link_pending, None
            if pending is not None and pending[0] is module:
                link = _ReluLink(call)
                pending[1].relu = link
                args[0].register_hook(link.keep)  # the alias: this layer's contribution alone
                pending[2].register_hook(link.compare)  # the ReLU output: every consumer's total
        if not self._calls:  # the first call of a forward pass sets its batch size
            # (an EmbeddingBag's 1-D input holds every bag's ids: its output has one row per bag)
            source = flat if isinstance(module, nn.EmbeddingBag) else _flatten(args)[0]
            first = next((t for t in source if isinstance(t, torch.Tensor)), None)
            axis = 1 if isinstance(module, nn.RNNBase) and not module.batch_first else 0
            self._batch = int(first.shape[axis]) if first is not None and first.dim() > axis else None
            if not self.batch_first:
                self._batch = None  # no batch-first broadcast to undo
        self._calls.append(call)
        return _unflatten(flat, spec) if changed else None

    def _grad_hook(self, call: _Call, i: int) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if call.used:
                raise PrivacyError(
                    "a second backward pass reached outputs whose samples were already clipped; "
                    "each sample's gradient may be clipped once per step (sum the losses instead)"
                )
            call.grads[i] = grad.detach()
            call.reached = True
            call.pending -= 1
            if not self._queued:
                self._queued = True
                self._uses = None
                torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
            self._maybe_early(call)

        return hook

    def _maybe_early(self, call: _Call) -> None:
        """Build a call's parts as soon as all its gradients are in, during the backward pass.

        The rule's inputs (layer inputs, output gradients) can then be freed at once where the parts
        keep less (LayerNorm, biases and materialised layers keep only per-sample gradients), and
        the squared norms of a parameter used by this call alone are computed now, while its
        tensors are fresh in cache. Parameters used by several calls (tied weights, a reused layer)
        wait for the end of the pass: their parts must be combined before any norm is taken.
        """
        if call.pending or call.pairs is not None or call.used:
            return
        if call.capture is not None and call.capture.grads is None:
            return  # the attention's q/k/v gradients arrive after its output's
        grads = [g for g in call.grads if g is not None]
        if not grads or any(g.dim() > 0 and g.shape[0] == 0 for g in grads):
            return  # an empty batch: handled at the end of the pass
        if self._uses is None:  # calls per parameter in the forward passes not yet processed
            self._uses = {}
            for c in self._calls:
                if c.pairs is None:
                    for q in self._owned[c.module].values():
                        self._uses[q] = self._uses.get(q, 0) + 1
        try:
            link = call.relu
            pairs = self._build(call)
            if link is not None and link.sole and not self._kept_anyway(call):
                pairs = self._relu_fed(call.module, pairs, link.l2)
            call.pairs = []
            for p, part in pairs:
                if self._uses.get(p, 0) != 1 or isinstance(part, ReluFedPart):
                    call.pairs.append((p, part, None))  # norms at the end of the pass
                    continue
                sq = part.sq_norms()
                if self.clipping == "per_layer":  # its own bound: summed now, nothing kept
                    self._sum_layer(p, part, sq)
                    call.pairs.append((p, None, sq))
                else:
                    call.pairs.append((p, part, sq))
        except BaseException:
            # the failed pass's end-of-pass callback never runs: the next pass must queue its own
            self.poisoned, self._queued = True, False
            raise

    def _kept_anyway(self, call: _Call) -> bool:
        """Whether ``call``'s recomputable output gradient is kept instead: it is the last of this
        pass's to arrive (the first in forward order) while another one is recomputed.

        Recomputing costs one GEMM per layer at the end of the pass; keeping costs the gradient's
        memory from its arrival until then. The last to arrive is held for the shortest stretch of
        the backward pass, so it is the cheapest to keep. Measured on the 2-layer encoder benchmark
        (``benchmarks/bench_dpsgd.py`` (b), allocator events): half the recomputation time, at the
        same peak as with both recomputed, 68.96 MiB above the step's start (74.8 with neither;
        plain PyTorch 65.2). With a single such layer it is recomputed: keeping it would keep them all.
        """
        links = [c for c in self._calls if c.relu is not None]
        return (
            len(links) > 1 and links[0] is call and any(c.relu is not None and c.relu.sole for c in links[1:])
        )

    @staticmethod
    def _relu_fed(
        module: nn.Module, pairs: list[tuple[nn.Parameter, Part]], l2: _Call
    ) -> list[tuple[nn.Parameter, Part]]:
        """Swap the weight part of a linear layer whose output feeds only ``relu`` then ``l2`` for a
        :class:`ReluFedPart` where ``l2``'s part keeps its input and output gradient anyway (the
        link exists only where that gradient is larger than the weight, see
        :meth:`_alias_relu_input`). The output gradient is then freed as soon as autograd is done."""
        w2 = getattr(l2.module, "weight", None)
        nxt = next(
            (q for p, q, _ in l2.pairs or () if p is w2 and type(q) is LinearPart and q._ps is None),
            None,
        )
        if nxt is None or w2 is None:
            return pairs
        out = []
        for p, part in pairs:
            if p is getattr(module, "weight", None) and type(part) is LinearPart and part._ps is None:
                part = ReluFedPart(part.a, nxt.a, nxt.g, w2.detach(), part.shape)
            out.append((p, part))
        return out

    # ------------------------------------------------------------------------------ processing
    def _after_backward(self) -> None:
        self._queued = False
        self._uses = None
        done = [c for c in self._calls if c.reached]
        self._calls = [c for c in self._calls if not c.reached]
        for c in done:
            c.used = True
        try:
            self.check_no_plain_gradients()
            if done:
                self._clip(done)
        except BaseException:
            self.poisoned = True
            raise
        finally:
            for c in done:
                c.release()
                c.pairs = None

    def check_no_plain_gradients(self) -> None:
        """Fail closed if any trainable parameter got an ordinary (unclipped) ``.grad``, or if a
        backward pass failed after some sums were formed."""
        if self.poisoned:
            raise PrivacyError(
                "a backward pass failed after per-sample sums were started; call zero_grad() before "
                "the next step (nothing was released)"
            )
        leaked = [
            self.names[id(p)]
            for p in self.params
            if p.grad is not None and not _is_released(p.grad, self.released.get(p))
        ]
        if leaked:
            for p in self.params:
                p.grad = None
            raise PrivacyError(
                f"trainable parameters {leaked} received gradients outside the forward of the module "
                "that owns them, so they cannot be clipped per sample; nothing was accumulated"
            )

    def _build(self, c: _Call) -> list[tuple[nn.Parameter, Part]]:
        """The per-parameter parts of one call (its kept inputs and gradients are then released)."""
        c.check_unmodified()
        owned = self._owned[c.module]
        if not self.batch_first:
            c.args, c.grads = _to_batch_first(c.module, c.args, c.grads)
        if c.capture is not None and c.capture.grads is not None:
            pairs = mha_captured_parts(c.module, c.args, c.kwargs, c.grads, owned, c.capture)
        else:
            rule = rule_for(c.module)
            if rule is None:
                pairs = vmap_parts(c.module, c.args, c.kwargs, c.grads, owned, self.disabled)
            else:
                pairs = rule(c.module, c.args, c.kwargs, c.grads, owned)
        c.release()
        return [(p, _compact(part)) for p, part in pairs]

    def _parts(
        self, calls: list[_Call]
    ) -> tuple[int, dict[nn.Parameter, tuple[Part | None, torch.Tensor | None]]]:
        by_param: dict[nn.Parameter, list[tuple[Part | None, torch.Tensor | None]]] = {}
        sizes = set()
        for c in calls:
            pairs = c.pairs if c.pairs is not None else [(p, q, None) for p, q in self._build(c)]
            c.pairs = None
            for p, part, sq in pairs:
                # a pair without a part was summed at once and always carries its squared norms
                sizes.add(part.batch_size if part is not None else int(cast(torch.Tensor, sq).shape[0]))
                by_param.setdefault(p, []).append((part, sq))
        if len(sizes) > 1:
            raise UnsafeInput(
                f"layers saw different batch sizes {sorted(sizes)} in one backward pass; per-sample "
                "clipping needs the batch in dimension 0 of every layer input (batch_first=True; "
                "a PackedSequence shrinks the batch step by step: pad and mask instead)"
            )
        b = sizes.pop() if sizes else 0
        out: dict[nn.Parameter, tuple[Part | None, torch.Tensor | None]] = {}
        for p, items in by_param.items():
            # a norm computed early is kept only for a parameter with a single part; a part of None
            # was summed already (per-layer clipping)
            if len(items) == 1:
                out[p] = items[0]
            else:
                out[p] = (combine([part for part, _ in items if part is not None]), None)
        return b, out

    def _clip(self, calls: list[_Call]) -> None:
        if all(
            c.pairs is None and all(g.dim() > 0 and g.shape[0] == 0 for g in c.grads if g is not None)
            for c in calls
        ):
            return  # an empty (Poisson) batch contributes nothing; the step still adds noise
        b, built = self._parts(calls)
        if b == 0:
            return
        sq = None
        parts: dict[nn.Parameter, Part] = {}
        for p, (part, early) in built.items():
            if part is None and early is None:
                raise RuntimeError(f"internal: parameter {tuple(p.shape)} has neither a part nor its norms")
            s = early if early is not None else part.sq_norms()  # type: ignore[union-attr]
            sq = s if sq is None else sq + s.to(sq.dtype)
            if part is None:
                continue
            if self.clipping == "per_layer":
                self._sum_layer(p, part, s)
            else:
                parts[p] = part
        del built
        if sq is None:
            raise RuntimeError("internal: a pass ended with no per-sample norms")
        scale = self._scale(b)
        norms = sq.sqrt() * scale
        if not bool(torch.isfinite(norms).all()):
            raise UnsafeInput("per-sample gradient norms contain NaN or Inf; nothing was accumulated")
        # w_i = min(1, C / ||g_i||) times the undoing of the mean's 1/B; 1e-6 keeps ||w_i g_i|| <= C.
        factor = (self.max_grad_norm / (norms + 1e-6)).clamp(max=1.0)
        self.unclipped += int((factor >= 1.0).sum())
        w = factor * (scale * self.sum_scale)
        # Each part is dropped once used, so what it stored is freed while the sums are allocated.
        # Parts that free the most per byte of sum they allocate go first: lowest peak memory.
        for p in sorted(parts, key=lambda q: -parts[q].stored() / q.numel()):
            self._accumulate(p, parts.pop(p), w)
        self.samples += b
        self.last_norms = norms.detach()
        if self._probe is not None:
            self._probe.rows, self._probe.norms = b, norms.detach().clone()

    def _scale(self, b: int) -> float:
        """Per-sample gradients are ``scale`` times the output gradients (the mean's 1/B undone)."""
        return float(b) if self.loss_reduction == "mean" else 1.0

    def _accumulate(self, p: nn.Parameter, part: Part, w: torch.Tensor) -> None:
        if self._probe is not None:  # the probe's random combination of the clipped rows, kept apart
            s = part.weighted_sum(w * self._probe.weights(w.shape[0], w))
            prev = self._probe.sums.get(p)
            self._probe.sums[p] = s if prev is None else prev + s
            return
        if self.keep_grad_sample:  # asked for: materialised, unclipped, as Opacus's grad_sample
            # Opacus's attribute, set on the Parameter at run time (not in torch's stubs)
            p.grad_sample = (part.materialise() * self._scale(part.batch_size)).to(p.dtype)  # type: ignore[attr-defined]
        prev = self.summed.get(p)
        if prev is None and self.prefill is not None:
            filled = self.prefill(p)
            if filled is not None:
                prev, self.noised[p] = filled
                self.summed[p] = prev
        if prev is None:
            self.summed[p] = part.weighted_sum(w)
        else:
            part.weighted_sum(w, out=prev)  # in place: no temporary of its size

    def _sum_layer(self, p: nn.Parameter, part: Part, sq: torch.Tensor) -> None:
        """Per-layer clipping: ``p``'s per-sample gradients clipped to its own bound, then summed."""
        scale = self._scale(part.batch_size)
        norms = sq.sqrt() * scale
        if not bool(torch.isfinite(norms).all()):
            raise UnsafeInput(
                f"per-sample gradient norms of {self.names[id(p)]} contain NaN or Inf; step refused"
            )
        w = (self._bounds[p] / (norms + 1e-6)).clamp(max=1.0) * (scale * self.sum_scale)
        self._accumulate(p, part, w)

    @contextlib.contextmanager
    def probing(self) -> Iterator[Any]:
        """A backward pass that measures instead of accumulating (the independence probe of
        ``make_private``, :mod:`gaussdp.torch._probe`): the rows each layer saw, the per-row norms,
        and per parameter a fixed random combination of the clipped rows other than row 0, in the
        record yielded. No noise is drawn and no sum is kept; the clipper is as before afterwards."""
        from gaussdp.torch._probe import ProbeRecord

        saved = (self.keep_grad_sample, self.prefill, self.sum_scale, self.last_norms, self.released)
        self.reset()
        self.keep_grad_sample, self.prefill, self.sum_scale = False, None, 1.0
        self._probe = ProbeRecord()
        try:
            yield self._probe
        finally:
            self._probe = None
            self.reset()
            self.keep_grad_sample, self.prefill, self.sum_scale, self.last_norms, self.released = saved

    def reset(self) -> None:
        """Forget accumulated sums and pending calls (after an optimizer step)."""
        self.summed = {}
        self.noised = {}
        self.samples = 0
        self.unclipped = 0
        self._calls = []
        self._uses = None
        self.poisoned = False
        self._queued = False
        self._link_pending = None
