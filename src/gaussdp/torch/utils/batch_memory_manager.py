"""``opacus.utils.batch_memory_manager`` for gaussdp: :class:`BatchMemoryManager`."""

from __future__ import annotations

from gaussdp.torch.data import BatchMemoryManager

__all__ = ["BatchMemoryManager"]
