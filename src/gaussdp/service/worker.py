"""The fine-tuning worker: takes queued jobs from the ledger's database and trains them, one at a time.

``gaussdp serve --data-dir DIR`` starts ``--finetune-workers`` of these (default 1) beside the HTTP
workers; ``gaussdp worker --db URL --data-dir DIR --model NAME=PATH`` runs more on other machines
(with PostgreSQL, and ``DIR`` on a file system every worker and the server share: corpora are read
from it and adapters written to it). A worker only takes jobs for the models it was given, loads its
own copy of each, and trains in its own process: request handlers never train.

Each job: claim it (one transaction), re-plan it from the stored request and the corpus and check
that the plan's event is the one that was charged (a different event is never trained: the job
fails), train with ``gaussdp.finetune.run_finetune`` while heartbeating and writing progress to the
row, save the adapter under ``DIR``, mark the row.

Interruptions (``on_interrupt``): every ``checkpoint_every`` steps the job's state (adapters,
optimizer, the engine's accountant) is written to ``DIR/tenants/t-TENANT/checkpoints/JOB.pt``. A job
whose worker dies (a crash: found by the next worker or server that starts, or by any worker once
its lease of ``lease_s`` without a heartbeat has run out) or is stopped (SIGTERM) is, with
``"resume"`` (the default), queued again and resumed by the next worker from that checkpoint: the
steps reported after the checkpoint stay counted as released and are never run again (they are the
job's ``steps_lost``), so the job takes the plan's steps in all, under its one charge
(:class:`gaussdp.finetune.FinetuneCheckpoint`). After ``max_attempts`` claims it is failed. With
``"fail"`` (the rule before checkpoints) an interrupted job is failed and never re-run. Either way
its charge stays.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from gaussdp.accounting.events import event_json
from gaussdp.service.jobs import DEFAULT_MAX_ATTEMPTS, JobRow, JobStore, worker_identity

__all__ = [
    "DEFAULT_CHECKPOINT_EVERY",
    "DEFAULT_LEASE_S",
    "ON_INTERRUPT",
    "adapter_dir",
    "checkpoint_path",
    "corpus_path",
    "finetune_config",
    "run_job",
    "run_worker",
]

logger = logging.getLogger("gaussdp.worker")

DEFAULT_LEASE_S = 60.0
DEFAULT_CHECKPOINT_EVERY = 10
ON_INTERRUPT = ("resume", "fail")


def tenant_dir(data_dir: str | Path, tenant: str) -> Path:
    # Tenant names are letters, digits, '_', '.', '-': the "t-" prefix keeps "." and ".." harmless.
    return Path(data_dir) / "tenants" / f"t-{tenant}"


def corpus_path(data_dir: str | Path, tenant: str, corpus_id: str, fmt: str) -> Path:
    return tenant_dir(data_dir, tenant) / "corpora" / f"{corpus_id}.{'jsonl' if fmt == 'jsonl' else 'txt'}"


def adapter_dir(data_dir: str | Path, tenant: str, job_id: str) -> Path:
    return tenant_dir(data_dir, tenant) / "adapters" / job_id


def checkpoint_path(data_dir: str | Path, tenant: str, job_id: str) -> Path:
    return tenant_dir(data_dir, tenant) / "checkpoints" / f"{job_id}.pt"


def finetune_config(config: Mapping[str, Any]) -> Any:
    """The :class:`gaussdp.finetune.FinetuneConfig` of a job's stored request (one mapping, used by
    the request handler to plan and charge, and by the worker to re-plan: the same function)."""
    from gaussdp.finetune import FinetuneConfig

    lora = config.get("lora") or {}
    kwargs: dict[str, Any] = {
        "lora_rank": lora.get("rank"),
        "lora_alpha": lora.get("alpha"),
        "target_modules": None if lora.get("target_modules") is None else tuple(lora["target_modules"]),
        "target_epsilon": config.get("target_epsilon"),
        "noise_multiplier": config.get("noise_multiplier"),
        "delta": config.get("delta"),
        "epochs": config.get("epochs"),
        "batch_size": config.get("batch_size"),
        "learning_rate": config.get("learning_rate"),
        "max_seq_len": config.get("max_seq_len"),
        "clip_norm": config.get("clip_norm"),
        "accountant": config.get("accountant"),
    }
    return FinetuneConfig(**{k: v for k, v in kwargs.items() if v is not None})


def _event_dict(event: Any) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(event_json(event))
    return out


def run_job(
    store: JobStore,
    job: JobRow,
    worker: str,
    *,
    data_dir: str | Path,
    model_path: str,
    lease_s: float = DEFAULT_LEASE_S,
    on_interrupt: str = "resume",
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
) -> str:
    """Train one claimed job to its end; returns its final state (``succeeded|failed|cancelled``,
    or ``queued`` when the worker was stopped and the job will resume elsewhere)."""
    from gaussdp.finetune import (
        FinetuneCancelled,
        FinetuneCheckpoint,
        plan_finetune,
        read_corpus,
        run_finetune,
        save_adapter,
    )

    if on_interrupt not in ON_INTERRUPT:
        raise ValueError(f"on_interrupt must be one of {ON_INTERRUPT}, got on_interrupt={on_interrupt!r}")
    resume = on_interrupt == "resume"
    ckpt_file = checkpoint_path(data_dir, job.tenant, job.id)

    stop = threading.Event()
    cancelled = threading.Event()

    def beat() -> None:  # the lease holds while a long step runs
        while not stop.wait(max(0.5, lease_s / 4)):
            try:
                if store.heartbeat(job.id, worker):
                    cancelled.set()
            except Exception:  # a database blip: the next beat retries; the lease allows a few misses
                logger.warning("heartbeat of job %s failed", job.id, exc_info=True)

    beater = threading.Thread(target=beat, name=f"heartbeat-{job.id}", daemon=True)
    beater.start()
    try:
        corpus = store.corpus(job.tenant, job.corpus_id)
        if corpus is None:
            raise RuntimeError("its corpus was deleted before the job started")
        records = read_corpus(corpus.path, format=corpus.format)
        validation = None
        val_id = job.config.get("validation_corpus_id")
        if val_id is not None:  # declared public by the job's owner (validation_public, checked)
            val = store.corpus(job.tenant, str(val_id))
            if val is None:
                raise RuntimeError("its validation corpus was deleted before the job started")
            validation = read_corpus(val.path, format=val.format)
        config = finetune_config(job.config)
        plan = plan_finetune(config, n_records=len(records))
        if _event_dict(plan.event) != job.event:
            raise RuntimeError("the plan's event differs from the one charged; nothing was trained")

        def progress(info: Any) -> None:
            get = info.get if isinstance(info, Mapping) else lambda k, d=None: getattr(info, k, d)
            loss, val_loss = get("loss"), get("validation_loss")
            if store.progress(
                job.id,
                worker,
                step=int(get("step", 0)),
                steps=int(get("steps", plan.steps)),
                epsilon_so_far=float(get("epsilon_so_far", get("epsilon", 0.0))),
                loss=None if loss is None else float(loss),
                validation_loss=None if val_loss is None else float(val_loss),
            ):
                cancelled.set()

        def should_stop() -> bool:
            return cancelled.is_set()

        def resumed(from_step: int, lost: int) -> None:
            logger.warning(
                "job %s: resumed from its checkpoint at step %d; %d step(s) after it were released and "
                "are lost (counted, not run again)", job.id, from_step, lost,
            )  # fmt: skip
            if lost:
                store.lost_steps(job.id, worker, lost)

        checkpoint = None
        if resume:
            checkpoint = FinetuneCheckpoint(
                ckpt_file, every=checkpoint_every, released=job.step, on_resume=resumed
            )
        result = run_finetune(
            model_path, records, config, plan, progress=progress, should_stop=should_stop,
            checkpoint=checkpoint, validation=validation,
        )  # fmt: skip
        out = adapter_dir(data_dir, job.tenant, job.id)
        final = store.job(None, job.id)
        save_adapter(
            result,
            out,
            local_dp=corpus.local_dp,
            corpus_name=corpus.name,
            attempts=job.attempts if final is None else final.attempts,
        )
        state = "succeeded"
        store.finish(job.id, worker, state, adapter_path=str(out))
    except FinetuneCancelled:
        state = "cancelled"
        store.finish(job.id, worker, state, error="cancelled by request; the charge stays")
    except Exception as exc:
        logger.exception("fine-tuning job %s failed", job.id)
        state = "failed"
        store.finish(job.id, worker, state, error=f"{type(exc).__name__}: {exc}"[:2000])
    except BaseException:  # SIGTERM/SIGINT (the server stops)
        if not (
            resume
            and store.requeue(job.id, worker, "interrupted: the worker was stopped; queued again to resume")
        ):
            store.finish(
                job.id, worker, "failed", error="interrupted: the worker was stopped; the charge stays"
            )
        raise
    finally:
        stop.set()
        beater.join(timeout=5)
    if state != "queued":
        ckpt_file.unlink(missing_ok=True)  # the job is over: its state is no longer needed
    return state


def run_worker(
    db: str,
    data_dir: str | Path,
    models: Mapping[str, str],
    *,
    poll_s: float = 1.0,
    lease_s: float = DEFAULT_LEASE_S,
    max_jobs: int | None = None,
    parent_pid: int | None = None,
    should_exit: Callable[[], bool] | None = None,
    on_interrupt: str = "resume",
    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
) -> int:
    """Take and train jobs until interrupted (or ``max_jobs`` done, or the parent process is gone).

    Args:
        db: the ledger's database URL (``sqlite:///...`` or ``postgresql://...``).
        data_dir: where corpora are read and adapters written (shared with the server).
        models: base model name -> local directory; only jobs for these names are taken.
        poll_s: seconds between looks at the queue when it is empty.
        lease_s: a running job without a heartbeat this long is failed by any worker.
        max_jobs: stop after this many jobs (tests); None: run forever.
        parent_pid: exit when this process is gone (workers started by ``gaussdp serve``).
        on_interrupt: ``"resume"`` (default): an interrupted job is queued again and resumed from
            its last checkpoint; ``"fail"``: it is failed, never re-run (the old rule).
        checkpoint_every: steps between a job's checkpoints (>= 1; 1 loses no step to a crash).
        max_attempts: claims of one job before an interruption fails it (resume only).

    Returns:
        The number of jobs run.
    """
    from gaussdp.budget import Ledger

    if on_interrupt not in ON_INTERRUPT:
        raise ValueError(f"on_interrupt must be one of {ON_INTERRUPT}, got on_interrupt={on_interrupt!r}")
    with Ledger(db):  # migrates the schema when this worker is the first to open the database
        pass
    store = JobStore(db)
    worker = worker_identity()
    done = 0
    last_sweep = 0.0
    logger.info("fine-tuning worker %s on %s, models %s", worker, db.split("@")[-1], sorted(models))
    try:
        while max_jobs is None or done < max_jobs:
            if parent_pid is not None and os.getppid() != parent_pid:
                break
            if should_exit is not None and should_exit():
                break
            if time.monotonic() - last_sweep > min(lease_s / 2, 10.0):
                resume = on_interrupt == "resume"
                for job_id in store.fail_abandoned(lease_s, resume=resume, max_attempts=max_attempts):
                    logger.warning("job %s was interrupted (its worker is gone): %s", job_id,
                                   "queued again or failed" if resume else "marked failed")  # fmt: skip
                last_sweep = time.monotonic()
            job = store.claim(worker, sorted(models))
            if job is None:
                time.sleep(poll_s)
                continue
            logger.info("job %s (tenant %s, model %s): started", job.id, job.tenant, job.model)
            state = run_job(
                store, job, worker, data_dir=data_dir, model_path=models[job.model], lease_s=lease_s,
                on_interrupt=on_interrupt, checkpoint_every=checkpoint_every,
            )  # fmt: skip
            logger.info("job %s: %s", job.id, state)
            done += 1
    finally:
        store.close()
    return done
