"""Checkpoints of a fine-tuning run, so that a run interrupted by a crash resumes (see
:class:`FinetuneCheckpoint` for why a resume releases no step twice)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gaussdp.errors import InvalidParameter
from gaussdp.finetune.plan import FinetunePlan

__all__ = ["FinetuneCheckpoint", "load_checkpoint", "optimizer_updates", "save_checkpoint"]

_CHECKPOINT_SCHEMA = "gaussdp.finetune.checkpoint/1"


@dataclass(frozen=True)
class FinetuneCheckpoint:
    """Where :func:`run_finetune` keeps its state so that a run interrupted by a crash resumes.

    Every ``every`` steps (and never after the last) the adapters, the optimizer's state and the
    engine's accountant (every event composed, the steps) are written to ``path`` atomically (a
    temporary file, fsync, rename), together with ``released``, the steps whose noise was released
    so far, and ``applied``, the updates in the saved weights. A run given an existing ``path``
    resumes from it.

    Soundness of a resume (why no step is released twice and the charge covers it): a step counts
    as *released* once it is in a checkpoint or was reported (``released`` below: the job row's
    ``step``, written after each step with its epsilon). A resumed run starts from the checkpoint's
    weights and composes, besides the checkpoint's steps, the reported steps after it: they are
    *lost* (their noisy updates died with the process) but stay counted as released, because what
    was reported about them (their progress, a validation loss) may have been seen. The run then
    takes only the plan's remaining steps with fresh Poisson samples and fresh noise. So the
    accountant composes exactly ``plan.steps`` steps in all, the plan that was charged once; the
    final adapter is a post-processing of those releases; and no released step is run again. A step
    in flight at the crash that was neither checkpointed nor reported left no trace anyone can see
    and is simply not counted (its noise and sample were discarded). Poisson sampling draws every
    step's batch independently, so the data order needs no saved position; with ``seed`` (not
    private) a resumed run is not bit-identical to an uninterrupted one.

    Attributes:
        path: the checkpoint file (its directory is created).
        every: steps between checkpoints (>= 1). With 1 no step is ever lost, at the cost of one
            write (adapters + optimizer state, small for LoRA) per step.
        released: steps reported released before this run (0 for a new run).
        on_resume: called once, before training, with ``(resumed_from, lost)`` when resuming
            (``path`` exists, or ``released`` > 0: then from the fresh adapters, ``resumed_from`` 0):
            the checkpoint's released steps and the lost steps after it.
    """

    path: Path
    every: int = 10
    released: int = 0
    on_resume: Callable[[int, int], None] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        for name in ("every", "released"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "every" else 0):
                raise InvalidParameter(f"{name} must be an int >= {1 if name == 'every' else 0}, got {v!r}")
        if self.on_resume is not None and not callable(self.on_resume):
            raise TypeError(f"on_resume must be callable or None, got {type(self.on_resume).__name__}")


def optimizer_updates(optimizer: Any) -> int | None:
    """Updates Adam applied (its per-parameter ``step`` counter; None before the first)."""
    for state in optimizer.state.values():
        if "step" in state:
            return int(state["step"])
    return None


def save_checkpoint(
    path: Path,
    plan: FinetunePlan,
    released: int,
    lost: int,
    engine: Any,
    named: list[tuple[str, Any]],
    optimizer: Any,
) -> None:
    """Write the state atomically: a crash leaves the previous checkpoint or this one, never half."""
    import torch

    from gaussdp.accounting.events import event_json

    state = {
        "schema": _CHECKPOINT_SCHEMA,
        "plan_event": event_json(plan.event),
        "released": released,
        "lost": lost,
        "lora": {n: p.detach().to("cpu").clone() for n, p in named},
        "optimizer": optimizer.state_dict(),
        "accountant": engine.accountant.state_dict(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # the rename itself durable (POSIX: fsync the directory)
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(
    path: Path, plan: FinetunePlan, engine: Any, named: list[tuple[str, Any]], optimizer: Any
) -> tuple[int, int]:
    """Restore a checkpoint of this plan into the fresh run; returns its ``(released, lost)`` steps."""
    import torch

    from gaussdp.accounting.events import event_json

    state = torch.load(path, weights_only=True, map_location="cpu")
    if state.get("schema") != _CHECKPOINT_SCHEMA or state.get("plan_event") != event_json(plan.event):
        raise InvalidParameter(f"checkpoint {str(path)!r} is not one of this plan; nothing was trained")
    lora = state["lora"]
    if sorted(lora) != sorted(n for n, _ in named):
        raise InvalidParameter(f"checkpoint {str(path)!r} holds other adapters than this run's")
    released = int(state["released"])
    accountant = state["accountant"]
    if int(accountant["steps"]) != released:
        raise InvalidParameter(f"checkpoint {str(path)!r}: its accountant has {accountant['steps']} steps")
    engine.accountant.load_state_dict(accountant)
    with torch.no_grad():
        for n, p in named:
            p.copy_(lora[n].to(p.device, p.dtype))
    optimizer.load_state_dict(state["optimizer"])
    return released, int(state["lost"])
