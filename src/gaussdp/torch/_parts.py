"""What one module call contributes to the per-sample gradients of one parameter.

A *part* knows three things about its contribution ``G_i`` (sample ``i``'s gradient of one parameter):
its squared norms ``||G_i||^2`` for every sample, the weighted sum ``sum_i w_i G_i`` (the clipped
gradient once the weights ``w_i = min(1, C / ||g_i||)`` are known) and, when needed, the per-sample
gradients themselves. Linear and Embedding parts compute the first two without materialising ``G_i``
when that is cheaper ("ghost" norms, Goodfellow 2015; Li et al. 2022; book-keeping, Bu et al. 2023).

Norms are accumulated in at least float32 whatever the input dtype (bf16 and fp16 are upcast).

Over 600 lines on purpose: :class:`ConvPart` alone is about 300 (ghost norms for every convolution:
groups, dilation, padding modes), and the parts share private helpers (``_grams``,
``_ghost_sq_norms``) that splitting would turn into cross-module internals.
"""

from __future__ import annotations

import math

import torch

from gaussdp.errors import UnsafeInput

__all__ = [
    "ConvPart",
    "DensePart",
    "EmbeddingPart",
    "LinearPart",
    "ReluFedPart",
    "StackedPart",
    "acc_dtype",
    "combine",
    "same_elements",
]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype norms and clipped sums are accumulated in: float32 at least (bf16, fp16), float64 kept."""
    return torch.promote_types(dtype, torch.float32)


def _acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the accumulation dtype (:func:`acc_dtype`)."""
    return t.to(acc_dtype(t.dtype))


def _sq(t: torch.Tensor) -> torch.Tensor:
    """Row-wise squared L2 norms of a 2-D tensor, without a squared copy of it."""
    return torch.linalg.vector_norm(t, dim=1).square()


def same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` are one tensor or views of the same elements (address, shape, strides, dtype)."""
    return a is b or (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _into(out: torch.Tensor | None, s: torch.Tensor) -> torch.Tensor:
    """``s`` itself, or ``out += s`` (in place) when an accumulator is given."""
    if out is None:
        return s
    return out.add_(s.view(out.shape))


def _grams(x: torch.Tensor, h: int, acc: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """The blocks of the per-sample Gram matrices ``x x^T`` that determine them (they are symmetric):
    the whole ``(B, T, T)`` when ``h`` is 0, else the two diagonal blocks and the lower one of the
    split ``[:h], [h:]`` of the positions. Added in place into ``acc`` when given."""
    if h == 0:
        pairs = [(x, x)]
    else:
        x0, x1 = x[:, :h], x[:, h:]
        pairs = [(x0, x0), (x1, x1), (x1, x0)]
    if acc is None:
        return [torch.bmm(u, v.transpose(1, 2)) for u, v in pairs]
    return [c.baddbmm_(u, v.transpose(1, 2)) for c, (u, v) in zip(acc, pairs, strict=True)]


def _ghost_sq_norms(a: torch.Tensor, gs: list[torch.Tensor]) -> torch.Tensor:
    """``||sum_t [g1_t; g2_t; ...] a_t^T||_F^2`` per sample, for output gradients ``gs`` of row
    blocks sharing the input ``a``: ``<a a^T, sum_k g_k g_k^T>_F`` (the Gram identity), one Gram of
    ``a`` whatever the number of blocks.

    From ``T = 16`` positions on, only three quarters of each Gram are formed: its two diagonal
    blocks and one off-diagonal block, which counts twice (at ``T = 64``, 18-20% less time alone,
    about 7% less inside the encoder benchmark's step, ``benchmarks/bench_dpsgd.py`` (b)).
    """
    t = a.shape[1]
    h = t // 2 if t >= 16 else 0
    gram_a = _grams(_acc(a), h, None)
    gram_g = None
    for g in gs:
        gram_g = _grams(_acc(g), h, gram_g)
    if gram_g is None:
        raise RuntimeError("internal: a Gram product needs at least one output gradient")
    sq = [(x * y).flatten(1).sum(1) for x, y in zip(gram_a, gram_g, strict=True)]
    return sq[0] if h == 0 else sq[0] + sq[1] + 2 * sq[2]


class DensePart:
    """A contribution given by its materialised per-sample gradients, shape ``(B, *param.shape)``."""

    def __init__(self, per_sample: torch.Tensor, shape: torch.Size) -> None:
        self.per_sample = _acc(per_sample)
        self.shape = shape

    @property
    def batch_size(self) -> int:
        return int(self.per_sample.shape[0])

    def stored(self) -> int:
        return self.per_sample.numel()

    def sq_norms(self) -> torch.Tensor:
        return _sq(self.per_sample.flatten(1))

    def weighted_sum(self, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_i w_i G_i``; added in place into ``out`` when given (and ``out`` returned)."""
        ps = self.per_sample.flatten(1)
        if out is not None and out.dtype == ps.dtype and out.is_contiguous():
            return out.view(-1).addmv_(ps.T, w.to(ps.dtype)).view(out.shape)
        return _into(out, (w.to(ps.dtype) @ ps).view(self.shape))

    def materialise(self) -> torch.Tensor:
        return self.per_sample


class LinearPart:
    """``G_i = sum_t g_it a_it^T`` for a linear map applied at ``T`` positions.

    ``a`` is ``(B, T, in)`` (the layer input), ``g`` is ``(B, T, out)`` (the gradient of the layer
    output). ``transposed`` is for weights stored as ``(in, out)`` (Hugging Face ``Conv1D``). The
    squared norm is computed either by the Gram ("ghost") identity
    ``||G_i||_F^2 = <a_i a_i^T, g_i g_i^T>_F`` at cost ``T^2 (in + out)`` per sample, or by building
    ``G_i`` (cost ``T in out``, memory ``in out`` per sample), which then also gives the clipped sum
    for free. The choice is made per layer by :meth:`materialises`.
    """

    def __init__(self, a: torch.Tensor, g: torch.Tensor, shape: torch.Size, transposed: bool = False):
        if a.dim() == 2:
            a, g = a.unsqueeze(1), g.unsqueeze(1)
        self.a = a.reshape(a.shape[0], -1, a.shape[-1])
        self.g = g.reshape(g.shape[0], -1, g.shape[-1])
        self.shape = shape
        self.transposed = transposed
        self._ps: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.a.shape[0])

    def stored(self) -> int:
        return self.a.numel() + self.g.numel()

    def materialises(self) -> bool:
        """Cost model: build per-sample gradients iff cheaper in flops and no larger in memory.

        Ghost norms cost ``T^2 (in + out)`` per sample plus a weighted matmul ``T in out`` for the sum;
        materialising costs ``T in out`` (which replaces that matmul) plus ``2 in out``. Memory: the
        per-sample gradients (``in out`` per sample) must not exceed what is already stored for the
        layer (``T (in + out)``), so choosing them never raises peak memory by much.
        """
        t, d_in, d_out = self.a.shape[1], self.a.shape[2], self.g.shape[2]
        if t == 1:
            return False
        return 2 * d_in * d_out < t * t * (d_in + d_out) and d_in * d_out <= t * (d_in + d_out)

    def _per_sample(self) -> torch.Tensor:
        if self._ps is None:
            ps = torch.bmm(_acc(self.g).transpose(1, 2), _acc(self.a))  # (B, out, in)
            self._ps = ps.transpose(1, 2) if self.transposed else ps
        return self._ps

    def sq_norms(self) -> torch.Tensor:
        if self.a.shape[1] == 1:
            return _sq(_acc(self.a[:, 0])) * _sq(_acc(self.g[:, 0]))
        if self.materialises():
            return _sq(self._per_sample().flatten(1))
        return _ghost_sq_norms(self.a, [self.g])

    def weighted_sum(self, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_i w_i G_i``; added in place into ``out`` when given (and ``out`` returned)."""
        if self._ps is not None:
            return DensePart(self._ps, self.shape).weighted_sum(w, out)
        a, g = _acc(self.a), _acc(self.g)
        small_g = g.shape[-1] <= a.shape[-1]
        big = a if small_g else g
        # The sum runs over all (sample, position) rows in any order: (T, B) order where the larger
        # operand is stored that way (a transposed view, e.g. a packed attention gradient), so it
        # is read in place; the smaller one is scaled by w into a temporary laid out to match.
        tb = not big.is_contiguous() and big.transpose(0, 1).is_contiguous()
        if tb:
            a, g = a.transpose(0, 1), g.transpose(0, 1)
        small = g if small_g else a
        ws = w.to(small.dtype).view((1, -1, 1) if tb else (-1, 1, 1))
        scaled = torch.mul(small, ws, out=torch.empty(small.shape, dtype=small.dtype, device=small.device))
        a, g = (a, scaled) if small_g else (scaled, g)
        a2, g2 = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
        left, right = (a2.T, g2) if self.transposed else (g2.T, a2)
        if out is not None and out.dtype == left.dtype and out.is_contiguous():
            # one GEMM with beta = 1: the sum lands in the accumulator, no temporary of its size
            return out.view(left.shape[0], right.shape[1]).addmm_(left, right).view(out.shape)
        return _into(out, (left @ right).view(self.shape))

    def materialise(self) -> torch.Tensor:
        return self._per_sample().reshape(self.batch_size, *self.shape)


class ReluFedPart(LinearPart):
    """A :class:`LinearPart` whose output goes through ReLU into one other linear layer (weight ``w2``).

    Its output gradient is not kept through the backward pass: it is recomputed when first needed as
    ``g = (g2 w2) * [a2 > 0]`` (autograd's own ReLU backward) from what the next layer's part keeps
    anyway, its input ``a2`` (the ReLU output) and output gradient ``g2``: one GEMM instead of a
    ``(B, T, hidden)`` tensor held until the end of the pass (recomputation, Chen et al. 2016).
    Norms and the sum are both taken from the recomputed gradient. (The clipper keeps the last such
    gradient of a pass instead, see ``PerSampleClipper._kept_anyway``.)
    """

    def __init__(
        self, a: torch.Tensor, a2: torch.Tensor, g2: torch.Tensor, w2: torch.Tensor, shape: torch.Size
    ) -> None:
        self.a = a.reshape(a.shape[0], -1, a.shape[-1])
        self.shape, self.transposed = shape, False
        self._ps: torch.Tensor | None = None
        self._src: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = (a2, g2, w2, w2._version)
        self._g: torch.Tensor | None = None

    @property
    def g(self) -> torch.Tensor:  # type: ignore[override]
        if self._g is None:
            if self._src is None:
                raise RuntimeError("internal: a ReLU-fed part has neither its gradient nor its source")
            a2, g2, w2, version = self._src
            if w2._version != version:
                raise UnsafeInput(
                    "a weight was modified in place between the forward pass and the end of backward; "
                    "per-sample gradients cannot be computed (nothing was accumulated)"
                )
            flat_a2 = a2.reshape(-1, a2.shape[-1])
            grad = g2.reshape(-1, g2.shape[-1]) @ w2.to(g2.dtype)
            torch.ops.aten.threshold_backward.grad_input(grad, flat_a2, 0, grad_input=grad)
            self._g = grad.view(self.a.shape[0], -1, grad.shape[-1])
            self._src = None  # the next layer's tensors are no longer held here
        return self._g

    def stored(self) -> int:
        return self.a.numel() + (self._g.numel() if self._g is not None else 0)


def unfold(x: torch.Tensor, kernel: tuple, stride: tuple, padding: tuple, dilation: tuple) -> torch.Tensor:
    """The patches of a ``(B, C, *spatial)`` input that an N-d convolution reads:
    ``(B, C, *kernel, *out)``, a strided view of ``x`` (of a zero-padded copy where ``padding`` is
    not 0; ``F.unfold`` copies the patches and is 2-d only)."""
    if any(padding):
        pads = [q for p in reversed(padding) for q in (p, p)]
        x = torch.nn.functional.pad(x, pads)
    b, c, *size = x.shape
    st = x.stride()
    out = [(n - d * (k - 1) - 1) // s + 1 for n, k, s, d in zip(size, kernel, stride, dilation, strict=True)]
    sizes = (b, c, *kernel, *out)
    strides = (
        st[0],
        st[1],
        *(st[2 + i] * dilation[i] for i in range(len(size))),
        *(st[2 + i] * stride[i] for i in range(len(size))),
    )
    return x.as_strided(sizes, strides, x.storage_offset())


class ConvPart:
    """``G_i`` = sample ``i``'s weight gradient of an N-d convolution (1-d, 2-d, 3-d; groups, stride,
    zero padding, dilation), from its input ``a`` ``(B, C_in, *size)`` and output gradient ``b``
    ``(B, C_out, *out)``: with ``A_i`` the input's patches ``(C_in k, T)`` (``T`` output positions)
    and ``B_i`` the gradient ``(C_out, T)``, ``G_i = B_i A_i^T`` per group. A transposed convolution
    is the same with the roles swapped (its input is the gradient of a convolution reading its
    output gradient), see ``_rules._conv_transpose``.

    Squared norms (in batch chunks, so no patch matrix of the whole batch is ever formed) either
    from ``G_i`` itself (cost ``T C_in k C_out / groups`` per sample) or by the Gram identity
    ``||G_i||^2 = <A_i^T A_i, B_i^T B_i>`` (cost ``T^2 (C_in k + C_out)``), whichever is cheaper
    (:meth:`route`). The clipped sum ``sum_i w_i G_i`` is ``G``'s weighted sum where ``G`` is kept
    (built for the norms anyway and no larger than ``a`` and ``b``), else one weight-gradient
    convolution of ``a`` and ``b`` with the smaller of the two scaled per sample (what autograd
    computes for the layer without DP, with ``w_i`` folded in: linear in each operand).
    """

    _CHUNK = 1 << 20  # elements of a chunk's temporaries (patches, G or Grams): about 4 MiB in float32

    def __init__(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        shape: torch.Size,
        *,
        stride: tuple,
        padding: tuple,
        dilation: tuple,
        groups: int,
    ) -> None:
        self.a, self.b, self.shape = a, b, shape
        self.stride, self.padding, self.dilation = tuple(stride), tuple(padding), tuple(dilation)
        self.groups = groups
        self.kernel = tuple(shape[2:])
        self._ps: torch.Tensor | None = None
        # True where _ps holds each G_i transposed, (B, groups, C_in k / groups, C_out / groups)
        self._ps_t = False
        self._sq: torch.Tensor | None = None
        # input-gram: per spatial dimension, the (destination, source) slices of each kernel offset
        self._blocks: list[list[tuple[tuple, tuple]]] | None = None
        self._dims_cache: tuple[int, int, int] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.b.shape[0]) if self.b is not None else int(self._ps.shape[0])

    def stored(self) -> int:
        if self._ps is not None:
            return self._ps.numel()
        return self.a.numel() + self.b.numel()

    def _dims(self) -> tuple[int, int, int]:
        """Output positions ``T``, patch length ``C_in k / groups``, ``C_out / groups``."""
        if self._dims_cache is None:
            t = math.prod(self.b.shape[2:])
            self._dims_cache = (t, self.shape[1:].numel(), self.shape[0] // self.groups)
        return self._dims_cache

    def _positions(self) -> int:
        """Positions of the input (without its zero padding), per sample."""
        return math.prod(self.a.shape[2:])

    def route(self) -> str:
        """Cost model (per sample and group), the route of the norms and the sum:

        - ``"keep"``: ``G_i`` built (cost ``T P``, ``P = C_in k C_out / groups`` parameters per
          group, the cost of the weight-gradient convolution it replaces) and kept for the sum
          (cost ``P``), where it is no larger than ``a`` and ``b`` together;
        - otherwise the norms by the cheapest of: ``"build"`` (``G_i`` built, dropped), ``"gram"``
          (Gram identity on the patches, ``T^2 (C_in k + C_out)``, three quarters of it from
          ``T = 16`` on, see :func:`_ghost_sq_norms`), ``"input-gram"`` (the patches' Gram as the
          sum over the ``k`` kernel offsets of shifted blocks of the input's Gram:
          ``C_in S^2 + (k + C_out) T^2`` for ``S`` input positions, no patch matrix at all); the
          sum is then the weight-gradient convolution.

        Flops are weighed by measured rates: ``"build"`` at half where the grouped convolution
        forms ``G_i`` (:meth:`_grouped`). (Counting ``"gram"`` at twice its flops below 64
        positions moved the mnist CNN's second convolution to ``"build"`` by ``bmm``: 0.01-0.02x
        plain faster with a fixed malloc threshold, but 0.05 MiB more peak and page faults again
        with glibc's default; not done.)
        """
        t, k, c = self._dims()
        per_group = k * c
        if self.groups * per_group <= (self.a[0].numel() + self.b[0].numel()):
            return "keep"
        kk = math.prod(self.kernel)
        # the grouped convolution forms G_i with no patch copy, and runs its flops about twice as
        # fast as the small batched Gram products on the patches (mnist CNN, bench_dpsgd (d), second
        # convolution alone: norms 7 us per sample against 18 us by the Gram identity)
        costs = {
            "build": t * per_group * (0.5 if self._grouped(self.a) else 1.0),
            "gram": t * t * (k + c) * (0.75 if t >= 16 else 1.0) + t * k,
            "input-gram": (k // kk) * self._positions() ** 2 + (kk + c) * t * t,
        }
        return min(costs, key=costs.__getitem__)

    def _chunks(self, route: str) -> int:
        t, k, c = self._dims()
        per_sample = {
            "keep": k * t + k * c,
            "build": k * t + k * c,
            "gram": k * t + 2 * t * t,
            "input-gram": self._positions() ** 2 + 2 * t * t,
        }[route]
        # temporaries of at most a quarter of what the layer keeps anyway (its input and output
        # gradient), so a small layer's chunks do not set a small model's peak memory, but at least
        # 1 MiB: fewer, larger calls (mnist CNN, bench_dpsgd (d): 1.43x -> 1.29x plain, same peak)
        budget = min(self._CHUNK, max(1 << 18, (self.a.numel() + self.b.numel()) // 4))
        return max(1, budget // max(1, self.groups * per_sample))

    def sq_norms(self) -> torch.Tensor:
        if self._sq is not None:
            return self._sq
        route = self.route()
        a, b = _acc(self.a), _acc(self.b)
        n, g = a.shape[0], self.groups
        t, k, c = self._dims()
        grouped = route in ("keep", "build") and self._grouped(a)
        # oneDNN's grouped kernel gains from larger calls; its temporaries per sample are below the
        # patches' (no patch matrix is formed), so twice the samples keep them near the budget
        step = self._chunks(route) * (2 if grouped else 1)
        sq = torch.empty(n, dtype=a.dtype, device=a.device)
        ps = None
        if route == "keep":  # from the patches, G_i^T is formed (see below) and kept so
            ps = torch.empty(n, *(self.shape if grouped else (g, k, c)), dtype=a.dtype, device=a.device)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            m = hi - lo
            grads = b[lo:hi].reshape(m * g, c, t)  # (m G, C_out / G, T)
            if route == "input-gram":
                sq[lo:hi] = self._input_gram_sq(a[lo:hi], grads).view(m, g).sum(1)
                continue
            if grouped:
                out = None if ps is None else ps[lo:hi]
                per = self._per_sample_grouped(a[lo:hi], b[lo:hi], out)
                sq[lo:hi] = _sq(per.view(m, -1))
                continue
            cols = unfold(a[lo:hi], self.kernel, self.stride, self.padding, self.dilation)
            cols = cols.reshape(m * g, k, t)  # (m G, C_in k / G, T) patches
            if route == "gram":
                sq[lo:hi] = _ghost_sq_norms(cols.transpose(1, 2), [grads.transpose(1, 2)]).view(m, g).sum(1)
            else:
                # G_i^T = A_i B_i^T rather than G_i = B_i A_i^T: MKL runs this order faster where
                # C_in k is small (cifar10 CNN's first convolution, k = 27, T = 1024: 22 against
                # 39 us per sample), and no slower elsewhere measured; the norms do not mind
                out = None if ps is None else ps[lo:hi].view(m * g, k, c)
                per = torch.bmm(cols, grads.transpose(1, 2), out=out)
                sq[lo:hi] = _sq(per.view(m, -1))
        self._sq = sq
        if ps is not None:  # the sum needs only G: the input and gradient are let go now
            self._ps, self._ps_t, self.a, self.b = ps, not grouped, None, None  # type: ignore[assignment]
        return sq

    def _grouped(self, a: torch.Tensor) -> bool:
        """Whether ``G_i`` is formed by one grouped convolution (:meth:`_per_sample_grouped`)
        rather than from the patches (a strided copy of ``C_in k T`` values per sample, then a
        batched matmul): in float32 on the CPU with oneDNN, for 2-d kernels with patches of
        ``C_in k / groups >= 64``, where each sample's gradient is large (``C_in k C_out / groups^2
        >= 4096``) over ``T >= 64`` positions, or where a group has one input channel (a forward
        convolution then). Measured per sample with one thread (chunks of 32; patch copy + ``bmm``
        against the grouped convolution), cifar10 CNN (``benchmarks/bench_dpsgd.py`` (e)): second
        convolution (``C_in k = 288, C_out = 64, T = 256``) 130 against 57 us, third (576, 64, 64)
        85 against 42; mnist CNN (d) first (64, 16, 196, one input channel) 10 against 8 (14 by
        the weight-gradient convolution). Slower where the gradient is small, cifar10 first (27,
        32, 1024) 25 against 55, or with few positions, cifar10 fourth (576, 128, 16) 38 against
        55. The mnist CNN's second (256, 32, 25) is faster alone (13 against 7, and 18 by the Gram
        identity), but inside the step its 1 MiB temporaries made glibc hand pages back and fault
        them in again (500-950 page faults a step, about 1 ms; none with the Gram identity)."""
        t, k, c = self._dims()
        return (
            a.dtype == torch.float32
            and a.device.type == "cpu"
            and len(self.kernel) == 2
            and k >= 64
            and ((k * c >= 4096 and t >= 64) or self.shape[1] == 1)
            and torch.backends.mkldnn.is_available()
            and bool(torch.backends.mkldnn.enabled)  # else a per-group loop: far slower
        )

    def _per_sample_grouped(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """``G_i`` for a chunk of samples as one weight-gradient convolution with the samples as
        groups (a forward one where a group has a single input channel): the batch folded into the
        channels, ``groups`` times the chunk size."""
        m, nd = a.shape[0], len(self.kernel)
        if self.shape[1] == 1:
            # one input channel per group: G_i is the correlation of that channel with each output
            # gradient channel, a forward convolution with the gradients as kernels (stride and
            # dilation swap roles), laid out as G already; oneDNN's forward kernel is the faster
            # (mnist CNN's first convolution, 1 -> 16 channels, 8x8: 0.53 against 0.85 ms a batch)
            s = torch.ops.aten.convolution(
                a.reshape(1, -1, *a.shape[2:]),
                b.reshape(-1, 1, *b.shape[2:]),
                None,
                self.dilation,
                self.padding,
                self.stride,
                False,
                (0,) * nd,
                m * self.groups,
            )
            # positions past the kernel: the input's tail that the layer's stride never reached
            s = s[(0, slice(None), *(slice(0, k) for k in self.kernel))].view(m, *self.shape)
            return s.contiguous() if out is None else out.copy_(s)
        s = torch.ops.aten.convolution_backward(
            b.reshape(1, -1, *b.shape[2:]),
            a.reshape(1, -1, *a.shape[2:]),
            b.new_empty(1).expand(m * self.shape[0], *self.shape[1:]),
            None,
            self.stride,
            self.padding,
            self.dilation,
            False,
            (0,) * nd,
            m * self.groups,
            (False, True, False),
        )[1].view(m, *self.shape)
        return s if out is None else out.copy_(s)

    def _input_gram_sq(self, a: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        """``<A^T A, B^T B>`` per (sample, group) with ``A^T A`` from the input's Gram ``X^T X``
        (``S x S`` for ``S`` input positions): ``(A^T A)[t, u] = sum_o (X^T X)[t s + o d - p,
        u s + o d - p]`` over the kernel offsets ``o`` (a patch entry is the input at position
        ``t s + o d - p``), where both positions fall inside the input; padding reads zeros, which
        add nothing, so the zero-padded input's larger Gram is never formed (cifar10 CNN, bench_dpsgd
        (e), third convolution, 8x8 input: 100^2 -> 64^2 entries per channel, norms 6.8 -> 3.8 ms).
        The sum is separable: one spatial dimension at a time (the ``t`` and ``u`` copies of it go
        from input to output positions), each offset along it adding one block, a slice over the
        output positions whose patch entry at that offset is inside the input (the same range for
        ``t`` and ``u``): ``sum_d k_d`` strided adds instead of ``prod_d k_d`` (3x3: 6 for 9; the
        adds were 3.3 of the cifar10 CNN step's 5.8 ms in this function)."""
        mg, nd = grads.shape[0], len(self.kernel)
        size, out = tuple(a.shape[2:]), tuple(self.b.shape[2:])
        x = a.reshape(mg, -1, math.prod(size))
        cur = torch.bmm(x.transpose(1, 2), x).view(mg, *size, *size)
        if self._blocks is None:  # the same for every chunk
            self._blocks = []
            for d in range(nd):
                s, per = self.stride[d], []
                for o in range(self.kernel[d]):
                    off = o * self.dilation[d] - self.padding[d]
                    lo = max(0, -(off // s))  # first output position reading inside the input
                    hi = min(out[d], (size[d] - 1 - off) // s + 1)
                    if hi <= lo:
                        continue  # this offset reads only padding
                    dst, src = [slice(None)] * (1 + 2 * nd), [slice(None)] * (1 + 2 * nd)
                    dst[1 + d] = dst[1 + nd + d] = slice(lo, hi)
                    src[1 + d] = src[1 + nd + d] = slice(lo * s + off, (hi - 1) * s + off + 1, s)
                    per.append((tuple(dst), tuple(src)))
                self._blocks.append(per)
        for d in range(nd):
            shape = list(cur.shape)
            shape[1 + d] = shape[1 + nd + d] = out[d]
            nxt = torch.zeros(shape, dtype=cur.dtype, device=cur.device)
            for into, read in self._blocks[d]:
                nxt[into] += cur[read]
            cur = nxt
        gg = torch.bmm(grads.transpose(1, 2), grads)  # (m G, T, T)
        return (cur.view_as(gg) * gg).flatten(1).sum(1)

    def weighted_sum(self, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_i w_i G_i``; added in place into ``out`` when given (and ``out`` returned)."""
        if self._ps is not None and self._ps_t:
            ps = self._ps.flatten(1)
            s = (w.to(ps.dtype) @ ps).view(self._ps.shape[1:]).transpose(1, 2)  # (groups, C_out / G, k)
            return _into(out, s.reshape(self.shape))
        if self._ps is not None:
            return DensePart(self._ps, self.shape).weighted_sum(w, out)
        a, b = _acc(self.a), _acc(self.b)
        shape = (-1,) + (1,) * (a.dim() - 1)
        if a.numel() <= b.numel():
            a = a * w.to(a.dtype).view(shape)
        else:
            b = b * w.to(b.dtype).view(shape)
        nd = len(self.kernel)
        s = torch.ops.aten.convolution_backward(
            b,
            a,
            b.new_empty(1).expand(self.shape),
            None,
            self.stride,
            self.padding,
            self.dilation,
            False,
            (0,) * nd,
            self.groups,
            (False, True, False),
        )[1]
        return _into(out, s)

    def materialise(self) -> torch.Tensor:
        if self._ps is not None and self._ps_t:
            return self._ps.transpose(2, 3).reshape(self._ps.shape[0], *self.shape)
        if self._ps is not None:
            return self._ps
        a, b = _acc(self.a), _acc(self.b)
        n, g = a.shape[0], self.groups
        t, k, c = self._dims()
        cols = unfold(a, self.kernel, self.stride, self.padding, self.dilation).reshape(n * g, k, t)
        return torch.bmm(b.reshape(n * g, c, t), cols.transpose(1, 2)).view(n, *self.shape)


class EmbeddingPart:
    """``G_i[v] = sum_{t: idx_it = v} g_it`` for an embedding lookup, rows ``padding_idx`` excluded.

    Squared norms by summing ``g`` per (sample, token) pair (a sort over ``B T`` keys), never a
    ``V x d`` gradient per sample and no ``T^2`` Gram matrix.
    """

    def __init__(self, idx: torch.Tensor, g: torch.Tensor, shape: torch.Size, padding_idx: int | None):
        b = idx.shape[0]
        idx = idx.reshape(b, -1)
        g = g.reshape(b, -1, g.shape[-1])
        self.b, self.shape = b, shape
        sample = torch.arange(b, device=idx.device).unsqueeze(1).expand_as(idx)
        keep = None if padding_idx is None else idx != padding_idx
        idx, sample, g = idx.reshape(-1), sample.reshape(-1), g.reshape(-1, g.shape[-1])
        if keep is not None:
            keep = keep.reshape(-1)
            idx, sample, g = idx[keep], sample[keep], g[keep]
        self.idx, self.sample, self.g = idx, sample, _acc(g)

    @classmethod
    def from_rows(
        cls, idx: torch.Tensor, sample: torch.Tensor, g: torch.Tensor, b: int, shape: torch.Size
    ) -> EmbeddingPart:
        """The part of lookups given row by row: row ``idx[j]`` read for sample ``sample[j]``, with
        output gradient ``g[j]`` (an ``nn.EmbeddingBag``: one bag per sample, rows of any count)."""
        out = cls.__new__(cls)
        out.b, out.shape = b, shape
        out.idx, out.sample, out.g = idx.reshape(-1), sample.reshape(-1), _acc(g)
        return out

    @property
    def batch_size(self) -> int:
        return self.b

    def stored(self) -> int:
        return self.g.numel()

    def sq_norms(self) -> torch.Tensor:
        keys = self.sample * self.shape[0] + self.idx
        uniq, inverse = torch.unique(keys, return_inverse=True)
        rows = torch.zeros(uniq.numel(), self.g.shape[1], dtype=self.g.dtype, device=self.g.device)
        rows.index_add_(0, inverse, self.g)
        out = torch.zeros(self.b, dtype=self.g.dtype, device=self.g.device)
        return out.index_add_(0, uniq // self.shape[0], _sq(rows))

    def weighted_sum(self, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_i w_i G_i``; added in place into ``out`` when given (and ``out`` returned)."""
        rows = self.g * w.to(self.g.dtype)[self.sample].unsqueeze(1)
        if out is not None and out.dtype == rows.dtype:
            return out.index_add_(0, self.idx, rows)
        s = torch.zeros(self.shape, dtype=self.g.dtype, device=self.g.device)
        return _into(out, s.index_add_(0, self.idx, rows))

    def materialise(self) -> torch.Tensor:
        out = torch.zeros(self.b, *self.shape, dtype=self.g.dtype, device=self.g.device)
        out.index_put_((self.sample, self.idx), self.g, accumulate=True)
        return out


class StackedPart:
    """Parts for consecutive row blocks of one parameter (the packed q/k/v projection weight)."""

    def __init__(self, blocks: list[LinearPart], shape: torch.Size) -> None:
        self.blocks, self.shape = blocks, shape

    @property
    def batch_size(self) -> int:
        return self.blocks[0].batch_size

    def stored(self) -> int:
        return sum(b.stored() for b in self.blocks)

    def sq_norms(self) -> torch.Tensor:
        first = self.blocks[0]
        shared = first.a.shape[1] > 1 and all(
            type(b) is LinearPart and same_elements(b.a, first.a) and not b.materialises()
            for b in self.blocks
        )
        if shared:  # one input to all blocks (self-attention's q/k/v): its Gram once
            return _ghost_sq_norms(first.a, [b.g for b in self.blocks])
        return torch.stack([b.sq_norms() for b in self.blocks]).sum(0)

    def weighted_sum(self, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``sum_i w_i G_i``; added in place into ``out`` when given (and ``out`` returned)."""
        if out is not None and out.is_contiguous():
            rows = out.view(-1, self.shape[-1])
            start = 0
            for b in self.blocks:  # each block owns consecutive rows of the packed weight
                n = b.shape[0]
                b.weighted_sum(w, rows[start : start + n])
                start += n
            return out
        return _into(out, torch.cat([b.weighted_sum(w) for b in self.blocks]).view(self.shape))

    def materialise(self) -> torch.Tensor:
        return torch.cat([b.materialise() for b in self.blocks], dim=1).view(self.batch_size, *self.shape)


Part = DensePart | LinearPart | EmbeddingPart | StackedPart | ConvPart


def combine(parts: list[Part]) -> Part:
    """One part for a parameter used by several calls (a layer reused, weights tied).

    Several linear calls of the same weight are one linear map applied at more positions, so their
    inputs are concatenated along the position axis (ghost norms stay exact, cross terms included);
    the same for embedding lookups. Mixed kinds are materialised and summed per sample.
    """
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if all(isinstance(p, LinearPart) for p in parts):
        lin = [p for p in parts if isinstance(p, LinearPart)]
        if all(p.transposed == lin[0].transposed for p in lin):
            a = torch.cat([p.a for p in lin], dim=1)
            g = torch.cat([p.g for p in lin], dim=1)
            return LinearPart(a, g, first.shape, lin[0].transposed)
    if all(isinstance(p, EmbeddingPart) for p in parts):
        emb = [p for p in parts if isinstance(p, EmbeddingPart)]
        out = EmbeddingPart.__new__(EmbeddingPart)
        out.b, out.shape = emb[0].b, emb[0].shape
        out.idx = torch.cat([p.idx for p in emb])
        out.sample = torch.cat([p.sample for p in emb])
        out.g = torch.cat([p.g for p in emb])
        return out
    total = parts[0].materialise().reshape(first.batch_size, *first.shape)
    for p in parts[1:]:
        total = total + p.materialise().reshape(first.batch_size, *first.shape)
    return DensePart(total, first.shape)
