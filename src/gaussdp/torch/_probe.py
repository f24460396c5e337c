"""The independence probe of ``make_private``: does one sample move another's computation?

Per-sample clipping bounds the sensitivity of the clipped sum (``C`` under add/remove of a record,
``2 C`` under replace-one) only if each row of the batch dimension is one sample and nothing carries
one sample into another row's output or gradient. Validation by module type
(:class:`gaussdp.torch.ModuleValidator`) catches the known culprits (``BatchNorm``); the probe
catches the rest that shows on a real batch: a parameter-free statistic over the batch
(``x - x.mean(0)``), the sequence in the batch dimension (a transpose to ``(T, B, ...)`` while
``batch_first=True``), a recurrence or attention run across the batch.

What it does: ``m`` records of the dataset (a quarter of a batch, at least 2 and at most 32: both
runs together cost about half a forward and backward pass of a training batch), collated with the
loader's ``collate_fn``, and the same records with the first one replaced by another record of the dataset
whose inputs have the same shapes (so that a collate padding to the longest record pads both alike).
The module is run on a batch as most training loops do (:func:`_calls`: ``module(*batch[:-1])``
then ``module(batch[0])`` for a tuple, ``module(**batch)`` without the target keys for a dict), or
by the function given as ``independence_probe``.
Each batch is run forward and backward with the same random state (dropout draws the same masks),
through the clipper's own hooks, with a fixed random linear loss on the outputs. Then:

1. every hooked layer must see ``m`` rows (one per sample) in the batch dimension;
2. the outputs of samples ``1..m-1`` must not move;
3. their per-sample gradient norms, and for each parameter a random combination of their clipped
   per-sample gradients, must not move.

Tolerances are relative, ``1e-3`` in float32 and float64 (the runs compute each row with the same
kernels, so an independent model moves by rounding at most) and ``2e-2`` where a parameter or output
is in half precision. A movement larger than that is refused with :class:`SampleMixing`, naming
what moved. Torch's random state (CPU and the module's GPUs), the module's buffers, train/eval
flags and gradients, and the clipper are restored afterwards: the probe leaves no trace there.

What no check can catch: a loss that mixes the samples (contrastive losses, a loss normalised over
the batch: the probe uses its own per-sample loss), behaviour that depends on the batch size or on
the data (a branch taken only for some batches, a collate that pads to the longest record of the
batch when the model does not mask the padding: records of other lengths are not tried), state
kept outside parameters and buffers, and anything the training loop does beyond the model's
forward pass. Those are the user's to ensure.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gaussdp.errors import InvalidParameter, PrivacyError

__all__ = ["ProbeReport", "SampleMixing", "run_probe"]

# keys of a dict batch that hold targets, not inputs (Hugging Face "labels", datasets' "label")
_TARGET_KEYS = frozenset({"label", "labels", "target", "targets", "y"})
_SCAN = 64  # records looked at for a replacement of the first one
# The most records the probe runs at once. Mixing moves the other samples by about 1/m of the
# change (x - x.mean(0)), far above the tolerance at this size; a larger batch would only cost
# memory (make_private does not know the physical batch size a BatchMemoryManager will use).
_MAX_SAMPLES = 32
_SEED = 20240917  # the probe's own random state: the same for both runs


class SampleMixing(InvalidParameter):
    """The independence probe saw one sample move another sample's output or per-sample gradient,
    or the batch dimension hold something other than the samples."""


@dataclass(frozen=True)
class ProbeReport:
    """What the independence probe ran and measured (``PrivacyEngine.probe_report``).

    ``samples``: the batch it used (0 if skipped); ``output_change`` and ``gradient_change``: the
    largest relative movement seen in the other samples' outputs and per-sample gradients;
    ``seconds``: its wall time; ``skipped``: why it could not run, or None.
    """

    samples: int
    output_change: float
    gradient_change: float
    seconds: float
    skipped: str | None = None


def _calls(batch: Any) -> list[tuple[str, Callable[[nn.Module], Any]]]:
    """The ways the probe tries to run a module on ``batch``, in order, with how each reads.

    A tensor is the input. A tuple or list is ``(*inputs, target)``: ``module(*batch[:-1])``,
    then ``module(batch[0])`` (one element: ``module(batch[0])``). A dict holds keyword inputs:
    ``module(**batch)`` without the target keys ``label(s)``, ``target(s)`` and ``y``.
    """
    if isinstance(batch, torch.Tensor):
        return [("module(batch)", lambda m: m(batch))]
    if isinstance(batch, Mapping):
        kwargs = {k: v for k, v in batch.items() if k not in _TARGET_KEYS}
        return [("module(**batch) without its target keys", lambda m: m(**kwargs))]
    if isinstance(batch, list | tuple) and batch:
        out: list[tuple[str, Callable[[nn.Module], Any]]] = []
        if len(batch) > 2:
            out.append(("module(*batch[:-1])", lambda m: m(*batch[:-1])))
        out.append(("module(batch[0])", lambda m: m(batch[0])))
        return out
    raise TypeError(f"a batch of type {type(batch).__name__} (not a tensor, tuple, list or dict)")


def _key_inputs(batch: Any) -> Any:
    """What every way of :func:`_calls` gives the module (a changed record must change it)."""
    if isinstance(batch, Mapping):
        return {k: v for k, v in batch.items() if k not in _TARGET_KEYS}
    if isinstance(batch, list | tuple):
        return batch[0] if batch else None
    return batch


def _all_inputs(batch: Any) -> Any:
    """Everything any way of :func:`_calls` may give the module (its shapes must not change)."""
    if isinstance(batch, list | tuple):
        return tuple(batch[:-1]) if len(batch) > 1 else tuple(batch)
    return _key_inputs(batch)


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, Mapping):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


def _same(a: Any, b: Any) -> bool:
    la, lb = list(_leaves(a)), list(_leaves(b))
    if len(la) != len(lb):
        return False
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def _shapes(tree: Any) -> list[Any]:
    return [tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in _leaves(tree)]


def _to(tree: Any, device: torch.device) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, Mapping):
        return {k: _to(v, device) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_to(v, device) for v in tree)
    return tree


def _rtol(*dtypes: torch.dtype) -> float:
    return 2e-2 if any(d in (torch.float16, torch.bfloat16) for d in dtypes) else 1e-3


class ProbeRecord:
    """What the clipper measured in one probe run: rows per layer, per-row norms (before
    clipping), and per parameter ``sum_j r_j c_j`` over the clipped per-sample gradients ``c_j``
    with fixed random weights ``r_j`` (``r_0 = 0``: the changed sample is left out)."""

    def __init__(self) -> None:
        self.rows: int | None = None
        self.norms: torch.Tensor | None = None
        self.sums: dict[nn.Parameter, torch.Tensor] = {}

    def weights(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        g = torch.Generator().manual_seed(_SEED)
        r = torch.rand(rows, generator=g, dtype=torch.float64) + 0.5
        r[0] = 0.0
        return r.to(device=like.device, dtype=like.dtype)


def run_probe(
    module: nn.Module,
    clipper: Any,
    data_loader: Any,
    *,
    run: Callable[[nn.Module, Any], Any] | None,
    batch_first: bool,
    expected_batch_size: float,
) -> ProbeReport:
    """Run the probe described in the module docstring; raise :class:`SampleMixing` on a finding.

    Args:
        module: the model (inside any DDP wrapper), hooked by ``clipper``.
        clipper: its :class:`gaussdp.torch.PerSampleClipper`.
        data_loader: the user's loader: its ``dataset`` and ``collate_fn`` give the batch.
        run: ``run(module, batch) -> output``, how the training loop runs the model on a batch as
            the loader yields it; None: the ways of :func:`_calls`, on the module's device.
        batch_first: where the batch dimension of the outputs is looked for (0, else 1).
        expected_batch_size: the loader's (expected) batch size; the probe uses a quarter (at most 32).

    Raises:
        SampleMixing: a finding (the message names it).
        InvalidParameter: the module could not be run on the batch the default way.
        PrivacyError: the clipper refused the batch (its message says why).
    """
    t0 = time.perf_counter()
    with _preserved(module, clipper):  # a dataset's random transforms draw from torch's generator too
        found = _batches(data_loader, expected_batch_size, key_all=run is not None)
        if isinstance(found, str):
            return ProbeReport(0, 0.0, 0.0, time.perf_counter() - t0, found)
        return _run(module, clipper, *found, run=run, batch_first=batch_first, t0=t0)


def _batches(data_loader: Any, expected_batch_size: float, *, key_all: bool) -> tuple[int, list[Any]] | str:
    """``m`` and the probe's two batches (``m`` records; the same with record 0 replaced), or why
    there are none."""
    dataset = data_loader.dataset
    try:
        n = len(dataset)
    except TypeError:
        return "the dataset has no length"
    m = min(max(2, -(-round(expected_batch_size) // 4)), _MAX_SAMPLES, n - 1)
    if m < 2:
        return f"the dataset has {n} records (< 3)"
    collate = data_loader.collate_fn
    records = [dataset[i] for i in range(m)]

    def key(record: Any) -> tuple[Any, Any]:  # (what must differ, what must keep its shapes)
        one = collate([record])
        return (one, one) if key_all else (_key_inputs(one), _all_inputs(one))

    first = key(records[0])
    for k in range(m, min(n, m + _SCAN)):
        other = dataset[k]
        cand = key(other)
        if _shapes(cand[1]) == _shapes(first[1]) and not _same(cand[0], first[0]):
            return m, [collate(records), collate([other, *records[1:]])]
    return f"none of records {m}..{min(n, m + _SCAN) - 1} differs from record 0 with inputs of its shapes"


def _run(
    module: nn.Module,
    clipper: Any,
    m: int,
    batches: list[Any],
    *,
    run: Callable[[nn.Module, Any], Any] | None,
    batch_first: bool,
    t0: float,
) -> ProbeReport:
    """Both runs, their comparison, and the finding raised or the report returned."""
    params = list(module.parameters())
    device = params[0].device if params else torch.device("cpu")

    chosen: list[int] = []  # the way of _calls that ran the first batch, for the second

    def forward(batch: Any) -> Any:
        if run is not None:
            return run(module, batch)
        ways = _calls(_to(batch, device))
        if chosen:
            return ways[chosen[0]][1](module)
        errors = []
        for i, (how, call) in enumerate(ways):
            try:
                out = call(module)
            except PrivacyError:
                raise
            except Exception as err:
                clipper.reset()  # the calls a failed forward left
                errors.append(f"{how}: {type(err).__name__}: {err}")
                continue
            chosen.append(i)
            return out
        raise InvalidParameter(
            "independence_probe: make_private runs the module on a batch of the data loader to check "
            "that no sample moves another's output or gradient, and could not: "
            + "; ".join(errors)
            + ". Pass independence_probe=fn, where fn(module, batch) runs the module on a batch as "
            "your training loop does, or independence_probe=False to skip the check (per-sample "
            "independence is then yours to ensure)"
        )

    runs = []
    for batch in batches:
        _seed(module)  # the same dropout masks in both runs (restored afterwards)
        with clipper.probing() as record, torch.enable_grad():
            out = forward(batch)
            outs = [t for t in _leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            g = torch.Generator().manual_seed(_SEED)
            loss = None
            for t in outs:
                if not t.requires_grad:
                    continue
                cot = torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.device, t.dtype)
                term = (t * cot).sum()
                loss = term if loss is None else loss + term
            if loss is not None:
                if clipper.loss_reduction == "mean":
                    loss = loss / m
                loss.backward()
        runs.append(([t.detach() for t in outs], record))
    out_change = _compare_outputs(runs[0][0], runs[1][0], m, batch_first)
    grad_change, moved = _compare_gradients(runs[0][1], runs[1][1], m, clipper, batch_first)
    seconds = time.perf_counter() - t0
    if out_change is not None and out_change[0] > out_change[1]:
        how = (
            "the shapes of the outputs changed"
            if out_change[2] < 0
            else f"by up to {out_change[0]:.3g} of their size, at sample {out_change[2]}"
        )
        raise SampleMixing(
            f"the independence probe changed sample 0 of a batch of {m} records and the outputs of other "
            f"samples moved ({how}): the "
            "module mixes the samples of a batch (a statistic over the batch such as x - x.mean(0), "
            "or the sequence in the batch dimension, e.g. a transpose to (T, B, ...) with "
            f"batch_first={batch_first}), so clipping each sample's gradient does not bound one "
            "record's influence. Make every computation per sample (independence_probe=False "
            "skips this check)"
        )
    if grad_change[0] > grad_change[1]:
        what = f"parameters {moved}" if moved else "their norms"
        raise SampleMixing(
            f"the independence probe changed sample 0 of a batch of {m} records and the per-sample "
            f"gradients of other samples moved (by up to {grad_change[0]:.3g} relative; {what}): "
            "something carries one sample into another's gradient (a computation across the batch, "
            "or rows of the batch dimension that are not the samples), so clipping each row does "
            "not bound one record's influence. Make every computation per sample "
            "(independence_probe=False skips this check)"
        )
    return ProbeReport(m, 0.0 if out_change is None else out_change[0], grad_change[0], seconds)


def _batch_axis(t: torch.Tensor, m: int, batch_first: bool) -> int | None:
    """The axis of an output that holds the samples where it is unambiguous (dimension 0 with
    ``batch_first``, else dimension 1 or 0), or None."""
    axes = [a for a in (0, 1) if a < t.dim() and t.shape[a] == m]
    if len(axes) != 1 or (batch_first and axes[0] != 0):
        return None
    return axes[0]


def _compare_outputs(
    a: list[torch.Tensor], b: list[torch.Tensor], m: int, batch_first: bool
) -> tuple[float, float, int] | None:
    """(largest relative change of another sample's output, tolerance, that sample), or None when
    no output holds the samples on an axis the probe can tell."""
    if [t.shape for t in a] != [t.shape for t in b]:
        return (float("inf"), 0.0, -1)  # the shapes of the outputs depend on sample 0
    worst: tuple[float, float, int] | None = None
    for x, y in zip(a, b, strict=True):
        axis = _batch_axis(x, m, batch_first)
        if axis is None:
            continue
        xs = x.movedim(axis, 0)[1:].flatten(1).double()
        ys = y.movedim(axis, 0)[1:].flatten(1).double()
        if not (bool(torch.isfinite(xs).all()) and bool(torch.isfinite(ys).all())):
            continue  # non-finite outputs are refused by the clipper where they reach a gradient
        diff = (xs - ys).abs().amax(dim=1)
        scale = float(xs.abs().amax()) if xs.numel() else 0.0
        j = int(diff.argmax()) if diff.numel() else 0
        rel = float(diff[j]) / scale if scale > 0 else (float("inf") if float(diff[j]) > 0 else 0.0)
        item = (rel, _rtol(x.dtype), j + 1)
        if worst is None or item[0] - item[1] > worst[0] - worst[1]:
            worst = item
    return worst


def _compare_gradients(
    a: ProbeRecord, b: ProbeRecord, m: int, clipper: Any, batch_first: bool
) -> tuple[tuple[float, float], list[str]]:
    """((largest relative change of the other samples' gradients, tolerance), parameters moved)."""
    dim = 0 if batch_first else 1
    for rec in (a, b):
        if rec.rows is not None and rec.rows != m:
            raise SampleMixing(
                f"the independence probe ran a batch of {m} records and the hooked layers saw "
                f"{rec.rows} rows in the batch dimension (dimension {dim} of every layer input, "
                f"batch_first={batch_first}): per-sample clipping treats each row as one sample, "
                "so something else is there (e.g. the sequence, after a transpose to (T, B, ...)); "
                "put the samples in that dimension, or set batch_first to where they are"
            )
    if a.norms is None or b.norms is None:
        return (0.0, 0.0), []
    rtol = _rtol(*(p.dtype for p in a.sums))
    na, nb = a.norms[1:].double(), b.norms[1:].double()
    worst = float((na - nb).abs().max() / na.abs().max()) if float(na.abs().max()) > 0 else 0.0
    if float(na.abs().max()) == 0 and float(nb.abs().max()) > 0:
        worst = float("inf")
    moved: list[str] = []
    for p, sa in a.sums.items():
        sb = b.sums.get(p)
        if sb is None:
            worst, moved = float("inf"), [*moved, clipper.names.get(id(p), "?")]
            continue
        da = sa.double()
        size = max(float(da.norm()), float(sb.double().norm()))
        diff = float((da - sb.double()).norm())
        rel = diff / size if size > 0 else (float("inf") if diff > 0 else 0.0)
        if rel > rtol:
            moved.append(clipper.names.get(id(p), "?"))
        worst = max(worst, rel)
    return (worst, rtol), moved


def _cuda_devices(module: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})


def _seed(module: nn.Module) -> None:
    """Seed the generators the module's forward draws from: the CPU's and its CUDA devices' (only
    those, whose states :class:`_preserved` restores; ``torch.manual_seed`` would seed every GPU)."""
    torch.default_generator.manual_seed(_SEED)
    for i in _cuda_devices(module):
        torch.cuda.default_generators[i].manual_seed(_SEED)


class _preserved:
    """Everything the probe's runs could change, put back afterwards: the random state (CPU and the
    module's CUDA devices), buffers, train/eval flags, parameter gradients, the clipper's state."""

    def __init__(self, module: nn.Module, clipper: Any) -> None:
        self.module, self.clipper = module, clipper

    def __enter__(self) -> None:
        m = self.module
        self.rng = torch.random.fork_rng(devices=_cuda_devices(m))
        self.rng.__enter__()
        # each buffer by its owner and name: a forward may replace one rather than update it
        self.buffers = [
            (s, name, b, b.detach().clone())
            for s in m.modules()
            for name, b in s._buffers.items()
            if b is not None
        ]
        self.training = [(s, s.training) for s in m.modules()]
        self.grads = [(p, p.grad) for p in m.parameters()]
        for p in m.parameters():
            p.grad = None

    def __exit__(self, *exc: object) -> None:
        try:
            with torch.no_grad():
                for s, name, b, saved in self.buffers:
                    s._buffers[name] = b
                    b.copy_(saved)
            for s, flag in self.training:
                s.training = flag
            for p, g in self.grads:
                p.grad = g
        finally:
            self.rng.__exit__(None, None, None)
