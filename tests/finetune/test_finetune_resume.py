"""Checkpoints and resuming (``FinetuneCheckpoint``): a run stopped after step k resumes from its
last checkpoint, counts the reported steps after it as released (lost), runs only the rest, and its
accountant composes exactly the plan's steps."""

from __future__ import annotations

import pytest

from gaussdp.accounting.events import flatten_event
from gaussdp.errors import InvalidParameter
from gaussdp.finetune import (
    FinetuneCancelled,
    FinetuneCheckpoint,
    FinetuneConfig,
    plan_finetune,
    run_finetune,
)

CFG = FinetuneConfig(noise_multiplier=1.0, delta=1e-5, batch_size=8, max_seq_len=16, epochs=2)


def _stop_after(k: int):  # type: ignore[no-untyped-def]
    seen: list[int] = []
    return seen, (lambda p: seen.append(p.step)), (lambda: len(seen) >= k)


def test_a_stopped_run_resumes_from_its_checkpoint_without_rerunning_a_step(
    tiny_model_dir, lee_lines, tmp_path
):  # type: ignore[no-untyped-def]
    plan = plan_finetune(CFG, n_records=len(lee_lines))
    assert plan.steps == 12
    path = tmp_path / "ckpt.pt"
    seen, progress, stop = _stop_after(7)
    with pytest.raises(FinetuneCancelled):
        run_finetune(
            tiny_model_dir, lee_lines, CFG, plan, progress=progress, should_stop=stop,
            checkpoint=FinetuneCheckpoint(path, every=3),
        )  # fmt: skip
    assert seen == list(range(1, 8)) and path.is_file()  # checkpoints at 3 and 6; 7 reported, not saved
    resumes: list[tuple[int, int]] = []
    seen2: list[int] = []
    result = run_finetune(
        tiny_model_dir, lee_lines, CFG, plan, progress=lambda p: seen2.append(p.step),
        checkpoint=FinetuneCheckpoint(
            path, every=3, released=seen[-1], on_resume=lambda *a: resumes.append(a)
        ),
    )  # fmt: skip
    assert resumes == [(6, 1)]  # from the checkpoint at 6; step 7 lost, counted, not run again
    assert seen2 == list(range(8, 13))  # only the plan's remaining steps
    # steps_applied is Adam's own update count: 6 before the checkpoint, 5 after the resume
    assert (result.steps_done, result.steps_lost, result.steps_applied, result.resumed_from) == (12, 1, 11, 6)
    assert result.charged == tuple(flatten_event(plan.event))  # 12 steps, composed once each
    assert result.epsilon == pytest.approx(plan.epsilon, rel=1e-6)


def test_a_checkpoint_of_another_plan_is_refused(tiny_model_dir, lee_lines, tmp_path):  # type: ignore[no-untyped-def]
    plan = plan_finetune(CFG, n_records=len(lee_lines))
    path = tmp_path / "ckpt.pt"
    _, progress, stop = _stop_after(4)
    with pytest.raises(FinetuneCancelled):
        run_finetune(
            tiny_model_dir, lee_lines, CFG, plan, progress=progress, should_stop=stop,
            checkpoint=FinetuneCheckpoint(path, every=2),
        )  # fmt: skip
    other_cfg = FinetuneConfig(**{**CFG.to_dict(), "noise_multiplier": 2.0})
    other = plan_finetune(other_cfg, n_records=len(lee_lines))
    with pytest.raises(InvalidParameter, match="not one of this plan"):
        run_finetune(tiny_model_dir, lee_lines, other_cfg, other, checkpoint=FinetuneCheckpoint(path))
    with pytest.raises(InvalidParameter, match="every"):
        FinetuneCheckpoint(path, every=0)
