"""Per-layer rules: from a module call's stored input and output gradient to per-parameter parts.

Each rule handles the parameters a module *owns* (``recurse=False``), except
``nn.MultiheadAttention`` whose projection weights are read by ``F.multi_head_attention_forward``
without calling ``out_proj``, so it owns every parameter under it, and except a parameter that a
descendant also holds (Opacus's DP RNNs re-register their inner maps' weights): the descendant owns
it (``gaussdp.torch._clipper._owners``). Layers without a closed-form rule
(and unusual configurations of known ones) use :func:`vmap_parts`, which recomputes the module per
sample with ``torch.func`` and materialises that module's per-sample gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from gaussdp.errors import InvalidParameter, UnsafeInput
from gaussdp.torch._mha import mha_rule, mha_supported
from gaussdp.torch._parts import (
    ConvPart,
    DensePart,
    EmbeddingPart,
    LinearPart,
    Part,
    acc_dtype,
)

__all__ = [
    "Rule",
    "RuleHandle",
    "owned_parameters",
    "register_rule",
    "rule_for",
]

Rule = Callable[[nn.Module, tuple, dict, list, dict], list[tuple[nn.Parameter, Part]]]


def _trainable(module: nn.Module, recurse: bool) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in module.named_parameters(recurse=recurse) if p.requires_grad]


def owned_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters whose per-sample gradients are computed at ``module``'s calls."""
    return _trainable(module, recurse=isinstance(module, nn.MultiheadAttention))


def _first_grad(grads: list) -> torch.Tensor | None:
    return grads[0] if grads else None


def _linear(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
    x, g = args[0], grads[0]
    if g is None:
        return []
    out: list[tuple[nn.Parameter, Part]] = []
    transposed = not isinstance(module, nn.Linear)  # Hugging Face Conv1D stores (in, out)
    if "weight" in owned:
        out.append((owned["weight"], LinearPart(x, g, module.weight.shape, transposed)))
    if "bias" in owned:
        gb = g if g.dim() == 2 else g.reshape(g.shape[0], -1, g.shape[-1]).sum(1)  # a view when T=1
        out.append((owned["bias"], DensePart(gb, module.bias.shape)))
    return out


def _embedding(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
    g = grads[0]
    if g is None or "weight" not in owned:
        return []
    idx = args[0]
    return [(owned["weight"], EmbeddingPart(idx, g, module.weight.shape, module.padding_idx))]


def _embedding_bag(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
    """``nn.EmbeddingBag`` (``mode="sum"`` or ``"mean"``), one bag per sample: bag ``i``'s gradient
    of row ``v`` is ``g_i`` times the weights of its entries equal to ``v`` (``per_sample_weights``,
    or one over the bag's size for the mean; ``padding_idx`` entries count for nothing). Bags come
    as rows of a 2-D input or as ``offsets`` into a 1-D one."""
    g = grads[0]
    if g is None or "weight" not in owned:
        return []
    m: nn.EmbeddingBag = module
    bound = dict(zip(("input", "offsets", "per_sample_weights"), args, strict=False))
    bound.update(kwargs)
    idx, offsets, psw = bound["input"], bound.get("offsets"), bound.get("per_sample_weights")
    bags = g.shape[0]
    if idx.dim() == 2:
        sample = torch.arange(bags, device=idx.device).repeat_interleave(idx.shape[1])
    else:
        offsets = cast(torch.Tensor, offsets).to(idx.device)  # 1-D input: EmbeddingBag required offsets
        ends = (
            offsets[1 : bags + 1]
            if m.include_last_offset
            else torch.cat((offsets[1:], offsets.new_tensor([idx.numel()])))
        )
        counts = ends - offsets[:bags]
        sample = torch.arange(bags, device=idx.device).repeat_interleave(counts)
        idx = idx[int(offsets[0]) : int(offsets[0]) + sample.numel()]
        psw = None if psw is None else psw[int(offsets[0]) : int(offsets[0]) + sample.numel()]
    idx = idx.reshape(-1)
    rows = g.index_select(0, sample)
    if psw is not None:
        rows = rows * psw.reshape(-1, 1).to(rows.dtype)
    if m.padding_idx is not None:
        keep = idx != m.padding_idx
        idx, sample, rows = idx[keep], sample[keep], rows[keep]
    if m.mode == "mean":
        size = torch.bincount(sample, minlength=bags).clamp(min=1).to(rows.dtype)
        rows = rows / size.index_select(0, sample).unsqueeze(1)
    return [(owned["weight"], EmbeddingPart.from_rows(idx, sample, rows, bags, m.weight.shape))]


def _conv(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
    """``nn.Conv1d/2d/3d`` (any stride, padding, dilation, groups, padding mode): a
    :class:`ConvPart` of the input and output gradient (the module's own padding applied first
    where it is not symmetric zeros: ``padding="same"`` with an even kernel, or ``padding_mode``
    reflect, replicate, circular)."""
    x, g = args[0], grads[0]
    if g is None:
        return []
    m: nn.modules.conv._ConvNd = module
    nd = len(m.kernel_size)
    if x.dim() == nd + 1:  # unbatched input: a batch of one
        x, g = x.unsqueeze(0), g.unsqueeze(0)
    if isinstance(m.padding, str) or m.padding_mode != "zeros":
        mode = "constant" if m.padding_mode == "zeros" else m.padding_mode
        x = F.pad(x, m._reversed_padding_repeated_twice, mode=mode)
        padding: tuple = (0,) * nd
    else:
        padding = tuple(m.padding)
    out: list[tuple[nn.Parameter, Part]] = []
    if "weight" in owned:
        part = ConvPart(
            x, g, m.weight.shape, stride=m.stride, padding=padding, dilation=m.dilation, groups=m.groups
        )
        out.append((owned["weight"], part))
    if "bias" in owned:
        out.append((owned["bias"], DensePart(g.flatten(2).sum(2), owned["bias"].shape)))
    return out


def _conv_transpose(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
    """``nn.ConvTranspose1d/2d/3d``: its weight gradient is that of the convolution it is the
    adjoint of, which reads the output gradient (same stride, padding, dilation, groups) and whose
    output gradient is the input, so a :class:`ConvPart` with the two roles swapped."""
    x, g = args[0], grads[0]
    if g is None:
        return []
    m: nn.modules.conv._ConvTransposeNd = module
    padding = cast(tuple[int, ...], m.padding)  # a transposed convolution has no string padding
    nd = len(m.kernel_size)
    if x.dim() == nd + 1:
        x, g = x.unsqueeze(0), g.unsqueeze(0)
    out: list[tuple[nn.Parameter, Part]] = []
    if "weight" in owned:
        part = ConvPart(
            g, x, m.weight.shape, stride=m.stride, padding=padding, dilation=m.dilation, groups=m.groups
        )
        reads = [
            (n + 2 * p - d * (k - 1) - 1) // s + 1
            for n, k, s, p, d in zip(g.shape[2:], m.kernel_size, m.stride, padding, m.dilation, strict=True)
        ]
        if reads != list(x.shape[2:]):  # output_padding >= stride: positions the adjoint never reads
            raise UnsafeInput(
                f"{type(m).__name__} with output_padding={m.output_padding} >= stride={m.stride} "
                "has no per-sample rule"
            )
        out.append((owned["weight"], part))
    if "bias" in owned:
        out.append((owned["bias"], DensePart(g.flatten(2).sum(2), owned["bias"].shape)))
    return out


def _norm_parts(owned, x_hat, g, n_feature_dims, w_shape, b_shape):  # type: ignore[no-untyped-def]
    """Per-sample gradients of an elementwise affine ``y = w * x_hat + b`` (broadcast over the rest)."""
    out: list[tuple[nn.Parameter, Part]] = []
    b = g.shape[0]
    if "weight" in owned:
        ps = (x_hat.to(g.dtype) * g).reshape(b, -1, *w_shape).sum(1)
        out.append((owned["weight"], DensePart(ps, w_shape)))
    if "bias" in owned:
        out.append((owned["bias"], DensePart(g.reshape(b, -1, *b_shape).sum(1), b_shape)))
    return out


def _layer_norm(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
    x, g = args[0], grads[0]
    if g is None:
        return []
    shape = tuple(module.normalized_shape)
    if isinstance(module, nn.LayerNorm):
        x_hat = F.layer_norm(x, shape, None, None, module.eps)
    else:
        x_hat = F.rms_norm(x, shape, None, module.eps)
    return _norm_parts(owned, x_hat, g, len(shape), torch.Size(shape), torch.Size(shape))


_NORM_CHUNK = 1 << 18  # elements of a normalised chunk of the input (1 MiB in float32)


def _channel_parts(owned, normalise, x, g, c):  # type: ignore[no-untyped-def]
    """Per-sample gradients of a per-channel affine ``y = w_c * x_hat + b_c`` over ``(B, C, *)``:
    sums over each sample's positions, reduced along the contiguous last axis. ``x_hat`` is
    ``normalise`` of a chunk of samples at a time (each sample is normalised on its own), a fresh
    tensor that takes the product in place: no normalised copy of the whole input, which cost
    page faults in the step (glibc maps and unmaps a temporary that large: cifar10 CNN with
    GroupNorm, ``benchmarks/bench_dpsgd.py`` (f), 16 MiB for the first layer)."""
    out: list[tuple[nn.Parameter, Part]] = []
    b = g.shape[0]
    dtype = acc_dtype(g.dtype)
    g = g.reshape(b, c, -1)
    if "weight" in owned:
        ps = torch.empty(b, c, dtype=dtype, device=g.device)
        step = max(1, _NORM_CHUNK // max(1, g[0].numel()))
        for lo in range(0, b, step):
            hi = min(b, lo + step)
            x_hat = normalise(x[lo:hi]).to(g.dtype).reshape(hi - lo, c, -1)
            torch.sum(x_hat.mul_(g[lo:hi]), 2, dtype=dtype, out=ps[lo:hi])
        out.append((owned["weight"], DensePart(ps, torch.Size((c,)))))
    if "bias" in owned:
        out.append((owned["bias"], DensePart(g.sum(2, dtype=dtype), torch.Size((c,)))))
    return out


def _group_norm(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
    x, g = args[0], grads[0]
    if g is None:
        return []

    def normalise(xs: torch.Tensor) -> torch.Tensor:
        return F.group_norm(xs, module.num_groups, None, None, module.eps)

    return _channel_parts(owned, normalise, x, g, x.shape[1])


def _instance_norm(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
    """``nn.InstanceNorm1d/2d/3d`` (affine, without running statistics: the validator refuses
    those): each sample's channels normalised by their own statistics, a GroupNorm of one channel
    per group."""
    x, g = args[0], grads[0]
    if g is None:
        return []
    m: nn.modules.instancenorm._InstanceNorm = module
    if x.dim() == m._get_no_batch_dim():  # unbatched input: a batch of one
        x, g = x.unsqueeze(0), g.unsqueeze(0)

    def normalise(xs: torch.Tensor) -> torch.Tensor:
        return F.instance_norm(xs, None, None, None, None, True, 0.0, m.eps)

    return _channel_parts(owned, normalise, x, g, x.shape[1])


def vmap_parts(module, args, kwargs, grads, owned, disabled):  # type: ignore[no-untyped-def]
    """Fallback: per-sample gradients of ``module``'s own parameters by ``torch.func`` (vjp in vmap).

    Every tensor argument whose first dimension is the batch size is split per sample (and given
    back a batch dimension of 1, so the module sees a batch); the others are shared. Dropout inside
    the module draws fresh masks per sample; the result is still each sample's own gradient, so
    clipping bounds its influence exactly as in the main pass.
    """
    from torch.func import functional_call, vjp, vmap

    out_idx = [i for i, g in enumerate(grads) if g is not None]
    if not out_idx:
        return []
    if isinstance(module, nn.EmbeddingBag) and (kwargs.get("offsets") is not None or len(args) > 1):
        m: nn.EmbeddingBag = module
        raise UnsafeInput(
            f"nn.EmbeddingBag(mode={m.mode!r}, max_norm={m.max_norm}, scale_grad_by_freq="
            f"{m.scale_grad_by_freq}) with offsets has no per-sample rule: give one bag per row of a "
            "2-D input, or use mode='sum' or 'mean' without max_norm or scale_grad_by_freq"
        )
    b = grads[out_idx[0]].shape[0]
    names = list(owned)
    params = {n: owned[n].detach() for n in names}
    rest = {
        n: t.detach() for n, t in [*module.named_parameters(), *module.named_buffers()] if n not in params
    }
    flat, spec = tree_flatten((args, kwargs))
    batched = [isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == b for t in flat]
    inputs = [t for t, bt in zip(flat, batched, strict=True) if bt]
    g_list = [grads[i] for i in out_idx]

    def one(inputs_i: list, g_i: list) -> Any:
        it = iter(inputs_i)
        full = [next(it).unsqueeze(0) if bt else t for t, bt in zip(flat, batched, strict=True)]
        a, k = tree_unflatten(full, spec)

        def f(p: dict) -> tuple:
            leaves = tree_flatten(functional_call(module, {**rest, **p}, tuple(a), k))[0]
            return tuple(leaves[i] for i in out_idx)

        pullback = vjp(f, params)[1]
        return pullback(tuple(gi.unsqueeze(0) for gi in g_i))[0]

    # an embedding's sparse gradient has no batching rule in vmap; its dense form holds the same
    # values, so the recomputation asks for that (the module's own setting is put back)
    sparse = getattr(module, "sparse", None) is True
    try:
        if sparse:
            module.sparse = False
        with disabled():
            per_sample = vmap(one, randomness="different")(inputs, g_list)
    finally:
        if sparse:
            module.sparse = True
    return [(owned[n], DensePart(per_sample[n], owned[n].shape)) for n in names]


def _is_hf_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


PerSampleRule = Callable[[nn.Module, tuple, dict, list], Mapping[str, torch.Tensor]]

# Rules registered for custom layers, by module class. Like the class itself, a registration is
# code, the same for every model and tenant of the process (not state of a training run).
_REGISTERED: dict[type, PerSampleRule] = {}


class RuleHandle:
    """What :func:`register_rule` returns: ``remove()`` takes the registration back."""

    def __init__(self, module_type: type, rule: PerSampleRule) -> None:
        self.module_type, self.rule = module_type, rule

    def remove(self) -> None:
        if _REGISTERED.get(self.module_type) is self.rule:
            del _REGISTERED[self.module_type]


def register_rule(module_type: type, rule: PerSampleRule, *, replace: bool = False) -> RuleHandle:
    """Give a layer class its own per-sample gradient rule (else such layers use ``torch.func``).

    ``rule(module, args, kwargs, grad_outputs)`` is called at the end of each backward pass, once
    per forward call of a module of this class (subclasses included, unless they have their own
    rule), with the call's positional and keyword inputs (detached) and ``grad_outputs``, the
    gradients of the call's outputs flattened in ``torch.utils._pytree`` order (None for an output
    backward did not reach). It returns, for each trainable parameter the module holds itself
    (``module.named_parameters(recurse=False)``, by that name), the per-sample gradients
    ``(B, *param.shape)``: sample ``i``'s gradient given the output gradients ``grad_outputs[..][i]``
    (linear in them; with a mean loss they carry its ``1 / B``, which the clipper undoes). Those
    are clipped and summed exactly like a built-in layer's; the guarantee then rests on the rule
    being right (test it against a per-example loop, as ``tests/torch`` does for the built-in ones).
    A registered rule takes precedence over a built-in one for the same class.

    Args:
        module_type: an ``nn.Module`` subclass.
        rule: the function described above.
        replace: allow replacing a rule already registered for ``module_type``.

    Returns:
        A handle whose ``remove()`` unregisters the rule.

    Raises:
        TypeError: ``module_type`` is not an ``nn.Module`` subclass or ``rule`` is not callable.
        InvalidParameter: a rule is registered for ``module_type`` already and ``replace`` is False.

    Example::

        def scale_rule(module, args, kwargs, grad_outputs):   # y = x * weight, x of shape (B, d)
            return {"weight": args[0] * grad_outputs[0]}

        handle = gaussdp.torch.register_rule(Scale, scale_rule)
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got module_type={module_type!r}")
    if not callable(rule):
        raise TypeError(f"rule must be callable, got rule={rule!r}")
    if module_type in _REGISTERED and not replace:
        raise InvalidParameter(
            f"a per-sample rule is registered for {module_type.__name__} already "
            f"({_REGISTERED[module_type]!r}); pass replace=True to replace it"
        )
    _REGISTERED[module_type] = rule
    return RuleHandle(module_type, rule)


def _registered(module: nn.Module) -> Rule | None:
    for cls in type(module).__mro__:
        rule = _REGISTERED.get(cls)
        if rule is not None:
            return _custom(rule)
    return None


def _custom(rule: PerSampleRule) -> Rule:
    """A registered rule as a built-in one: its per-sample gradients checked and made parts."""

    def parts(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
        if all(g is None for g in grads):
            return []
        b = next(g for g in grads if g is not None).shape[0]
        given = rule(module, args, kwargs, list(grads))
        out: list[tuple[nn.Parameter, Part]] = []
        for name, p in owned.items():
            ps = given.get(name) if isinstance(given, Mapping) else None
            if not isinstance(ps, torch.Tensor) or tuple(ps.shape) != (b, *p.shape):
                got = "nothing" if ps is None else f"{type(ps).__name__} {tuple(getattr(ps, 'shape', ()))}"
                raise UnsafeInput(
                    f"the rule registered for {type(module).__name__} gave {got} for its trainable "
                    f"parameter {name!r}; per-sample gradients of shape {(b, *p.shape)} are needed"
                )
            out.append((p, DensePart(ps.detach(), p.shape)))
        return out

    return parts


def rule_for(module: nn.Module) -> Rule | None:
    """The closed-form rule for ``module`` (a registered one first), or None for the vmap fallback."""
    registered = _registered(module)
    if registered is not None:
        return registered
    if isinstance(module, nn.Linear) or _is_hf_conv1d(module):
        return _linear
    if isinstance(module, nn.Embedding):
        # sparse=True changes only how autograd would store the weight's summed gradient, which is
        # never formed here: the per-sample rows are the same
        if module.max_norm is not None or module.scale_grad_by_freq:
            return None
        return _embedding
    if type(module) in (nn.LSTM, nn.GRU, nn.RNN):
        from gaussdp.torch._rnn import rnn_parts

        return rnn_parts
    if isinstance(module, nn.EmbeddingBag):
        if module.mode == "max" or module.max_norm is not None or module.scale_grad_by_freq:
            return None
        return _embedding_bag
    if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        return _conv
    if isinstance(module, nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d):
        return _conv_transpose
    if isinstance(module, nn.LayerNorm | nn.RMSNorm):
        return _layer_norm
    if isinstance(module, nn.GroupNorm):
        return _group_norm
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and not module.track_running_stats:
        return _instance_norm
    if isinstance(module, nn.MultiheadAttention):
        if not module.batch_first:
            return _refuse_batch_second
        return mha_rule if mha_supported(module) else None
    return None


def _refuse_batch_second(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
    raise UnsafeInput(
        f"{type(module).__name__}(batch_first=False) puts the batch in dimension 1; per-sample "
        "clipping needs batch_first=True"
    )
