"""Run a planned DP-LoRA fine-tuning job: :func:`run_finetune`.

Flow (as everywhere in gaussdp): the ledger has already been charged ``plan.event`` by the caller;
here each Poisson batch's per-record gradients of the LoRA parameters are clipped to
``plan.clip_norm`` (:class:`gaussdp.torch.PrivacyEngine` hooks), Gaussian noise of std
``plan.noise_multiplier * plan.clip_norm`` is added once per step, and only then does the optimizer
move the adapters. The base model is frozen and never leaves this process; only the adapter is
released.

The per-record loss is the mean next-token cross-entropy over the record's own tokens; the batch's
loss is the *sum* of those (``loss_reduction="sum"``), so each record's gradient is exactly the
gradient of its own loss, whatever the lengths of the other records in its batch (the built-in
Hugging Face loss averages over all tokens of the batch, which mixes records).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gaussdp.accounting.events import flatten_event
from gaussdp.errors import InvalidParameter
from gaussdp.finetune.checkpoint import (
    FinetuneCheckpoint,
    load_checkpoint,
    optimizer_updates,
    save_checkpoint,
)
from gaussdp.finetune.model import (
    check_model,
    load_base_model,
    per_record_loss,
    tokenize_records,
    trim_padding,
    wrap_lora,
)
from gaussdp.finetune.plan import (
    FinetuneConfig,
    FinetunePlan,
    check_plan,
)

__all__ = [
    "FinetuneCancelled",
    "FinetuneProgress",
    "FinetuneResult",
    "run_finetune",
]

# The engine's epsilon is computed from the same events as the plan's; they may differ only by the
# accountant's discretisation (about 1e-9 relative for PLD).
_EPS_REL_TOL = 1e-6


class FinetuneCancelled(RuntimeError):
    """``should_stop()`` returned True: training stopped before ``plan.steps``.

    Attributes:
        steps_done: optimizer steps taken (each one noised and charged by the plan).
        epsilon: the epsilon of those steps at the plan's delta (<= the plan's epsilon).
    """

    def __init__(self, steps_done: int, epsilon: float) -> None:
        from gaussdp._format import format_upper

        super().__init__(
            f"fine-tuning cancelled after {steps_done} steps (epsilon spent {format_upper(epsilon)})"
        )
        self.steps_done = steps_done
        self.epsilon = epsilon


@dataclass(frozen=True)
class FinetuneProgress:
    """One step's report to ``progress``.

    Attributes:
        step: steps done (1 after the first step).
        steps: the plan's steps.
        epsilon_so_far: epsilon of the steps done, at the plan's delta (an upper bound).
        loss: mean per-record training loss of this step's batch, or ``None``: it is computed from
            the records WITHOUT noise, so it is not covered by the DP guarantee and is only given with
            ``report_loss=True`` (``None`` also for an empty Poisson batch).
        validation_loss: mean per-record loss of the adapter on the public ``validation`` records,
            at the steps where it is measured (else ``None``): a function of the DP adapter and of
            data declared public, so covered by the guarantee at no extra cost.
    """

    step: int
    steps: int
    epsilon_so_far: float
    loss: float | None
    validation_loss: float | None = None


@dataclass(frozen=True)
class FinetuneResult:
    """What :func:`run_finetune` trained.

    Attributes:
        peft_model: the base model with the trained LoRA adapters (a peft ``PeftModel``, eval mode,
            on the training device); ``save_adapter`` writes only the adapters.
        tokenizer: the base model's tokenizer.
        plan: the plan that was run.
        config: the config that was run.
        losses: per-step mean training losses (``report_loss=True`` only; NOT private), else ``()``.
        epsilon: epsilon spent at ``plan.delta`` by the steps done (<= ``plan.epsilon``).
        steps_done: optimizer steps taken (``plan.steps``).
        private: False when a ``seed`` fixed the noise (then the adapter is NOT private).
        noise_stream: where the gradient noise came from.
        base_model: the base model's directory.
        model_type: the base model's ``config.model_type``.
        target_modules: the modules that got LoRA adapters.
        trainable_parameters, total_parameters: parameter counts.
        tokens: non-padding tokens processed (all steps).
        seconds: wall-clock time of the whole call (loading, tokenising, training).
        train_seconds: wall-clock time of the training steps alone (``tokens / train_seconds`` is
            the training throughput).
        charged: what the engine's own accountant composed during training, as ``(event, count)``
            pairs: the plan's step event, once per step (checked equal to ``plan.event`` as
            accountants flatten it: ``gaussdp.accounting.events.flatten_event``).
        steps_applied: noisy updates in the adapter's weights (the optimizer's own count):
            ``steps_done - steps_lost``.
        steps_lost: released steps whose updates were lost in crashes (:class:`FinetuneCheckpoint`).
        resumed_from: the checkpoint's released steps this run resumed from (0: a fresh run).
        validation_losses: ``(step, loss)`` pairs measured on the public ``validation`` records
            (step 0: the base model with fresh adapters, i.e. the base's own loss); ``()`` without.
    """

    peft_model: Any
    tokenizer: Any
    plan: FinetunePlan
    config: FinetuneConfig
    losses: tuple[float, ...]
    epsilon: float
    steps_done: int
    private: bool
    noise_stream: str
    base_model: str
    model_type: str
    target_modules: tuple[str, ...]
    trainable_parameters: int
    total_parameters: int
    tokens: int
    seconds: float
    train_seconds: float
    charged: tuple[tuple[Any, int], ...] = ()
    steps_applied: int = 0
    steps_lost: int = 0
    resumed_from: int = 0
    validation_losses: tuple[tuple[int, float], ...] = ()
    validation_records: int = 0


MAX_VALIDATION_RECORDS = 2048  # bounded work: the validation loss is measured up to ~11 times a run


def _seeded(seed: int | None) -> contextlib.AbstractContextManager[Any]:
    """Fix torch's global RNG (LoRA initialisation, dropout) for a seeded run, restoring it after."""
    import torch

    if seed is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.random.fork_rng(devices=[]))
    torch.manual_seed(seed)
    return stack


def run_finetune(
    model_path: str | Path,
    records: Sequence[str],
    config: FinetuneConfig,
    plan: FinetunePlan,
    *,
    progress: Callable[[FinetuneProgress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    seed: int | None = None,
    report_loss: bool = False,
    device: str | None = None,
    max_physical_batch_size: int | None = None,
    checkpoint: FinetuneCheckpoint | None = None,
    validation: Sequence[str] | None = None,
    validation_every: int | None = None,
) -> FinetuneResult:
    """Fine-tune LoRA adapters of a local causal LM on ``records`` with DP-SGD, exactly as planned.

    Guarantee: the returned adapter (and everything computed from it) is ``(epsilon, plan.delta)``-DP
    with respect to adding or removing one record, ``epsilon = result.epsilon <= plan.epsilon``
    (checked against the engine's own accountant after training; a run that would exceed the plan
    is refused rather than returned). Poisson sampling at ``plan.sample_rate``, ``plan.steps`` steps,
    noise multiplier ``plan.noise_multiplier``, per-record clipping at ``plan.clip_norm`` over all
    LoRA parameters; noise from the OS CSPRNG (gaussdp.torch's default). Charge ``plan.event`` to the
    ledger BEFORE calling this.

    Args:
        model_path: a local Hugging Face directory with a causal LM and its tokenizer (read with
            ``local_files_only=True``; nothing is downloaded).
        records: the corpus (:func:`gaussdp.finetune.read_corpus`); ``len(records)`` must be the
            plan's ``n_records``.
        config: the job's settings; ``plan`` must have been made from it.
        plan: :func:`gaussdp.finetune.plan_finetune`'s plan (checked again here).
        progress: called after every step with a :class:`FinetuneProgress`.
        should_stop: polled before every step; True stops training with :class:`FinetuneCancelled`
            (the steps already taken were covered by the plan's charge).
        seed: keyword only. Fixes sampling, noise and the LoRA initialisation, for experiments: the
            adapter is then NOT private (warned with ``NotPrivateWarning``; ``result.private`` False).
        report_loss: also report each step's training loss (``FinetuneProgress.loss``,
            ``result.losses``). It is computed from the records without noise and is NOT covered by
            the guarantee: enable it only where whoever sees it may see the corpus (e.g. the data
            owner running the CLI on their own data). Off by default.
        device: torch device to train on (default ``"cpu"``).
        max_physical_batch_size: split each Poisson batch into forward/backward passes of at most
            this many records (memory), still one noised step per batch; default: no split.
        checkpoint: save state every ``checkpoint.every`` steps and resume from ``checkpoint.path``
            when it exists (:class:`FinetuneCheckpoint` says why a resume is sound).
        validation: records the caller declares PUBLIC (at most 2048), on which the adapter's mean
            per-record loss is measured before training, every ``validation_every`` steps and after
            the last (``FinetuneProgress.validation_loss``, ``result.validation_losses``). The loss
            is released without noise: never pass private records here.
        validation_every: steps between measurements (default: about ten in the run).

    Returns:
        A :class:`FinetuneResult`.

    Raises:
        InvalidParameter: bad arguments (named), a plan that does not match ``config`` or the
            number of records, a model that cannot be loaded or adapted.
        FinetuneCancelled: ``should_stop()`` returned True.
    """
    import torch

    if not isinstance(config, FinetuneConfig):
        raise TypeError(f"config must be a FinetuneConfig, got {type(config).__name__}")
    if isinstance(records, str) or not isinstance(records, Sequence):
        raise TypeError(f"records must be a sequence of strings, got {type(records).__name__}")
    for i, r in enumerate(records):
        if not isinstance(r, str) or not r.strip():
            raise InvalidParameter(f"records[{i}] must be a non-empty string, got {r!r:.40}")
    check_plan(plan, config=config, n_records=len(records))
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int or None, got seed={seed!r}")
    if not isinstance(report_loss, bool):
        raise TypeError(f"report_loss must be a bool, got report_loss={report_loss!r}")
    if max_physical_batch_size is not None and (
        isinstance(max_physical_batch_size, bool)
        or not isinstance(max_physical_batch_size, int)
        or max_physical_batch_size < 1
    ):
        raise InvalidParameter(
            f"max_physical_batch_size must be an int >= 1 or None, got {max_physical_batch_size!r}"
        )
    if validation is not None:
        if isinstance(validation, str) or not isinstance(validation, Sequence):
            raise TypeError(f"validation must be a sequence of strings, got {type(validation).__name__}")
        if not 1 <= len(validation) <= MAX_VALIDATION_RECORDS:
            raise InvalidParameter(
                f"validation must hold 1 to {MAX_VALIDATION_RECORDS} records, got {len(validation)}"
            )
        for i, r in enumerate(validation):
            if not isinstance(r, str) or not r.strip():
                raise InvalidParameter(f"validation[{i}] must be a non-empty string, got {r!r:.40}")
    if validation_every is not None and (
        isinstance(validation_every, bool) or not isinstance(validation_every, int) or validation_every < 1
    ):
        raise InvalidParameter(f"validation_every must be an int >= 1 or None, got {validation_every!r}")
    if checkpoint is not None and not isinstance(checkpoint, FinetuneCheckpoint):
        raise TypeError(f"checkpoint must be a FinetuneCheckpoint or None, got {type(checkpoint).__name__}")
    for name, fn in (("progress", progress), ("should_stop", should_stop)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
    try:
        dev = torch.device(device or "cpu")
    except (RuntimeError, TypeError):
        raise InvalidParameter(
            f"device must be a torch device name such as 'cpu', got device={device!r}"
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameter(f"device={device!r}: CUDA is not available here")

    with _seeded(seed):  # a seeded run also fixes LoRA's initialisation and the base's dropout
        return _train(
            model_path, records, config, plan, progress, should_stop, seed, report_loss, dev,
            max_physical_batch_size, checkpoint, validation, validation_every,
        )  # fmt: skip


def _train(
    model_path: str | Path,
    records: Sequence[str],
    config: FinetuneConfig,
    plan: FinetunePlan,
    progress: Callable[[FinetuneProgress], None] | None,
    should_stop: Callable[[], bool] | None,
    seed: int | None,
    report_loss: bool,
    dev: Any,
    max_physical_batch_size: int | None,
    checkpoint: FinetuneCheckpoint | None = None,
    validation: Sequence[str] | None = None,
    validation_every: int | None = None,
) -> FinetuneResult:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from gaussdp.torch import PrivacyEngine
    from gaussdp.torch.data import split_batch

    t0 = time.perf_counter()
    check_model(model_path, config)  # cheap refusals first (no weights loaded)
    model, tokenizer = load_base_model(model_path)
    model_type = str(getattr(model.config, "model_type", ""))
    ids, mask = tokenize_records(tokenizer, records, config.max_seq_len)
    peft_model, targets = wrap_lora(model, config)
    peft_model.to(dev)
    named_trainable = [(n, p) for n, p in peft_model.named_parameters() if p.requires_grad]
    trainable = [p for _, p in named_trainable]
    optimizer = torch.optim.Adam(trainable, lr=config.learning_rate)
    # batch_size gives the loader ceil(n / batch_size) = plan.steps_per_epoch batches, from which the
    # engine takes its Poisson sample rate 1 / len(loader): the plan's, checked below
    loader = DataLoader(TensorDataset(ids, mask), batch_size=config.batch_size, collate_fn=trim_padding)
    engine = PrivacyEngine(accountant=plan.accountant, seed=seed)
    peft_model.train()
    peft_model, dp_optimizer, dp_loader = engine.make_private(
        module=peft_model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=plan.noise_multiplier,
        max_grad_norm=plan.clip_norm,
        loss_reduction="sum",
        poisson_sampling=True,
    )
    try:
        if engine.sample_rate != plan.sample_rate or len(dp_loader) != plan.steps_per_epoch:
            raise RuntimeError(  # a bug, not a user error: never train off-plan
                f"the engine samples at {engine.sample_rate!r} over {len(dp_loader)} batches, "
                f"the plan at {plan.sample_rate!r} over {plan.steps_per_epoch}"
            )
        losses: list[float] = []
        tokens = 0
        step = 0  # steps released (noised and counted by the engine's accountant)
        lost = resumed_from = 0
        if checkpoint is not None and (checkpoint.path.is_file() or checkpoint.released):
            resumed_from, lost_before = 0, 0  # no checkpoint yet: from the fresh adapters
            if checkpoint.path.is_file():
                resumed_from, lost_before = load_checkpoint(
                    checkpoint.path, plan, engine, named_trainable, optimizer
                )
            step = max(resumed_from, checkpoint.released)
            if step > plan.steps:
                raise RuntimeError(f"{step} steps were released, more than the plan's {plan.steps}")
            lost = step - resumed_from  # this resume's: the checkpoint's own are in lost_before
            from gaussdp.accounting import SubsampledGaussianEvent

            for _ in range(lost):  # released before the crash, updates lost: counted, never re-run
                engine.accountant.compose(SubsampledGaussianEvent(plan.noise_multiplier, engine.sample_rate))
                engine.accountant.step(noised=True)
            if checkpoint.on_resume is not None:
                checkpoint.on_resume(resumed_from, lost)
            lost += lost_before
        val_losses: list[tuple[int, float]] = []
        val = None if validation is None else tokenize_records(tokenizer, validation, config.max_seq_len)
        val_every = validation_every or max(1, plan.steps // 10)

        def measure() -> float | None:
            if val is None:
                return None
            loss = _mean_loss(peft_model, val, config.batch_size, dev)
            val_losses.append((step, loss))
            return loss

        if step == 0:
            first = measure()
            if first is not None and progress is not None:
                progress(FinetuneProgress(0, plan.steps, 0.0, None, first))
        t_train = time.perf_counter()
        for batch in _batches(dp_loader, plan.steps - step):
            if should_stop is not None and should_stop():
                raise FinetuneCancelled(step, _epsilon_after(plan, step))
            b_ids, b_mask = batch
            chunks = list(split_batch((b_ids, b_mask), max_physical_batch_size or max(1, len(b_ids))))
            total, count = 0.0, 0
            for k, (c_ids, c_mask) in enumerate(chunks):
                dp_optimizer.signal_skip_step(do_skip=k < len(chunks) - 1)
                if len(c_ids) == 0:
                    # an empty Poisson batch: nothing to clip, but the step still releases noise
                    # (and is charged), as the accountant assumes; HF models refuse 0-row inputs
                    dp_optimizer.step()
                    dp_optimizer.zero_grad()
                    continue
                c_ids, c_mask = c_ids.to(dev), c_mask.to(dev)
                per_rec = per_record_loss(peft_model, c_ids, c_mask)
                per_rec.sum().backward()
                dp_optimizer.step()
                dp_optimizer.zero_grad()
                total += float(per_rec.detach().sum())
                count += len(c_ids)
                tokens += int(c_mask.sum())
            step += 1
            if checkpoint is not None and step % checkpoint.every == 0 and step < plan.steps:
                save_checkpoint(checkpoint.path, plan, step, lost, engine, named_trainable, optimizer)
            loss = total / count if (report_loss and count) else None
            if report_loss:
                losses.append(loss if loss is not None else math.nan)
            val_loss = measure() if (step % val_every == 0 or step == plan.steps) else None
            if progress is not None:
                progress(FinetuneProgress(step, plan.steps, _epsilon_after(plan, step), loss, val_loss))
        train_seconds = time.perf_counter() - t_train
        if engine.steps != plan.steps or step != plan.steps:
            raise RuntimeError(f"took {engine.steps} steps, the plan {plan.steps}")
        applied = optimizer_updates(optimizer)
        if applied is not None and applied != plan.steps - lost:  # a bug: never release it
            raise RuntimeError(f"the adapter holds {applied} updates, not {plan.steps} less {lost} lost")
        # The engine composed the same events one step at a time; its PLD discretisation may differ
        # from the plan's one-shot composition in the last digits. Both are upper bounds on the
        # same run's epsilon, so the smaller one is too; a larger difference would be a bug.
        epsilon = min(engine.get_epsilon(plan.delta), plan.epsilon)
        if not engine.get_epsilon(plan.delta) <= plan.epsilon * (1.0 + _EPS_REL_TOL):
            raise RuntimeError(  # never release an adapter that cost more than was charged
                f"the run spent epsilon={engine.get_epsilon(plan.delta)!r}, more than the plan's "
                f"{plan.epsilon!r}"
            )
        noise_stream = engine.noise_stream or "unknown"
        charged = tuple(engine.accountant.history)
        # as accountants see events: a step at sample rate 1 is a plain Gaussian release
        if charged != tuple(flatten_event(plan.event)):
            raise RuntimeError(f"the engine charged {charged}, not the plan's steps")
    finally:
        engine.detach()  # the hooks go: the model is an ordinary peft model again
    peft_model.eval()
    return FinetuneResult(
        peft_model=peft_model,
        tokenizer=tokenizer,
        plan=plan,
        config=config,
        losses=tuple(losses),
        epsilon=epsilon,
        steps_done=step,
        private=seed is None,
        noise_stream=noise_stream,
        base_model=str(Path(model_path)),
        model_type=model_type,
        target_modules=targets,
        trainable_parameters=sum(p.numel() for p in trainable),
        total_parameters=sum(p.numel() for p in peft_model.parameters()),
        tokens=tokens,
        seconds=time.perf_counter() - t0,
        train_seconds=train_seconds,
        charged=charged,
        steps_applied=plan.steps - lost if applied is None else applied,
        steps_lost=lost,
        resumed_from=resumed_from,
        validation_losses=tuple(val_losses),
        validation_records=0 if validation is None else len(validation),
    )


def _mean_loss(model: Any, data: tuple[Any, Any], batch_size: int, dev: Any) -> float:
    """Mean per-record loss on ``data`` (no gradients: the DP hooks record nothing; eval mode)."""
    import torch

    ids, mask = data
    was_training = model.training
    model.eval()
    total = 0.0
    try:
        with torch.no_grad():
            for i in range(0, len(ids), max(1, batch_size)):
                b_ids, b_mask = trim_padding(
                    list(zip(ids[i : i + batch_size], mask[i : i + batch_size], strict=True))
                )
                total += float(per_record_loss(model, b_ids.to(dev), b_mask.to(dev)).sum())
    finally:
        model.train(was_training)
    return total / len(ids)


def _batches(loader: Any, steps: int) -> Iterator[Any]:
    """``steps`` Poisson batches (each pass over the loader draws steps_per_epoch of them)."""
    while steps > 0:
        for batch in loader:
            if steps <= 0:
                return
            steps -= 1
            yield batch


def _epsilon_after(plan: FinetunePlan, steps_done: int) -> float:
    """epsilon at ``plan.delta`` of the first ``steps_done`` steps, composed as the plan's event is
    (one self-composition), so that after the last step it is exactly ``plan.epsilon``."""
    from gaussdp.accounting import SelfComposedEvent
    from gaussdp.accounting import accountant as make_accountant

    if steps_done == 0:
        return 0.0
    if steps_done == plan.steps:
        return plan.epsilon
    step_event = plan.event.event  # type: ignore[attr-defined]
    acc = make_accountant(plan.accountant).compose(SelfComposedEvent(step_event, steps_done))
    return float(acc.epsilon(plan.delta))
