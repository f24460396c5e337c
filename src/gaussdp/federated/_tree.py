"""Parameter trees (dicts or lists of arrays) <-> flat vectors, and the difference of two trees."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gaussdp.errors import UnsafeInput

__all__ = ["TreeSpec", "flatten", "tree_sub", "unflatten"]


@dataclass(frozen=True)
class TreeSpec:
    """Where each leaf of a tree lives in its flat vector: keys (or None for a list), shapes, dtype."""

    keys: tuple[Any, ...] | None
    shapes: tuple[tuple[int, ...], ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(sum(int(np.prod(s)) for s in self.shapes))


def _leaves(tree: Any, name: str) -> tuple[tuple[Any, ...] | None, list[Any]]:
    if isinstance(tree, Mapping):
        keys = tuple(tree.keys())
        return keys, [tree[k] for k in keys]
    if isinstance(tree, list | tuple):
        return None, list(tree)
    if isinstance(tree, np.ndarray):
        return None, [tree]
    raise TypeError(f"{name} must be a dict or list of arrays, got {type(tree).__name__}")


def _to_numpy(x: Any) -> np.ndarray:
    if type(x).__module__.split(".")[0] == "torch":
        return x.detach().cpu().numpy()
    return np.asarray(x)


def flatten(tree: Any, name: str = "params") -> tuple[np.ndarray, TreeSpec]:
    """Concatenate the leaves (numpy arrays or torch tensors) into one vector of the widest float dtype."""
    keys, leaves = _leaves(tree, name)
    if not leaves:
        raise UnsafeInput(f"{name} has no arrays")
    arrays = [_to_numpy(x) for x in leaves]
    # The widest *float* dtype: an integer buffer (a BatchNorm counter) must not upcast the model.
    dtype = np.result_type(*[a.dtype for a in arrays if a.dtype.kind == "f"], np.float32)
    vec = np.concatenate([a.reshape(-1).astype(dtype, copy=False) for a in arrays])
    return vec, TreeSpec(keys, tuple(a.shape for a in arrays), np.dtype(dtype))


def unflatten_like(vec: np.ndarray, template: Any) -> Any:
    """``vec`` split back into ``template``'s structure, each leaf in the template leaf's type and dtype."""
    keys, leaves = _leaves(template, "template")
    parts = unflatten(vec, TreeSpec(keys, tuple(tuple(_to_numpy(x).shape) for x in leaves), vec.dtype))
    parts_list = list(parts.values()) if isinstance(parts, dict) else parts
    out: list[Any] = []
    for part, leaf in zip(parts_list, leaves, strict=True):
        if type(leaf).__module__.split(".")[0] == "torch":
            import torch

            out.append(torch.from_numpy(np.ascontiguousarray(part)).to(dtype=leaf.dtype, device=leaf.device))
        else:
            out.append(part.astype(np.asarray(leaf).dtype, copy=False))
    return out if keys is None else dict(zip(keys, out, strict=True))


def unflatten(vec: np.ndarray, spec: TreeSpec) -> Any:
    """The tree of ``spec`` filled from ``vec`` (numpy arrays; a dict when the spec has keys)."""
    v = np.asarray(vec)
    if v.ndim != 1 or v.size != spec.size:
        raise UnsafeInput(f"vector of shape {v.shape} does not fit a tree of {spec.size} parameters")
    out: list[np.ndarray] = []
    start = 0
    for shape in spec.shapes:
        n = int(np.prod(shape))
        out.append(v[start : start + n].reshape(shape))
        start += n
    if spec.keys is None:
        return out
    return dict(zip(spec.keys, out, strict=True))


def tree_sub(a: Any, b: Any, *, names: tuple[str, str] = ("update", "global_params")) -> Any:
    """``a - b`` leaf by leaf; the two trees must have the same keys (or lengths) and shapes."""
    ka, la = _leaves(a, names[0])
    kb, lb = _leaves(b, names[1])
    if ka != kb and not (ka is not None and kb is not None and set(ka) == set(kb)):
        raise UnsafeInput(f"{names[0]} and {names[1]} have different keys: {ka} vs {kb}")
    if ka is not None and kb is not None:
        lb = [b[k] for k in ka]
    if len(la) != len(lb):
        raise UnsafeInput(f"{names[0]} has {len(la)} arrays but {names[1]} has {len(lb)}")
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        if tuple(x.shape) != tuple(y.shape):
            where = ka[i] if ka is not None else i
            raise UnsafeInput(
                f"{names[0]}[{where!r}] has shape {tuple(x.shape)} but {names[1]}[{where!r}] has "
                f"shape {tuple(y.shape)}"
            )
    diffs = [x - y for x, y in zip(la, lb, strict=True)]
    if ka is not None:
        return dict(zip(ka, diffs, strict=True))
    return diffs
