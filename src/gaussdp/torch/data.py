"""Poisson sampling: the batches the accountant's ``SubsampledGaussianEvent`` assumes.

Each step includes every record independently with probability ``sample_rate`` (so batch sizes vary
and may be 0). Under ``torch.distributed`` each rank draws over its own shard of the indices with
the same rate, so every record is still included independently with that rate in the global batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import default_collate

from gaussdp._validate import check_probability
from gaussdp.errors import InvalidParameter
from gaussdp.torch._random import torch_generator

__all__ = ["DPDataLoader", "PoissonBatchSampler", "split_batch"]


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
