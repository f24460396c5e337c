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
from gaussdp.torch._parts import (
    ConvPart,
    DensePart,
    EmbeddingPart,
    LinearPart,
    Part,
    StackedPart,
    acc_dtype,
    same_elements,
)

__all__ = [
    "MHACapture",
    "Rule",
    "RuleHandle",
    "mha_capture",
    "mha_captured_parts",
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


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def _mha_supported(module: nn.MultiheadAttention) -> bool:
    return module.batch_first and module.bias_k is None and not module.add_zero_attn


def _mha(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
    """``nn.MultiheadAttention`` as is: its projections are linear maps, handled by ghost norms.

    The attention core is recomputed from the kept inputs (one forward and backward of softmax
    attention, no weight gradients) to get the gradients of the q/k/v projection outputs and the
    input of the output projection; the four projections are then ordinary :class:`LinearPart`s.
    Dropout inside attention (training with ``dropout > 0``) draws a fresh mask in the recomputation:
    the result is still each sample's own gradient, so clipping bounds its influence all the same.
    """
    m: nn.MultiheadAttention = module
    names = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights")
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    q_in, k_in, v_in = bound["query"], bound["key"], bound["value"]
    g_out = grads[0]
    g_w = grads[1] if len(grads) > 1 else None
    if g_out is None and g_w is None:
        return []
    if q_in.dim() != 3:
        raise UnsafeInput("nn.MultiheadAttention got an unbatched input; per-sample clipping needs a batch")
    b, tgt, e = q_in.shape
    src, h = k_in.shape[1], m.num_heads
    hd = e // h
    dtype = acc_dtype(q_in.dtype)
    if m._qkv_same_embed_dim:
        w_q, w_k, w_v = m.in_proj_weight.detach().chunk(3)
    else:
        w_q, w_k, w_v = (m.q_proj_weight.detach(), m.k_proj_weight.detach(), m.v_proj_weight.detach())
    b_q = b_k = b_v = None
    if m.in_proj_bias is not None:
        b_q, b_k, b_v = m.in_proj_bias.detach().chunk(3)
    w_o = m.out_proj.weight.detach()
    mask = _float_mask(bound.get("attn_mask"), dtype)
    if mask is not None:
        mask = mask.view(b, h, tgt, src) if mask.dim() == 3 else mask.view(1, 1, tgt, src)
    kpm = _float_mask(bound.get("key_padding_mask"), dtype)
    if kpm is not None:
        kpm = kpm.view(b, 1, 1, src)
        mask = kpm if mask is None else mask + kpm
    want_w = g_w is not None and bound.get("need_weights", True)
    o = torch.empty(b, tgt, e, dtype=q_in.dtype, device=q_in.device)
    if tgt == src:  # q/k/v gradients side by side: the packed projection's output gradient
        g_qkv = torch.zeros(b, tgt, 3 * e, dtype=q_in.dtype, device=q_in.device)
        gq, gk, gv = g_qkv.split(e, dim=-1)
    else:
        g_qkv = None
        gq = torch.zeros(b, tgt, e, dtype=q_in.dtype, device=q_in.device)
        gk = torch.zeros(b, src, e, dtype=k_in.dtype, device=k_in.device)
        gv = torch.zeros(b, src, e, dtype=v_in.dtype, device=v_in.device)
    # the recomputation is done in batch chunks so its temporaries (scores: h*tgt*src per sample)
    # stay around 2**18 elements whatever the batch size
    step = max(1, (1 << 18) // max(1, h * tgt * src))
    for lo in range(0, b, step):
        sl = slice(lo, min(b, lo + step))
        n = sl.stop - lo
        with torch.enable_grad():
            q = F.linear(q_in[sl], w_q, b_q).requires_grad_()
            k = F.linear(k_in[sl], w_k, b_k).requires_grad_()
            v = F.linear(v_in[sl], w_v, b_v).requires_grad_()
            qh = q.view(n, tgt, h, hd).transpose(1, 2)
            kh = k.view(n, src, h, hd).transpose(1, 2)
            vh = v.view(n, src, h, hd).transpose(1, 2)
            scores = (qh * hd**-0.5) @ kh.transpose(-2, -1)
            if mask is not None:
                scores = scores + (mask[sl] if mask.shape[0] == b else mask)
            attn = torch.softmax(scores, dim=-1)
            if m.training and m.dropout > 0:
                attn = F.dropout(attn, m.dropout)
            oc = (attn @ vh).transpose(1, 2).reshape(n, tgt, e)
            outs, gs = [], []
            if g_out is not None:
                outs.append(oc)
                gs.append(g_out[sl] @ w_o.to(g_out.dtype))  # gradient at the output projection's input
            if want_w and g_w is not None:
                outs.append(attn.mean(1) if bound.get("average_attn_weights", True) else attn)
                gs.append(g_w[sl])
            grads_qkv = torch.autograd.grad(outs, (q, k, v), gs, allow_unused=True)
        o[sl] = oc.detach()
        for dst, gt in zip((gq, gk, gv), grads_qkv, strict=True):
            if gt is not None:
                dst[sl] = gt
    out: list[tuple[nn.Parameter, Part]] = []
    if "in_proj_weight" in owned:
        same = q_in.shape == k_in.shape == v_in.shape and bool(
            torch.equal(q_in, k_in) and torch.equal(k_in, v_in)
        )
        if same:  # self-attention: one linear map from x to [q, k, v]
            g_cat = g_qkv if g_qkv is not None else torch.cat((gq, gk, gv), dim=-1)
            part: Part = LinearPart(q_in, g_cat, m.in_proj_weight.shape)
        else:
            part = StackedPart(
                [
                    LinearPart(x, gx, w.shape)
                    for x, gx, w in ((q_in, gq, w_q), (k_in, gk, w_k), (v_in, gv, w_v))
                ],
                m.in_proj_weight.shape,
            )
        out.append((owned["in_proj_weight"], part))
    for name, x, gx in (
        ("q_proj_weight", q_in, gq),
        ("k_proj_weight", k_in, gk),
        ("v_proj_weight", v_in, gv),
    ):
        if name in owned:
            out.append((owned[name], LinearPart(x, gx, owned[name].shape)))
    if "in_proj_bias" in owned:
        gb = torch.cat((gq.sum(1), gk.sum(1), gv.sum(1)), dim=-1)
        out.append((owned["in_proj_bias"], DensePart(gb, m.in_proj_bias.shape)))
    if g_out is not None:
        out += _out_proj_parts(m, owned, o.to(dtype), g_out)
    return out


def _out_proj_parts(m: nn.MultiheadAttention, owned: dict, o: torch.Tensor, g_out: torch.Tensor) -> list:
    """The output projection's parts: its input ``o`` (B, T, E) and output gradient ``g_out``."""
    out: list[tuple[nn.Parameter, Part]] = []
    if "out_proj.weight" in owned:
        out.append((owned["out_proj.weight"], LinearPart(o, g_out, m.out_proj.weight.shape)))
    if "out_proj.bias" in owned and m.out_proj.bias is not None:
        out.append((owned["out_proj.bias"], DensePart(g_out.sum(1), m.out_proj.bias.shape)))
    return out


class MHACapture:
    """What one ``nn.MultiheadAttention`` call leaves in its autograd graph, to skip recomputing it.

    For self-attention through ``scaled_dot_product_attention`` (``need_weights=False``, as in
    ``nn.TransformerEncoderLayer``), the attention node already holds its output (the input of the
    output projection, in head layout) and its backward receives the gradients of q, k and v, which
    are the gradients of the input projection's outputs: between the projection and the attention
    there are only views, transposes, selects and a contiguous copy. Where the nodes that made the
    projections are found, hooks on them keep the gradients that autograd forms anyway (no copy of
    ours): ``"split"``, the three projections of one weight's chunks (the clipper's pre-hook passes
    the input as three aliases, see ``_split_self_attention``), each gradient ``(T, B, E)``;
    ``"packed"``, the one packed projection, its gradient ``(T, B, 3E)``. Otherwise (``"heads"``) a
    hook on the attention node keeps q, k, v in head layout. Either way the per-sample parts need
    no second forward or backward of the attention. Any other shape of graph leaves ``None`` and
    the recomputing rule is used.
    """

    __slots__ = ("_pending", "grads", "handles", "layout", "on_ready", "output")

    def __init__(self, output: torch.Tensor, node: Any, found: tuple[str, list[Any]] | None = None) -> None:
        self.output = output.detach()
        # "split": (q, k, v) each (B, T, E) (transposed views); "packed": (B, T, 3E) (a transposed
        # view); "heads": (q, k, v) in head layout (B, heads, T, head_dim)
        self.grads: torch.Tensor | tuple[torch.Tensor, ...] | None = None
        self.on_ready: Any = None  # called once the gradients are kept
        self.layout, nodes = found if found is not None else ("heads", [])
        self._pending: list[torch.Tensor | None] = [None] * len(nodes)
        if self.layout == "heads":
            self.handles = [node.register_hook(self._keep)]
        else:
            self.handles = [n.register_prehook(self._keeper(i)) for i, n in enumerate(nodes)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _ready(self) -> None:
        if self.on_ready is not None:
            self.on_ready()

    def _keep(self, grad_inputs: tuple, grad_outputs: tuple) -> None:
        gq, gk, gv = grad_inputs[:3]
        if gq is not None and gk is not None and gv is not None:
            self.grads = (gq.detach(), gk.detach(), gv.detach())
            self._ready()

    def _keeper(self, i: int) -> Callable[[tuple], None]:
        def keep(grad_outputs: tuple) -> None:
            g = grad_outputs[0]
            if g is None:
                return
            self._pending[i] = g.detach()
            if all(p is not None for p in self._pending):
                t, b = self.output.shape[2], self.output.shape[0]
                # (T B, E') or (T, B, E') rows in position-major order, as (B, T, E') views
                gs = [p.reshape(t, b, p.shape[-1]).transpose(0, 1) for p in self._pending if p is not None]
                self.grads = gs[0] if self.layout == "packed" else tuple(gs)
                self._pending = []
                self._ready()

        return keep


# what lies between the projections and the attention: views, selects and one contiguous copy
_VIEW_NODES = frozenset(
    {
        "ViewBackward0",
        "TransposeBackward0",
        "SelectBackward0",
        "CloneBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "UnsqueezeBackward0",
        "UnsafeViewBackward0",
    }
)


def _packed_projection(attention: Any, packed_shape: tuple[int, int, int]) -> Any:
    """The autograd node whose output is the packed q/k/v projection ``(T, B, 3E)`` feeding all three
    inputs of ``attention``, or None. Each input is followed back through views only, to the view
    that splits a tensor of ``packed_shape``; the three must meet at the same one."""
    found = []
    for i in range(3):
        node = attention.next_functions[i][0]
        for _ in range(12):
            if node is None or node.name() not in _VIEW_NODES:
                return None
            if tuple(getattr(node, "_saved_self_sym_sizes", ())) == packed_shape:
                break
            node = _only_next(node)
        else:
            return None
        found.append(node)
    if not (found[0] is found[1] is found[2]):
        return None
    return _only_next(found[0])


def _split_projections(attention: Any, weight: torch.Tensor) -> list[Any] | None:
    """The three matmul nodes (``addmm``, or ``mm`` without bias) whose outputs feed q, k and v of
    ``attention`` through views only, each multiplying by its chunk of the packed ``weight``: rows
    ``[i E, (i + 1) E)`` for input ``i`` (the weight's storage, checked by address), or None."""
    e = weight.shape[1]
    step = e * e * weight.element_size()
    found = []
    for i in range(3):
        node = attention.next_functions[i][0]
        for _ in range(8):
            if node is None:
                return None
            if node.name() in ("AddmmBackward0", "MmBackward0"):
                break
            if node.name() not in _VIEW_NODES:
                return None
            node = _only_next(node)
        else:
            return None
        mat2 = getattr(node, "_saved_mat2", None)
        if not (
            isinstance(mat2, torch.Tensor)
            and tuple(mat2.shape) == (e, e)
            and mat2.data_ptr() == weight.data_ptr() + i * step
        ):
            return None
        found.append(node)
    return found


def _only_next(node: Any) -> Any:
    """The one node that ``node`` passes gradients to, or None where there are several or none."""
    nexts = [f for f, _ in node.next_functions if f is not None]
    return nexts[0] if len(nexts) == 1 else None


_MHA_NAMES = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
)


def mha_capture(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> MHACapture | None:
    """Hook the attention node of this call's graph when its layout is the one described above."""
    m = module
    if not (isinstance(m, nn.MultiheadAttention) and _mha_supported(m) and m._qkv_same_embed_dim):
        return None
    bound = dict(zip(_MHA_NAMES, args, strict=False))
    bound.update(kwargs)
    q, k, v = bound.get("query"), bound.get("key"), bound.get("value")
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return None
    if not (q.dim() == 3 and same_elements(q, k) and same_elements(q, v)):  # self-attention
        return None
    if bound.get("need_weights", True) or not isinstance(output, tuple) or output[1] is not None:
        return None
    out = output[0]
    b, t, e = q.shape
    h = m.num_heads
    want = (b, h, t, e // h)
    node, seen_out_proj = getattr(out, "grad_fn", None), False
    for _ in range(7):  # transpose, view, addmm (out_proj), view, [clone on CUDA,] permute, attention
        if node is None:
            return None
        mat2 = getattr(node, "_saved_mat2", None)
        if isinstance(mat2, torch.Tensor) and mat2.data_ptr() == m.out_proj.weight.data_ptr():
            seen_out_proj = True
        if hasattr(node, "_saved_output") and hasattr(node, "_saved_query"):
            break
        if mat2 is not None and not seen_out_proj:
            return None  # another matmul before the output projection: not the layout expected
        node = _only_next(node)
    else:
        return None
    if not seen_out_proj or getattr(node, "_saved_scale", None) is not None:
        return None
    if getattr(node, "_saved_is_causal", False):
        return None
    saved = [getattr(node, f"_saved_{n}", None) for n in ("output", "query", "key", "value")]
    if not all(isinstance(x, torch.Tensor) and tuple(x.shape) == want for x in saved):
        return None
    attn_out = cast(torch.Tensor, saved[0])  # a tensor: checked just above
    split = _split_projections(node, m.in_proj_weight)
    if split is not None:
        return MHACapture(attn_out, node, ("split", split))
    packed = _packed_projection(node, (t, b, 3 * e))
    return MHACapture(attn_out, node, ("packed", [packed]) if packed is not None else None)


def mha_captured_parts(module, args, kwargs, grads, owned, cap):  # type: ignore[no-untyped-def]
    """Parts of a self-attention call from its :class:`MHACapture` (no recomputation)."""
    m: nn.MultiheadAttention = module
    cap.remove()
    g_out = grads[0]
    if g_out is None or cap.grads is None:  # the caller recomputes when only g_out arrived
        return []
    x = args[0] if args else kwargs["query"]
    b, t, e = x.shape

    def tokens(z: torch.Tensor) -> torch.Tensor:  # (B, heads, T, head_dim) -> (B, T, E)
        return z.permute(0, 2, 1, 3).reshape(b, t, e)

    w = m.in_proj_weight
    out: list[tuple[nn.Parameter, Part]] = []
    if cap.layout == "split":  # one input, three row blocks of the weight (q, k, v)
        gs = cap.grads
        if "in_proj_weight" in owned:
            blocks = [LinearPart(x, g, torch.Size((e, e))) for g in gs]
            out.append((owned["in_proj_weight"], StackedPart(blocks, w.shape)))
        g_bias = torch.cat([g.sum(1) for g in gs], dim=-1) if "in_proj_bias" in owned else None
    else:
        # the packed projection's output gradient (B, T, 3E), or q, k, v in head layout concatenated
        g_qkv = cap.grads if cap.layout == "packed" else torch.cat([tokens(g) for g in cap.grads], dim=-1)
        if "in_proj_weight" in owned:
            out.append((owned["in_proj_weight"], LinearPart(x, g_qkv, w.shape)))
        g_bias = g_qkv.sum(1) if "in_proj_bias" in owned else None
    if g_bias is not None:
        out.append((owned["in_proj_bias"], DensePart(g_bias, m.in_proj_bias.shape)))
    o = tokens(cap.output).to(acc_dtype(x.dtype))
    return out + _out_proj_parts(m, owned, o, g_out)


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
        return _mha if _mha_supported(module) else None
    return None


def _refuse_batch_second(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
    raise UnsafeInput(
        f"{type(module).__name__}(batch_first=False) puts the batch in dimension 1; per-sample "
        "clipping needs batch_first=True"
    )
