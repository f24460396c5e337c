"""DP-SGD step time and peak memory: plain PyTorch vs gaussdp vs Opacus (hooks, ghost), one process.

Cases: (a) MLP 784-512-512-10, batch 256; (b) 2-layer ``nn.TransformerEncoder`` (d=256, 8 heads,
feed-forward 1024, seq 64, batch 32) on token ids with an embedding and a classification head;
(c) the same with LoRA (r=8) adapters on the feed-forward layers as the only trainable parameters;
(d) Opacus's ``examples/mnist.py`` CNN (``SampleConvNet``), batch 64 of 1x28x28;
(e) Opacus's ``examples/cifar10.py`` CNN (``convnet``), batch 128 of 3x32x32;
(f) the same with a ``GroupNorm(min(32, C), C)`` after each convolution (what ``ModuleValidator.fix``
makes of a BatchNorm there);
(g) Opacus's ``examples/char-lstm-classification.py`` classifier with its ``DPLSTM`` (embedding 64,
hidden 128, 18 classes), its default batch 800, names padded to 16 characters. Plain PyTorch runs
the same ``DPLSTM`` (its own unfused recurrence).

Step = forward + backward + optimizer step (+ zero_grad), on the same fixed batch for every method
(gaussdp draws it from its loader each step, as ``poisson_sampling=False`` requires: the same
tensors, no copy; see ``_fixed_loader``).
Time: median over interleaved repetitions of a block of consecutive steps per method (the methods
take turns, so a busy machine slows them all alike), each block after one untimed step of the same
method (so no method is timed in the cache and heap state another one left: Opacus's hooks mode
frees about 1 GiB per step, which made the next method pay page faults), both wall-clock and CPU
time (the training thread's ``thread_time``); with one torch thread (the default here) CPU time is
what the step costs, unaffected by other processes taking the cores. Memory: peak bytes of live
tensor storages (parameters, gradients, optimizer state, activations, temporaries) during one step,
counted by a ``TorchDispatchMode`` that sees every op's outputs (``PeakMemory`` below; torch's own
``MemTracker`` cannot be used: it registers gradient hooks on parameters). Checked from the
allocator's side (``alloc MiB``: the CPU allocator's events in torch's profiler, which also sees
buffers an op allocates and frees inside itself, and leaves autograd's in-place gradient
accumulation on; see ``allocator_peak_bytes``).
The Opacus rows use ``poisson_sampling=False`` like the others (same fixed batch), and contiguous
position ids: ``.expand()``ed ones make Opacus's ghost mode fail (``view`` on a non-contiguous
tensor in ``embedding_norm_sample``); gaussdp handles both (tested).
``gaussdp`` is flat clipping (the goal's comparison); ``gaussdp-per-layer`` is the opt-in
``clipping="per_layer"`` (one bound per parameter, ``C / sqrt(n)`` each), a different algorithm
shown for its memory. Opacus cannot run ``nn.MultiheadAttention`` as is: its rows use
``ModuleValidator.fix`` (its own ``DPMultiheadAttention``), the other rows the original module.

Memory floor of the CNN rows (d, e, f) for exact flat clipping in one backward pass, printed under
each of their tables (:func:`one_pass_floor`): every clip factor needs the whole gradient's norm,
known only when the first layer's output gradient arrives, and until then each later layer must
hold what its clipped sum is formed from, at least the smaller of its per-sample gradients and its
(input, output gradient). Plain training peaks inside that stretch: the cifar10 CNN in the first
block's backward (its ReLU output and two gradients of 16 MiB each) while the second to fourth
convolutions hold 9 + 4 + 1.5 MiB; the mnist CNN in the first max-pool's backward while the second
convolution holds its input and output gradient (0.86 MiB). Floors: (d) 1.20x, (e) 1.28x, (f)
1.15x plain; gaussdp's peaks are within 0.1 MiB of them. Below them only recomputation goes (a
second backward pass, or re-running layers), which costs time: recomputing the second
convolution's output gradient from the third's (one transposed convolution and a ReLU mask) would
still leave (e) at 1.19x, since the third and fourth convolutions alone hold 5.5 MiB (0.11x).

Run: ``.venv/bin/python benchmarks/bench_dpsgd.py [--reps 15] [--only a,b,c,d,e,f,g]
[--methods plain,gaussdp,...]`` (one thread by default: ``--threads``).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import os
import statistics
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # the profiler's start/stop lines (allocator_peak_bytes)

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

warnings.filterwarnings("ignore")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``B A`` (r=8)."""

    def __init__(self, base: nn.Linear, r: int = 8) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, r, bias=False)
        self.lora_b = nn.Linear(r, base.out_features, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class Encoder(nn.Module):
    def __init__(self, vocab: int = 1000, d: int = 256, seq: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        layer = nn.TransformerEncoderLayer(d, 8, dim_feedforward=1024, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 10)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1]).repeat(idx.shape[0], 1)  # contiguous: Opacus ghost fails on expand()
        return self.head(self.encoder(self.emb(idx) + self.pos(pos)).mean(1))


class SampleConvNet(nn.Module):
    """Opacus's ``examples/mnist.py`` model."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))  # -> [B, 16, 14, 14]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 16, 13, 13]
        x = F.relu(self.conv2(x))  # -> [B, 32, 5, 5]
        x = F.max_pool2d(x, 2, 1)  # -> [B, 32, 4, 4]
        x = x.view(-1, 32 * 4 * 4)  # -> [B, 512]
        x = F.relu(self.fc1(x))  # -> [B, 32]
        return self.fc2(x)  # -> [B, 10]


def cifar10_convnet(group_norm: bool = False) -> nn.Module:
    """Opacus's ``examples/cifar10.py`` ``convnet(10)``; with a GroupNorm after each convolution."""
    layers: list[nn.Module] = []
    for i, (c_in, c_out) in enumerate(((3, 32), (32, 64), (64, 64), (64, 128))):
        layers.append(nn.Conv2d(c_in, c_out, kernel_size=3, stride=1, padding=1))
        if group_norm:
            layers.append(nn.GroupNorm(min(32, c_out), c_out))
        layers.append(nn.ReLU())
        layers.append(nn.AvgPool2d(kernel_size=2, stride=2) if i < 3 else nn.AdaptiveAvgPool2d((1, 1)))
    return nn.Sequential(*layers, nn.Flatten(start_dim=1, end_dim=-1), nn.Linear(128, 10, bias=True))


class CharNNClassifier(nn.Module):
    """Opacus's ``examples/char-lstm-classification.py`` model with its ``DPLSTM``."""

    def __init__(self, embedding_size: int = 64, hidden_size: int = 128, output_size: int = 18) -> None:
        super().__init__()
        from opacus.layers import DPLSTM

        self.embedding = nn.Embedding(256 + 3, embedding_size)
        self.rnn = DPLSTM(embedding_size, hidden_size, num_layers=1, batch_first=True)
        self.out_layer = nn.Linear(hidden_size, output_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self.rnn(self.embedding(x))  # -> [B, T, H]
        return self.out_layer(x[:, -1, :])


def make_case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    if name == "d":
        return SampleConvNet(), torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    if name in ("e", "f"):
        return cifar10_convnet(name == "f"), torch.randn(128, 3, 32, 32), torch.randint(0, 10, (128,))
    if name == "g":
        return CharNNClassifier(), torch.randint(0, 259, (800, 16)), torch.randint(0, 18, (800,))
    if name == "a":
        model: nn.Module = nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )
        return model, torch.randn(256, 784), torch.randint(0, 10, (256,))
    model = Encoder()
    if name == "c":
        model.requires_grad_(False)
        for layer in model.encoder.layers:
            layer.linear1 = LoRALinear(layer.linear1)
            layer.linear2 = LoRALinear(layer.linear2)
    return model, torch.randint(0, 1000, (32, 64)), torch.randint(0, 10, (32,))


def _ret(step: Callable[[], None], model: nn.Module, opt: Any, x: Any, y: Any, with_state: bool) -> Any:
    if not with_state:
        return step

    def live() -> list[torch.Tensor]:
        out = [x, y, *model.parameters(), *model.buffers()]
        inner = getattr(opt, "original_optimizer", opt)
        for st in inner.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    return step, live


class _Indices(torch.utils.data.Dataset):
    """Records that are their own index (the collate function of :func:`_fixed_loader` looks them up)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _fixed_loader(x: torch.Tensor, y: torch.Tensor) -> torch.utils.data.DataLoader:
    """``(x, y)`` as a loader of one batch per pass. gaussdp with ``poisson_sampling=False`` takes
    each step's batch from its loader (the accountant charges the loader's passes); the whole batch
    is ``(x, y)`` themselves, no copy, so the step holds the same tensors as the other methods'
    (smaller batches, such as the independence probe's, are rows of them)."""
    whole = list(range(len(x)))

    def collate(idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return (x, y) if idx == whole else (x[idx], y[idx])

    return torch.utils.data.DataLoader(_Indices(len(x)), batch_size=len(x), collate_fn=collate)


def _forever(loader: Any) -> Any:
    while True:
        yield from loader


def build(method: str, case: str, with_state: bool = False) -> Any:
    """A closure running one training step of ``method`` on ``case``."""
    model, x, y = make_case(case)
    loss_fn = nn.CrossEntropyLoss()
    params = [p for p in model.parameters() if p.requires_grad]
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=len(x))
    if method == "plain":
        opt = torch.optim.SGD(params, lr=0.01)

        def step() -> None:
            loss_fn(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return _ret(step, model, opt, x, y, with_state)
    if method.startswith("gaussdp"):
        from gaussdp.torch import PrivacyEngine

        opt = torch.optim.SGD(params, lr=0.01)
        model, opt, fixed = PrivacyEngine().make_private(
            module=model,
            optimizer=opt,
            data_loader=_fixed_loader(x, y),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            clipping="per_layer" if method == "gaussdp-per-layer" else "flat",
        )
        batches = _forever(fixed)

        def step() -> None:
            xb, yb = next(batches)  # (x, y) itself
            loss_fn(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()

        return _ret(step, model, opt, x, y, with_state)
    from opacus import PrivacyEngine as OpacusEngine
    from opacus.validators import ModuleValidator

    model = ModuleValidator.fix(copy.deepcopy(model))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01)
    mode = method.split("-")[1]
    engine = OpacusEngine(accountant="prv")
    if mode == "ghost":
        model, opt, crit, _ = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            criterion=loss_fn,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            grad_sample_mode="ghost",
        )
    else:
        model, opt, _ = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=False,
            grad_sample_mode="hooks",
        )
        crit = loss_fn

    def step() -> None:
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return _ret(step, model, opt, x, y, with_state)


class PeakMemory(TorchDispatchMode):
    """Peak bytes of live tensor storages: every op output is counted until its storage dies."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        for t in existing:
            self._track(t)

    def _free(self, n: int) -> None:
        self.current -= n

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st in self._seen:
            return
        n = st.nbytes()
        self._seen[st] = n
        weakref.finalize(st, self._free, n)
        self.current += n
        self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._track(t)
        return out


def peak_bytes(method: str, case: str) -> int:
    step, live = build(method, case, with_state=True)
    step()  # warm up: parameters and optimizer state exist before tracking
    step()
    tracker = PeakMemory(*live())
    with tracker:
        step()
    return tracker.peak


class _Floor(PeakMemory):
    """:class:`PeakMemory` over a plain step that also follows, through the backward pass, what exact
    flat clipping must hold on top of plain training (see :func:`one_pass_floor`)."""

    def __init__(self, *existing: torch.Tensor) -> None:
        super().__init__(*existing)
        self.layers: list[dict[str, Any]] = []  # per owning call: sizes and weak storages
        self.arrived = 0
        self.floor = self.peak

    def extra(self) -> int:
        """Bytes a one-pass method holds beyond plain's live ones now: for each layer whose output
        gradient has arrived (but not the last layer's), the smaller of its per-sample gradients
        and whichever of its input and output gradient plain has already freed; less the plain
        parameter gradients those layers may have formed (a lower estimate)."""
        total = 0
        for layer in self.layers:
            if layer["grad"] is None:
                continue
            gone = sum(n for ref, n in (layer["input"], layer["grad"]) if ref() is None)
            total += min(layer["per_sample"], gone) - layer["params"]
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if 0 < self.arrived < len(self.layers):  # between the first and last output gradient
            self.floor = max(self.floor, self.current + self.extra())
        elif self.arrived == 0:
            self.floor = max(self.floor, self.current)
        return out


def one_pass_floor(case: str) -> int:
    """A lower bound on the peak bytes of exact flat clipping in one backward pass that keeps, per
    layer, either its per-sample gradients or its (input, output gradient), recomputing nothing.

    Every sample's clip factor needs its whole gradient's norm, known only when the last layer's
    output gradient arrives (the first layer in forward order). Until then each layer already
    passed must hold what its clipped sum is formed from: the smaller of its per-sample gradients
    (``B`` times its parameters) and its input plus output gradient, less what plain training
    still holds of those. This follows plain training's live bytes op by op
    (:class:`PeakMemory`) and adds that; the result is the highest total (and plain's forward
    peak). It is a floor for one-pass book-keeping (gaussdp) and for per-sample hooks (Opacus
    hooks); only recomputation (a second backward pass, or re-running layers) can go lower.
    """
    step, live = build("plain", case, with_state=True)
    step()
    step()
    model = inspect.getclosurevars(step).nonlocals["model"]
    tracker = _Floor(*live())
    handles = []

    def on_forward(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        x = args[0]
        owned = [p for p in module.parameters(recurse=False) if p.requires_grad]
        layer: dict[str, Any] = {
            "input": (weakref.ref(x.untyped_storage()), x.untyped_storage().nbytes()),
            "grad": None,
            "per_sample": x.shape[0] * sum(p.numel() * p.element_size() for p in owned),
            "params": sum(p.numel() * p.element_size() for p in owned),
        }
        tracker.layers.append(layer)

        def on_grad(g: torch.Tensor) -> None:
            layer["grad"] = (weakref.ref(g.untyped_storage()), g.untyped_storage().nbytes())
            tracker.arrived += 1

        output.register_hook(on_grad)

    for m in model.modules():
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            handles.append(m.register_forward_hook(on_forward))
    with tracker:
        step()
    for h in handles:
        h.remove()
    return tracker.floor


def allocator_peak_bytes(method: str, case: str) -> int:
    """The same peak from the allocator's side: the live state at the start of the step plus the
    highest running total of the CPU allocator's allocation and free events during it (torch's
    profiler with ``profile_memory=True``). A check on :class:`PeakMemory`, which sees only op
    outputs (not buffers an op allocates and frees inside itself) and, being a dispatch mode, makes
    autograd accumulate gradients out of place; where the two agree, neither effect is at the peak.
    Frees of blocks allocated before the step are not reported (torch warns once), so this errs
    high."""
    from torch.profiler import ProfilerActivity, profile

    step, live = build(method, case, with_state=True)
    step()
    step()
    state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in live()}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return sum(state.values()) + peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--only", default="a,b,c,d,e,f,g")
    ap.add_argument("--methods", default="plain,gaussdp,gaussdp-per-layer,opacus-ghost,opacus-hooks")
    ap.add_argument("--block", type=int, default=8, help="consecutive steps per timed block")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is meaningful)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.reps} reps x {args.block} steps"
    )
    for case in args.only.split(","):
        steps = {m: build(m, case) for m in methods}
        for s in steps.values():
            s()
            s()
        times: dict[str, list[float]] = {m: [] for m in methods}
        cpu: dict[str, list[float]] = {m: [] for m in methods}
        for _ in range(args.reps):
            for m, s in steps.items():
                s()  # untimed: this method's own cache and heap state, not the previous method's
                t0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(args.block):
                    s()
                times[m].append((time.perf_counter() - t0) / args.block)
                cpu[m].append((time.thread_time() - c0) / args.block)
        mem = {m: peak_bytes(m, case) for m in methods}
        alloc = {m: allocator_peak_bytes(m, case) for m in methods}
        base_t, base_c = statistics.median(times["plain"]), statistics.median(cpu["plain"])
        base_m, base_a = mem["plain"], alloc["plain"]
        print(f"\ncase ({case})")
        print(
            f"{'method':<18}{'wall ms':>9}{'ratio':>8}{'CPU ms':>9}{'ratio':>8}{'peak MiB':>10}{'ratio':>8}"
            f"{'alloc MiB':>11}{'ratio':>8}"
        )
        for m in methods:
            t, c = statistics.median(times[m]), statistics.median(cpu[m])
            print(
                f"{m:<18}{t * 1e3:>9.1f}{t / base_t:>7.2f}x{c * 1e3:>9.1f}{c / base_c:>7.2f}x"
                f"{mem[m] / 2**20:>10.1f}{mem[m] / base_m:>7.2f}x"
                f"{alloc[m] / 2**20:>11.1f}{alloc[m] / base_a:>7.2f}x",
                flush=True,
            )
        if case in ("d", "e", "f"):
            floor = one_pass_floor(case)
            print(
                f"{'one-pass floor':<52}{floor / 2**20:>10.1f}{floor / base_m:>7.2f}x"
                "  (exact flat clipping, nothing recomputed: see one_pass_floor)"
            )


if __name__ == "__main__":
    main()
