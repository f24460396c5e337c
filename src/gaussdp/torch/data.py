"""Poisson sampling: the batches the accountant's ``SubsampledGaussianEvent`` assumes.

Each step includes every record independently with probability ``sample_rate`` (so batch sizes vary
and may be 0). Under ``torch.distributed`` each rank draws over its own shard of the indices with
the same rate, so every record is still included independently with that rate in the global batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import (
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
    "PassCountingLoader",
    "PoissonBatchSampler",
    "check_once_per_pass",
    "split_batch",
]


class PoissonBatchSampler(Sampler[list[int]]):
    """``steps`` batches; each index in ``range(rank, num_samples, world_size)`` drawn w.p. ``sample_rate``.

    Args:
        num_samples: dataset size ``N`` (all ranks together).
        sample_rate: inclusion probability ``q`` in (0, 1].
        steps: batches per epoch; ``round(1 / q)`` by default (one expected pass over the data).
        generator: source of the coin flips; a fresh OS-entropy-seeded one by default.
        rank, world_size: the shard of a distributed run.
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

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            keep = torch.rand(self.shard.numel(), generator=self.generator) < self.sample_rate
            yield self.shard[keep].tolist()


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

    It counts the samples it hands out (``samples_served``) so the optimizer can check that every
    sample was clipped as one row of dimension 0.
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
        self.samples_served = 0
        self.batches_served = 0  # non-empty batches handed out
        super().__init__(
            dataset,
            batch_sampler=self.batch_sampler_,
            collate_fn=_EmptySafeCollate(dataset, collate_fn or default_collate),
            **kwargs,
        )

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        for batch in super().__iter__():
            n = _batch_size(batch)
            self.samples_served += n
            self.batches_served += n > 0
            yield batch

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


# Samplers that hand out each index at most once per pass (checked further for RandomSampler).
_ONCE_PER_PASS = (SequentialSampler, RandomSampler, SubsetRandomSampler, DistributedSampler)


def check_once_per_pass(loader: DataLoader) -> None:
    """Refuse a loader whose sampler may hand out a record twice in one pass over it.

    Without Poisson sampling each pass is charged as one release in which every record is in one
    batch at most; a sampler with replacement (or one gaussdp does not know) breaks that.
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


class PassCountingLoader:
    """The user's own loader (``poisson_sampling=False``), counting the passes begun over it.

    The engine charges each pass (a record is in one batch of it) before its first step. Every
    attribute is the loader's (``dataset``, ``batch_size``, ``sampler``...).
    """

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.passes = 0

    def __iter__(self) -> Iterator[Any]:
        self.passes += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): no recursion
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
