"""The data loaders of DP-SGD and the record of the batches they hand out.

Poisson sampling (:class:`PoissonBatchSampler`, :class:`DPDataLoader`): the batches the
accountant's ``SubsampledGaussianEvent`` assumes. Each step includes every record independently
with probability ``sample_rate`` (so batch sizes vary and may be 0). Under ``torch.distributed``
each rank draws over its own shard of the indices with the same rate, so every record is still
included independently with that rate in the global batch.

Fixed-size batches (:class:`PassCountingLoader`): the user's own loader, whose sampler must hand out
each record at most once per pass over it (:func:`check_once_per_pass`).

Either way every batch handed out is recorded (:class:`DrawnBatches`: which pass it came from and
how many samples it holds), whether the loader is iterated or only its ``batch_sampler`` is (as
Opacus's ``BatchMemoryManager`` does), so that the optimizer can check each step against the batch
it used and the engine can charge each pass.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
)
from torch.utils.data.dataloader import default_collate
from torch.utils.data.distributed import DistributedSampler

from gaussdp._validate import check_probability
from gaussdp.errors import InvalidParameter
from gaussdp.torch._random import torch_generator

__all__ = [
    "BatchMemoryManager",
    "DPDataLoader",
    "DrawnBatches",
    "PassCountingLoader",
    "PoissonBatchSampler",
    "check_once_per_pass",
    "split_batch",
]


class DrawnBatches:
    """The batches a private loader handed out that no optimizer step has used yet, oldest first.

    Each is ``(pass, size)``: the pass over the loader it came from (1, 2, ... in the order the
    passes began) and how many samples it holds. A pass begins when the loader (or its batch
    sampler) is iterated anew; batches an abandoned pass handed out (prefetched by workers, or left
    when a loop breaks early) are then forgotten. The optimizer takes one batch per step
    (:meth:`take`) and checks that the step clipped exactly its samples; the engine charges a pass
    at the first step that uses one of its batches.
    """

    def __init__(self) -> None:
        self.passes = 0
        self.samples_served = 0
        self.batches_served = 0  # non-empty batches handed out
        self.current: tuple[int, int] | None = None  # the batch of the step in progress
        self._pending: deque[tuple[int, int]] = deque()

    def begin_pass(self) -> int:
        self.passes += 1
        self._pending.clear()
        return self.passes

    def add(self, pass_id: int, size: int) -> None:
        self._pending.append((pass_id, size))
        self.samples_served += size
        self.batches_served += size > 0

    def take(self) -> tuple[int, int] | None:
        """The oldest batch not yet used by a step (it is then :attr:`current`), or None."""
        self.current = self._pending.popleft() if self._pending else None
        return self.current

    def take_prefix(self, samples: int) -> bool:
        """Whether the next pending batches hold ``samples`` samples together; if so they are taken
        (a step that used them along with its own)."""
        total, k = 0, 0
        for _, size in self._pending:
            if total >= samples:
                break
            total, k = total + size, k + 1
        if total != samples or k == 0:
            return False
        for _ in range(k):
            self._pending.popleft()
        return True

    def __len__(self) -> int:
        return len(self._pending)


class PoissonBatchSampler(Sampler[list[int]]):
    """``steps`` batches; each index in ``range(rank, num_samples, world_size)`` drawn w.p. ``sample_rate``.

    Args:
        num_samples: dataset size ``N`` (all ranks together).
        sample_rate: inclusion probability ``q`` in (0, 1].
        steps: batches per epoch; ``round(1 / q)`` by default (one expected pass over the data).
        generator: source of the coin flips; a fresh OS-entropy-seeded one by default.
        rank, world_size: the shard of a distributed run.

    Attributes:
        drawn: every batch handed out, for the optimizer's check (:class:`DrawnBatches`). It is
            kept here, in the sampler, so that a loader built around it (Opacus's
            ``BatchMemoryManager`` makes one) is recorded too.
    """

    def __init__(
        self,
        *,
        num_samples: int,
        sample_rate: float,
        steps: int | None = None,
        generator: torch.Generator | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if num_samples <= 0:
            raise InvalidParameter(f"num_samples must be > 0, got num_samples={num_samples}")
        self.num_samples = int(num_samples)
        self.sample_rate = check_probability("sample_rate", sample_rate)
        self.steps = int(steps) if steps is not None else max(1, round(1.0 / self.sample_rate))
        if self.steps <= 0:
            raise InvalidParameter(f"steps must be > 0, got steps={steps}")
        self.generator = generator if generator is not None else torch_generator(None, "sampling")
        self.shard = torch.arange(rank, self.num_samples, world_size)
        self.drawn = DrawnBatches()

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        pass_id = self.drawn.begin_pass()
        for _ in range(self.steps):
            keep = torch.rand(self.shard.numel(), generator=self.generator) < self.sample_rate
            batch = self.shard[keep].tolist()
            self.drawn.add(pass_id, len(batch))
            yield batch


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, dict):
        return _batch_size(next(iter(batch.values())))
    if isinstance(batch, Sequence) and not isinstance(batch, str) and len(batch):
        return _batch_size(batch[0])
    return 0


class _EmptySafeCollate:
    """Collate that turns an empty index list into a batch of 0 rows with the right shapes."""

    def __init__(self, dataset: Dataset, collate_fn: Any) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn

    def __call__(self, samples: list) -> Any:
        if samples:
            return self.collate_fn(samples)
        one = self.collate_fn([self.dataset[0]])

        def empty(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x[:0]
            if isinstance(x, dict):
                return {k: empty(v) for k, v in x.items()}
            if isinstance(x, list | tuple):
                return type(x)(empty(v) for v in x)
            return x

        return empty(one)


class DPDataLoader(DataLoader):
    """A ``DataLoader`` whose batches are Poisson samples of the dataset (see the module docstring).

    Its batch sampler records every batch it draws (:attr:`drawn`, also ``samples_served`` and
    ``batches_served``), so the optimizer can check that each step clipped exactly the samples of
    one batch, each as one row of the batch dimension. A loader built around the batch sampler
    (Opacus's ``BatchMemoryManager``) is recorded the same way.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        sample_rate: float,
        steps: int | None = None,
        collate_fn: Any = None,
        generator: torch.Generator | None = None,
        rank: int = 0,
        world_size: int = 1,
        **kwargs: Any,
    ) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        self.batch_sampler_: PoissonBatchSampler = PoissonBatchSampler(
            num_samples=n,
            sample_rate=sample_rate,
            steps=steps,
            generator=generator,
            rank=rank,
            world_size=world_size,
        )
        self.sample_rate = self.batch_sampler_.sample_rate
        self.dataset_size = n
        self.expected_batch_size = self.sample_rate * n
        super().__init__(
            dataset,
            batch_sampler=self.batch_sampler_,
            collate_fn=_EmptySafeCollate(dataset, collate_fn or default_collate),
            **kwargs,
        )

    @property
    def drawn(self) -> DrawnBatches:
        return self.batch_sampler_.drawn

    @property
    def samples_served(self) -> int:
        return self.drawn.samples_served

    @property
    def batches_served(self) -> int:
        return self.drawn.batches_served

    @classmethod
    def from_data_loader(
        cls,
        loader: DataLoader,
        *,
        generator: torch.Generator | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> DPDataLoader:
        """Same dataset, collate and workers; batches drawn with ``q = 1 / len(loader)``."""
        steps = len(loader)
        if steps == 0:
            raise InvalidParameter("data_loader is empty")
        return cls(
            loader.dataset,
            sample_rate=1.0 / steps,
            steps=steps,
            collate_fn=loader.collate_fn,
            generator=generator,
            rank=rank,
            world_size=world_size,
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
        )


def split_batch(batch: Any, max_physical_batch_size: int) -> Iterator[Any]:
    """Split a (logical) batch into micro-batches of at most ``max_physical_batch_size`` rows.

    Run forward and backward on each, then one ``optimizer.step()``: each sample is clipped once, in
    its micro-batch, and the noise is added once for the logical batch. An empty batch yields itself.
    """
    if max_physical_batch_size <= 0:
        raise InvalidParameter(f"max_physical_batch_size must be > 0, got {max_physical_batch_size}")
    n = _batch_size(batch)
    if n == 0:
        yield batch
        return

    def take(x: Any, lo: int, hi: int) -> Any:
        if isinstance(x, torch.Tensor):
            return x[lo:hi]
        if isinstance(x, dict):
            return {k: take(v, lo, hi) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return type(x)(take(v, lo, hi) for v in x)
        return x

    for lo in range(0, n, max_physical_batch_size):
        yield take(batch, lo, min(n, lo + max_physical_batch_size))


# Samplers that hand out each index at most once per pass (checked further below).
_ONCE_PER_PASS = (SequentialSampler, RandomSampler, SubsetRandomSampler, DistributedSampler)


def check_once_per_pass(loader: DataLoader) -> None:
    """Refuse a loader whose sampler may hand out a record twice in one pass over it.

    Without Poisson sampling each pass is charged as one release in which every record is in one
    batch at most; a sampler with replacement, a subset with repeated indices, a
    ``DistributedSampler`` that pads the last round with records handed out already, or a sampler
    gaussdp does not know, breaks that.
    """
    sampler = loader.sampler
    if not isinstance(sampler, _ONCE_PER_PASS):
        raise InvalidParameter(
            f"poisson_sampling=False needs a sampler that draws each record at most once per pass "
            f"(sequential or shuffled without replacement); data_loader has a "
            f"{type(sampler).__name__}, which gaussdp cannot check: use shuffle=True or False"
        )
    if isinstance(sampler, RandomSampler) and (
        sampler.replacement or sampler.num_samples > len(sampler.data_source)
    ):
        raise InvalidParameter(
            "poisson_sampling=False needs each record at most once per pass, but data_loader's "
            f"RandomSampler has replacement={sampler.replacement}, num_samples={sampler.num_samples}"
        )
    if isinstance(sampler, SubsetRandomSampler) and len(set(map(int, sampler.indices))) != len(
        sampler.indices
    ):
        raise InvalidParameter(
            "poisson_sampling=False needs each record at most once per pass, but data_loader's "
            "SubsetRandomSampler repeats some of its indices"
        )
    if isinstance(sampler, DistributedSampler) and sampler.total_size > len(sampler.dataset):  # type: ignore[arg-type]
        raise InvalidParameter(
            "poisson_sampling=False needs each record at most once per pass, but data_loader's "
            f"DistributedSampler pads {sampler.total_size - len(sampler.dataset)} records that other "  # type: ignore[arg-type]
            f"ranks also get ({len(sampler.dataset)} records over {sampler.num_replicas} ranks): "  # type: ignore[arg-type]
            "use DistributedSampler(..., drop_last=True) or a dataset size divisible by the world size"
        )


class _CountingBatchSampler(BatchSampler):
    """The batch sampler of a :class:`PassCountingLoader`'s loader, recording what it hands out.

    What a loader built around ``loader.batch_sampler`` gets (Opacus's ``BatchMemoryManager``
    builds one): iterating the loader itself does not reach it, so nothing is counted twice.
    """

    def __init__(self, inner: BatchSampler, drawn: DrawnBatches) -> None:  # no super().__init__: a view
        self.inner, self.drawn = inner, drawn
        # what BatchSampler offers (Opacus's BatchMemoryManager reads batch_size for its length)
        self.sampler = inner.sampler
        self.batch_size = inner.batch_size
        self.drop_last = inner.drop_last

    def __iter__(self) -> Iterator[list[int]]:
        pass_id = self.drawn.begin_pass()
        for batch in self.inner:
            self.drawn.add(pass_id, len(batch))
            yield batch

    def __len__(self) -> int:
        return len(self.inner)


class PassCountingLoader:
    """The user's own loader (``poisson_sampling=False``), recording each pass and batch.

    Every batch it hands out is recorded in :attr:`drawn` with the pass it belongs to (a pass
    begins at each new iteration); the engine charges each pass (a record is in one batch of it)
    at the first step that uses one of its batches, and the optimizer checks that each step clipped
    exactly one batch's samples. Its ``batch_sampler`` records the same way, for loaders built
    around it (Opacus's ``BatchMemoryManager``). Every other attribute is the loader's
    (``dataset``, ``batch_size``, ``sampler``...).
    """

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.drawn = DrawnBatches()

    @property
    def passes(self) -> int:
        return self.drawn.passes

    @property
    def batch_sampler(self) -> _CountingBatchSampler:
        inner = self.loader.batch_sampler
        if not isinstance(inner, BatchSampler):  # make_private checked: batch_size is set
            raise TypeError(f"the loader's batch_sampler is a {type(inner).__name__}, not a BatchSampler")
        return _CountingBatchSampler(inner, self.drawn)

    def __iter__(self) -> Iterator[Any]:
        pass_id = self.drawn.begin_pass()
        for batch in self.loader:
            self.drawn.add(pass_id, _batch_size(batch))
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name in ("loader", "drawn"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


class BatchMemoryManager:
    """Opacus's ``BatchMemoryManager``: each (Poisson) batch split into physical batches.

    Use as ``with BatchMemoryManager(data_loader=loader, max_physical_batch_size=m,
    optimizer=optimizer) as physical_loader:``; run forward, backward and ``optimizer.step()`` on
    each physical batch. All but the last physical batch of a batch are signalled to the optimizer
    as skipped steps (``optimizer.signal_skip_step``): their samples are clipped and summed, nothing
    is charged, noised or released; the last one's step charges one release and adds the noise once
    for the whole batch. So the privacy is that of the batch as drawn, whatever ``m``.

    Opacus's own ``opacus.utils.batch_memory_manager.BatchMemoryManager`` works as well: it builds
    a loader around the returned loader's ``batch_sampler``, which records what it hands out.

    Args:
        data_loader: the loader ``make_private`` returned.
        max_physical_batch_size: the most samples one forward/backward pass gets (> 0).
        optimizer: the ``DPOptimizer`` ``make_private`` returned.
    """

    def __init__(self, *, data_loader: Any, max_physical_batch_size: int, optimizer: Any) -> None:
        if isinstance(max_physical_batch_size, bool) or not isinstance(max_physical_batch_size, int):
            raise TypeError(f"max_physical_batch_size must be an int, got {max_physical_batch_size!r}")
        if max_physical_batch_size <= 0:
            raise InvalidParameter(
                f"max_physical_batch_size must be > 0, got max_physical_batch_size={max_physical_batch_size}"
            )
        if not callable(getattr(optimizer, "signal_skip_step", None)):
            raise TypeError("optimizer must be the DPOptimizer that make_private returned")
        self.data_loader = data_loader
        self.max_physical_batch_size = max_physical_batch_size
        self.optimizer = optimizer

    def __enter__(self) -> _PhysicalBatches:
        return _PhysicalBatches(self)

    def __exit__(self, *exc: object) -> None:
        return None


class _PhysicalBatches:
    def __init__(self, manager: BatchMemoryManager) -> None:
        self.manager = manager
        self.dataset = getattr(manager.data_loader, "dataset", None)

    def __iter__(self) -> Iterator[Any]:
        m, opt = self.manager.max_physical_batch_size, self.manager.optimizer
        for batch in self.manager.data_loader:
            chunks = list(split_batch(batch, m))
            for i, chunk in enumerate(chunks):
                opt.signal_skip_step(do_skip=i < len(chunks) - 1)
                yield chunk

    def __len__(self) -> int:
        loader = self.manager.data_loader
        expected = getattr(loader, "expected_batch_size", None) or getattr(loader, "batch_size", None) or 1
        return len(loader) * max(1, math.ceil(expected / self.manager.max_physical_batch_size))
