"""Per-sample gradients of ``nn.MultiheadAttention``, in closed form.

``F.multi_head_attention_forward`` reads the projection weights without calling ``out_proj``, so
the module owns every parameter under it (:mod:`gaussdp.torch._rules`). Two paths: :func:`mha_rule`
recomputes the attention from the kept input (the generic rule), and :func:`mha_capture` /
:func:`mha_captured_parts` keep the gradients autograd already forms for the q/k/v projections
during the backward pass (no second forward or backward; see :class:`MHACapture`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from gaussdp.errors import UnsafeInput
from gaussdp.torch._parts import DensePart, LinearPart, Part, StackedPart, acc_dtype, same_elements

__all__ = ["MHACapture", "mha_capture", "mha_captured_parts", "mha_rule", "mha_supported"]


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def mha_supported(module: nn.MultiheadAttention) -> bool:
    return module.batch_first and module.bias_k is None and not module.add_zero_attn


def mha_rule(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
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
    if not (isinstance(m, nn.MultiheadAttention) and mha_supported(m) and m._qkv_same_embed_dim):
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
