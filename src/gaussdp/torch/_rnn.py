"""Per-sample rule for ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` as they are (fused kernels).

The fused kernel leaves no per-step tensors to hook, so the recurrence is replayed from the kept
input and initial state, unrolled, with the weights out of autograd: one forward and one backward
through the cells that give the gradients of every step's two pre-activations, ``x_t W_ih^T + b_ih``
and ``h_{t-1} W_hh^T + b_hh``. Each weight is then a linear map applied at ``T`` positions, an
ordinary :class:`gaussdp.torch._parts.LinearPart` (ghost norms or per-sample gradients, whichever
is cheaper), and each bias the sum of its pre-activation's gradient over time. The replay costs
about what Opacus's ``DPLSTM`` costs in its own forward and backward.

Supported: ``batch_first=True`` or ``False`` (the layer's own setting says where its input holds
the batch; the replay runs batch-first), any number of layers, bidirectional, with or without
biases, an initial state or none, nonlinearity ``tanh``/``relu``; not ``proj_size`` nor dropout
between layers in train mode (its masks cannot be replayed), nor packed sequences: those are
refused here and listed by :class:`gaussdp.torch.ModuleValidator`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from gaussdp.errors import UnsafeInput
from gaussdp.torch._parts import DensePart, LinearPart, Part

__all__ = ["rnn_parts", "rnn_unsupported"]


def rnn_unsupported(m: nn.Module) -> tuple[str, str] | None:
    """Why the replay cannot handle ``m``'s configuration and the setting that it can, or None."""
    if not isinstance(m, nn.RNNBase):
        return None
    if m.proj_size:
        return f"proj_size={m.proj_size} has no per-sample rule", "proj_size=0"
    if m.dropout and m.num_layers > 1:
        return f"dropout={m.dropout} between layers cannot be replayed per sample", "dropout=0"
    return None


def _cell(mode: str, gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor, c: Any) -> tuple:
    if mode == "LSTM":
        i, f, g, o = (gi + gh).chunk(4, 1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if mode == "GRU":
        ir, iz, inn = gi.chunk(3, 1)
        hr, hz, hn = gh.chunk(3, 1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(inn + r * hn)
        return (1 - z) * n + z * h, None
    pre = gi + gh
    return (torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)), None


def rnn_parts(module, args, kwargs, grads, owned):  # type: ignore[no-untyped-def]
    """Parts of one call of ``nn.LSTM``/``GRU``/``RNN`` from its input, initial state and the
    gradients of ``output``, ``h_n`` (and ``c_n``)."""
    m: nn.RNNBase = module
    why = rnn_unsupported(m)
    if why is not None and not (why[1] == "dropout=0" and not m.training):  # no dropout in eval
        raise UnsafeInput(f"{type(m).__name__}: {why[0]}; use {why[1]} (see gaussdp.torch.ModuleValidator)")
    x = args[0] if args else kwargs["input"]
    hx = args[1] if len(args) > 1 else kwargs.get("hx")
    if isinstance(x, PackedSequence):
        raise UnsafeInput(
            f"{type(m).__name__} got a PackedSequence: per-sample clipping needs a padded (B, T, in) "
            "batch (mask the padded steps in the loss instead)"
        )
    if x.dim() != 3:
        raise UnsafeInput(f"{type(m).__name__} got an unbatched input; per-sample clipping needs a batch")
    lstm = m.mode == "LSTM"
    g_out = grads[0]
    if not m.batch_first:  # (T, B, .) in and out; the states are (layers, B, H) either way
        x = x.transpose(0, 1)
        g_out = g_out.transpose(0, 1) if g_out is not None else None
    g_h = grads[1] if len(grads) > 1 else None
    g_c = grads[2] if lstm and len(grads) > 2 else None
    if g_out is None and g_h is None and g_c is None:
        return []
    b, t_len = x.shape[0], x.shape[1]
    dirs = 2 if m.bidirectional else 1
    zeros = x.new_zeros(m.num_layers * dirs, b, m.hidden_size)
    if hx is None:
        h0, c0 = zeros, zeros
    elif lstm:
        h0, c0 = hx[0].detach(), hx[1].detach()
    else:
        h0, c0 = hx.detach(), None
    records = []  # (suffix, layer input, input pre-activations, hidden pre-activations, h_{t-1})
    finals_h, finals_c = [], []
    with torch.enable_grad():
        layer_in = x.detach()
        for layer in range(m.num_layers):
            outs = []
            for d in range(dirs):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                w_ih, w_hh = getattr(m, "weight_ih" + sfx).detach(), getattr(m, "weight_hh" + sfx).detach()
                b_ih = getattr(m, "bias_ih" + sfx).detach() if m.bias else None
                b_hh = getattr(m, "bias_hh" + sfx).detach() if m.bias else None
                gi = F.linear(layer_in, w_ih, b_ih)
                if not gi.requires_grad:  # the first layer: a leaf to differentiate against
                    gi.requires_grad_()
                h = h0[layer * dirs + d]
                c = c0[layer * dirs + d] if lstm else None
                ghs, prev, hs = [], [], []
                for t in range(t_len) if d == 0 else range(t_len - 1, -1, -1):
                    gh = F.linear(h, w_hh, b_hh)
                    if not gh.requires_grad:
                        gh.requires_grad_()
                    prev.append(h.detach())
                    ghs.append(gh)
                    h, c = _cell(m.mode, gi[:, t], gh, h, c)
                    hs.append(h)
                if d:
                    ghs.reverse()
                    prev.reverse()
                    hs.reverse()
                records.append((sfx, layer_in.detach(), gi, ghs, prev))
                finals_h.append(h)
                finals_c.append(c)
                outs.append(torch.stack(hs, 1))
            layer_in = torch.cat(outs, -1) if dirs > 1 else outs[0]
        outputs, g_outputs = [], []
        out: Any  # the output tensor, or the list of final states (cells of an LSTM only: g_c is None else)
        for out, g in ((layer_in, g_out), (finals_h, g_h), (finals_c, g_c)):
            if g is not None:
                outputs.append(out if isinstance(out, torch.Tensor) else torch.stack(out))
                g_outputs.append(g.to(x.dtype))
        wrt = [r[2] for r in records] + [gh for r in records for gh in r[3]]
        found = torch.autograd.grad(outputs, wrt, g_outputs, allow_unused=True)
    d_gi, d_gh = list(found[: len(records)]), list(found[len(records) :])
    parts: list[tuple[nn.Parameter, Part]] = []
    for k, (sfx, a_in, gi, ghs, prev) in enumerate(records):
        dgi = d_gi[k] if d_gi[k] is not None else torch.zeros_like(gi)
        steps = d_gh[k * t_len : (k + 1) * t_len]
        dgh = torch.stack(
            [s if s is not None else torch.zeros_like(g) for s, g in zip(steps, ghs, strict=True)], 1
        )
        a_hh = torch.stack(prev, 1)
        pieces = (("weight_ih", a_in, dgi), ("weight_hh", a_hh, dgh))
        for kind, a, g in pieces:
            if kind + sfx in owned:
                shape = m.get_parameter(kind + sfx).shape
                parts.append((owned[kind + sfx], LinearPart(a, g, shape)))
            bias = "bias" + kind[len("weight") :] + sfx
            if bias in owned:
                parts.append((owned[bias], DensePart(g.sum(1), m.get_parameter(bias).shape)))
    return parts
