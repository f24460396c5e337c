"""Corpora and fine-tuning jobs in the ledger's database (tables of migration 0004).

:class:`JobStore` is the only module that writes ``gdp_corpora`` and ``gdp_finetune_jobs``. It opens
its own connections to the ledger's database (the same SQLite file or PostgreSQL schema as the
:class:`~gaussdp.budget.Ledger`), so that the service's request handlers and any number of
``gaussdp worker`` processes share one queue.

Why the queue is a table and not a queue library (Celery, RQ, arq): a job must exist only after its
charge is committed, and a job's state must survive exactly as long as the charge that paid for it.
With the jobs in the ledger's database there is one durable store, one backup and no window where a
broker holds a job the ledger does not know about (or the reverse). Claiming is one short
transaction: PostgreSQL ``SELECT ... FOR UPDATE SKIP LOCKED`` then ``UPDATE`` (concurrent workers
skip each other's rows instead of queueing on them); SQLite ``BEGIN IMMEDIATE`` then
``UPDATE ... WHERE state = 'queued' ... RETURNING`` (the write lock makes the read-and-set atomic).

Job states: ``charging`` (row written, charge in flight: never claimed) -> ``queued`` -> ``running``
-> ``succeeded`` | ``failed`` | ``cancelled``. A running job whose worker stops heartbeating for
``lease_s`` (or whose worker process on this host is gone) is interrupted: with ``resume`` (the
default of ``gaussdp serve`` and ``gaussdp worker``) it goes back to ``queued`` and the next worker
resumes it from its last checkpoint, never re-running a step already released
(:func:`gaussdp.finetune.run_finetune`); with the old rule (``--on-interrupt fail``) it is marked
``failed`` and never re-run. Either way its charge stays: it paid for the whole plan. Heartbeats and the
lease check use the database's clock, so workers' clocks on other machines do not matter.
"""

from __future__ import annotations

import json
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from gaussdp.budget._db import (
    SQLITE,
    SQLiteURL,
    check_sqlite_ledger,
    connect_sqlite,
    parse_url,
    postgres_dialect,
    postgres_pool,
)
from gaussdp.errors import InvalidParameter, PrivacyError

__all__ = [
    "ACTIVE_STATES",
    "DEFAULT_MAX_ATTEMPTS",
    "TERMINAL_STATES",
    "CorpusRow",
    "JobRow",
    "JobStore",
    "QuotaExceeded",
    "worker_identity",
]

TERMINAL_STATES = ("succeeded", "failed", "cancelled")
DEFAULT_MAX_ATTEMPTS = 3
ACTIVE_STATES = ("charging", "queued", "running")

_CORPUS_COLUMNS = "id, tenant, name, format, bytes, records, sha256, local_dp, path, created_at"
_JOB_COLUMNS = (
    "id, tenant, corpus_id, model, principal, config, event, epsilon, delta, charge_id, state, step, "
    "steps, epsilon_so_far, loss, error, cancel_requested, worker, attempts, heartbeat_at, created_at, "
    "started_at, finished_at, adapter_path, steps_lost, validation_loss"
)


class QuotaExceeded(PrivacyError):
    """A tenant's quota (stored corpora, their bytes, unfinished jobs) would be passed: nothing stored."""


@dataclass(frozen=True)
class CorpusRow:
    id: str
    tenant: str
    name: str
    format: str
    bytes: int
    records: int
    sha256: str
    local_dp: dict[str, Any] | None
    path: str
    created_at: float


@dataclass(frozen=True)
class JobRow:
    id: str
    tenant: str
    corpus_id: str
    model: str
    principal: str
    config: dict[str, Any]
    event: dict[str, Any]
    epsilon: float
    delta: float
    charge_id: int | None
    state: str
    step: int
    steps: int
    epsilon_so_far: float
    loss: float | None
    error: str | None
    cancel_requested: bool
    worker: str | None
    attempts: int
    heartbeat_at: float | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    adapter_path: str | None
    steps_lost: int = 0  # released steps not in the checkpoint a resumed attempt started from
    validation_loss: float | None = None  # the latest loss on the public validation corpus


def _corpus(r: Sequence[Any]) -> CorpusRow:
    return CorpusRow(
        r[0],
        r[1],
        r[2],
        r[3],
        int(r[4]),
        int(r[5]),
        r[6],
        None if r[7] is None else json.loads(r[7]),
        r[8],
        r[9],
    )


def _job(r: Sequence[Any]) -> JobRow:
    return JobRow(
        r[0], r[1], r[2], r[3], r[4], json.loads(r[5]), json.loads(r[6]), float(r[7]), float(r[8]),
        None if r[9] is None else int(r[9]), r[10], int(r[11]), int(r[12]), float(r[13]),
        None if r[14] is None else float(r[14]), r[15], bool(r[16]), r[17], int(r[18]), r[19], r[20],
        r[21], r[22], r[23], int(r[24] or 0), None if r[25] is None else float(r[25]),
    )  # fmt: skip


def worker_identity() -> str:
    """``host:pid:random``: who holds a running job (the host and pid let a restart detect a dead one)."""
    import secrets

    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _dead_local_worker(worker: str | None) -> bool:
    """True when ``worker`` ran on this host and its process no longer exists."""
    if not worker:
        return False
    host, _, rest = worker.partition(":")
    pid_s = rest.partition(":")[0]
    if host != socket.gethostname() or not pid_s.isdigit():
        return False
    try:
        os.kill(int(pid_s), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # someone else's process: alive
        return False
    return False


class JobStore:
    """Corpora and jobs in the ledger database at ``url`` (``sqlite:///...`` or ``postgresql://...``).

    The schema must exist (open a :class:`~gaussdp.budget.Ledger` on ``url`` first: it migrates).
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._lock = threading.Lock()
        try:
            self._db = parse_url(url)  # the ledger's own parsing: one spelling of every option
        except InvalidParameter:
            raise InvalidParameter(
                "fine-tuning needs a durable ledger (sqlite:///... or postgresql://...), got "
                + repr(url.split("@")[-1])
            ) from None
        if isinstance(self._db, SQLiteURL):
            check_sqlite_ledger(self._db.path)
            self.dialect = "sqlite"
            self._dialect = SQLITE
            self._local = threading.local()
        else:
            self.dialect = "postgres"
            self._dialect = postgres_dialect(self._db.schema)
            self._pool = postgres_pool(
                self._db.conninfo, max_size=4, name="gaussdp-jobs", check=_check_connection()
            )

    # -- connections -----------------------------------------------------------------------------
    def _sql(self, sql: str) -> str:
        return self._dialect.sql(sql)

    def _sqlite(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            db = self._db
            if not isinstance(db, SQLiteURL):  # pragma: no cover - only called for SQLite
                raise TypeError("internal: a SQLite connection of a PostgreSQL job store")
            # the ledger's connection and pragmas (WAL, synchronous, busy timeout), one per thread
            conn = connect_sqlite(db.path, busy_timeout_ms=db.busy_timeout_ms, synchronous=db.synchronous)
            self._local.conn = conn
        return conn

    @contextmanager
    def _tx(self, *, immediate: bool = False) -> Iterator[Any]:
        """A transaction; a cursor-like ``execute(sql, args)`` object is yielded."""
        if self.dialect == "sqlite":
            conn = self._sqlite()
            conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
            try:
                yield _Exec(conn, self._sql)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        else:
            with self._pool.connection() as pg, pg.transaction():
                yield _Exec(pg, self._sql)

    def close(self) -> None:
        if self.dialect == "postgres":
            self._pool.close()
        else:
            conn = getattr(self._local, "conn", None)
            if conn is not None:
                conn.close()
                self._local.conn = None

    def _tenant_lock(self, x: Any, tenant: str) -> None:
        """Serialize a tenant's quota-checked inserts (SQLite: the write lock of BEGIN IMMEDIATE)."""
        if self.dialect == "postgres":
            x("SELECT pg_advisory_xact_lock(hashtextextended(?, 29))", (tenant,))

    # -- corpora ---------------------------------------------------------------------------------
    def corpus_usage(self, tenant: str) -> tuple[int, int]:
        """(corpora stored, their bytes) of ``tenant``."""
        with self._tx() as x:
            n, size = x(
                "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM {p}gdp_corpora WHERE tenant = ?", (tenant,)
            ).fetchone()
        return int(n), int(size)

    def add_corpus(self, c: CorpusRow, *, max_count: int | None = None, max_bytes: int | None = None) -> None:
        """Store the row; with ``max_count``/``max_bytes``, only if the tenant's corpora stay within
        them (checked in the same transaction as the insert: concurrent uploads cannot pass them).

        Raises:
            QuotaExceeded: nothing was stored.
        """
        with self._tx(immediate=True) as x:
            if max_count is not None or max_bytes is not None:
                self._tenant_lock(x, c.tenant)
                n, size = x(
                    "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM {p}gdp_corpora WHERE tenant = ?",
                    (c.tenant,),
                ).fetchone()
                if max_count is not None and int(n) + 1 > max_count:
                    raise QuotaExceeded(
                        f"this tenant stores {n} corpora, its quota (max_corpora_per_tenant={max_count}); "
                        "delete one first"
                    )
                if max_bytes is not None and int(size) + c.bytes > max_bytes:
                    raise QuotaExceeded(
                        f"this tenant's corpora would hold {int(size) + c.bytes} bytes, more than its quota "
                        f"(max_corpus_bytes_per_tenant={max_bytes}); delete some first"
                    )
            x(
                f"INSERT INTO {{p}}gdp_corpora ({_CORPUS_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    c.id, c.tenant, c.name, c.format, c.bytes, c.records, c.sha256,
                    None if c.local_dp is None else json.dumps(c.local_dp), c.path, c.created_at,
                ),
            )  # fmt: skip

    def corpus(self, tenant: str, corpus_id: str) -> CorpusRow | None:
        with self._tx() as x:
            r = x(
                f"SELECT {_CORPUS_COLUMNS} FROM {{p}}gdp_corpora WHERE tenant = ? AND id = ?",
                (tenant, corpus_id),
            ).fetchone()
        return None if r is None else _corpus(r)

    def corpora(self, tenant: str, limit: int | None = None) -> list[CorpusRow]:
        """The tenant's corpora, oldest first (only the newest ``limit`` when given)."""
        with self._tx() as x:
            if limit is None:
                rows = x(
                    f"SELECT {_CORPUS_COLUMNS} FROM {{p}}gdp_corpora WHERE tenant = ? "
                    "ORDER BY created_at, id",
                    (tenant,),
                ).fetchall()
            else:
                rows = x(
                    f"SELECT {_CORPUS_COLUMNS} FROM {{p}}gdp_corpora WHERE tenant = ? "
                    "ORDER BY created_at DESC, id DESC LIMIT ?",
                    (tenant, int(limit)),
                ).fetchall()[::-1]
        return [_corpus(r) for r in rows]

    def delete_corpus(self, tenant: str, corpus_id: str) -> CorpusRow | None:
        """Delete the row (the caller removes the file); the deleted row, or None if none."""
        with self._tx(immediate=True) as x:
            r = x(
                f"SELECT {_CORPUS_COLUMNS} FROM {{p}}gdp_corpora WHERE tenant = ? AND id = ?",
                (tenant, corpus_id),
            ).fetchone()
            if r is None:
                return None
            x("DELETE FROM {p}gdp_corpora WHERE id = ?", (corpus_id,))
        return _corpus(r)

    # -- jobs: the service -----------------------------------------------------------------------
    def add_job(self, j: JobRow, *, max_active: int | None = None) -> None:
        """Store the row; with ``max_active``, only if the tenant then has at most that many jobs not
        yet finished (charging, queued, running; checked in the insert's transaction).

        Raises:
            QuotaExceeded: nothing was stored.
        """
        with self._tx(immediate=True) as x:
            if max_active is not None:
                self._tenant_lock(x, j.tenant)
                (n,) = x(
                    "SELECT COUNT(*) FROM {p}gdp_finetune_jobs WHERE tenant = ? AND state IN "
                    "('charging', 'queued', 'running')",
                    (j.tenant,),
                ).fetchone()
                if int(n) + 1 > max_active:
                    raise QuotaExceeded(
                        f"this tenant has {n} fine-tuning jobs not finished, its quota "
                        f"(max_jobs_per_tenant={max_active}); wait for one or cancel one"
                    )
            x(
                f"INSERT INTO {{p}}gdp_finetune_jobs ({_JOB_COLUMNS}) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    j.id, j.tenant, j.corpus_id, j.model, j.principal, json.dumps(j.config),
                    json.dumps(j.event), j.epsilon, j.delta, j.charge_id, j.state, j.step, j.steps,
                    j.epsilon_so_far, j.loss, j.error, int(j.cancel_requested), j.worker, j.attempts,
                    j.heartbeat_at, j.created_at, j.started_at, j.finished_at, j.adapter_path, j.steps_lost,
                    j.validation_loss,
                ),
            )  # fmt: skip

    def charged(self, job_id: str, charge_id: int) -> None:
        """``charging`` -> ``queued`` once the charge is committed (workers may claim it from now)."""
        with self._tx() as x:
            x(
                "UPDATE {p}gdp_finetune_jobs SET state = 'queued', charge_id = ? "
                "WHERE id = ? AND state = 'charging'",
                (charge_id, job_id),
            )

    def drop_uncharged(self, job_id: str) -> None:
        """Remove a ``charging`` row whose charge was refused (nothing was charged or queued)."""
        with self._tx() as x:
            x("DELETE FROM {p}gdp_finetune_jobs WHERE id = ? AND state = 'charging'", (job_id,))

    def job(self, tenant: str | None, job_id: str) -> JobRow | None:
        """The job ``job_id`` of ``tenant`` (any tenant's when None: workers)."""
        with self._tx() as x:
            if tenant is None:
                r = x(f"SELECT {_JOB_COLUMNS} FROM {{p}}gdp_finetune_jobs WHERE id = ?", (job_id,)).fetchone()
            else:
                r = x(
                    f"SELECT {_JOB_COLUMNS} FROM {{p}}gdp_finetune_jobs WHERE tenant = ? AND id = ?",
                    (tenant, job_id),
                ).fetchone()
        return None if r is None else _job(r)

    def jobs(self, tenant: str | None = None, limit: int | None = None) -> list[JobRow]:
        """Jobs (the tenant's, or every tenant's), oldest first (only the newest ``limit`` when given)."""
        with self._tx() as x:
            if tenant is not None and limit is not None:
                rows = x(
                    f"SELECT {_JOB_COLUMNS} FROM {{p}}gdp_finetune_jobs WHERE tenant = ? "
                    "ORDER BY created_at DESC, id DESC LIMIT ?",
                    (tenant, int(limit)),
                ).fetchall()[::-1]
            elif tenant is None:
                rows = x(
                    f"SELECT {_JOB_COLUMNS} FROM {{p}}gdp_finetune_jobs ORDER BY created_at, id", ()
                ).fetchall()
            else:
                rows = x(
                    f"SELECT {_JOB_COLUMNS} FROM {{p}}gdp_finetune_jobs WHERE tenant = ? "
                    "ORDER BY created_at, id",
                    (tenant,),
                ).fetchall()
        return [_job(r) for r in rows]

    def request_cancel(self, tenant: str, job_id: str) -> JobRow | None:
        """Cancel: a queued job at once (no worker will take it), a running one at its next step."""
        now = time.time()
        with self._tx(immediate=True) as x:
            x(
                "UPDATE {p}gdp_finetune_jobs SET state = 'cancelled', finished_at = ?, cancel_requested = 1 "
                "WHERE tenant = ? AND id = ? AND state = 'queued'",
                (now, tenant, job_id),
            )
            x(
                "UPDATE {p}gdp_finetune_jobs SET cancel_requested = 1 "
                "WHERE tenant = ? AND id = ? AND state = 'running'",
                (tenant, job_id),
            )
        return self.job(tenant, job_id)

    # -- jobs: workers ---------------------------------------------------------------------------
    def claim(self, worker: str, models: Sequence[str]) -> JobRow | None:
        """Atomically take the oldest queued job for one of ``models``; None when there is none."""
        if not models:
            return None
        marks = ", ".join("?" for _ in models)
        with self._tx(immediate=True) as x:
            if self.dialect == "postgres":
                r = x(
                    "SELECT id FROM {p}gdp_finetune_jobs WHERE state = 'queued' "
                    f"AND model IN ({marks}) ORDER BY created_at, id LIMIT 1 FOR UPDATE SKIP LOCKED",
                    tuple(models),
                ).fetchone()
                if r is None:
                    return None
                row = x(
                    "UPDATE {p}gdp_finetune_jobs SET state = 'running', worker = ?, heartbeat_at = {now}, "
                    f"started_at = {{now}}, attempts = attempts + 1 WHERE id = ? RETURNING {_JOB_COLUMNS}",
                    (worker, r[0]),
                ).fetchone()
            else:
                row = x(
                    "UPDATE {p}gdp_finetune_jobs SET state = 'running', worker = ?, heartbeat_at = {now}, "
                    "started_at = {now}, attempts = attempts + 1 WHERE state = 'queued' AND id = ("
                    f"SELECT id FROM {{p}}gdp_finetune_jobs WHERE state = 'queued' AND model IN ({marks}) "
                    f"ORDER BY created_at, id LIMIT 1) RETURNING {_JOB_COLUMNS}",
                    (worker, *models),
                ).fetchone()
        return None if row is None else _job(row)

    def progress(
        self,
        job_id: str,
        worker: str,
        *,
        step: int,
        steps: int,
        epsilon_so_far: float,
        loss: float | None,
        validation_loss: float | None = None,
    ) -> bool:
        """Record progress (and heartbeat; ``validation_loss`` when measured at this step); True when
        a cancel was requested (or the job is not ours)."""
        with self._tx() as x:
            x(
                "UPDATE {p}gdp_finetune_jobs SET step = ?, steps = ?, epsilon_so_far = ?, loss = ?, "
                "validation_loss = COALESCE(?, validation_loss), heartbeat_at = {now} "
                "WHERE id = ? AND worker = ? AND state = 'running'",
                (step, steps, epsilon_so_far, loss, validation_loss, job_id, worker),
            )
            r = x(
                "SELECT cancel_requested, state, worker FROM {p}gdp_finetune_jobs WHERE id = ?", (job_id,)
            ).fetchone()
        return r is None or bool(r[0]) or r[1] != "running" or r[2] != worker

    def heartbeat(self, job_id: str, worker: str) -> bool:
        """Extend the lease; True when a cancel was requested (or the job is no longer ours)."""
        with self._tx() as x:
            x(
                "UPDATE {p}gdp_finetune_jobs SET heartbeat_at = {now} "
                "WHERE id = ? AND worker = ? AND state = 'running'",
                (job_id, worker),
            )
            r = x(
                "SELECT cancel_requested, state, worker FROM {p}gdp_finetune_jobs WHERE id = ?", (job_id,)
            ).fetchone()
        return r is None or bool(r[0]) or r[1] != "running" or r[2] != worker

    def finish(
        self,
        job_id: str,
        worker: str,
        state: str,
        *,
        error: str | None = None,
        adapter_path: str | None = None,
    ) -> bool:
        """End a running job held by ``worker``; False when it was not ours any more (lease lost)."""
        if state not in TERMINAL_STATES:
            raise InvalidParameter(f"state must be one of {TERMINAL_STATES}, got state={state!r}")
        with self._tx() as x:
            cur = x(
                "UPDATE {p}gdp_finetune_jobs SET state = ?, error = ?, adapter_path = ?, finished_at = ? "
                "WHERE id = ? AND worker = ? AND state = 'running'",
                (state, error, adapter_path, time.time(), job_id, worker),
            )
            return bool(cur.rowcount)

    def lost_steps(self, job_id: str, worker: str, lost: int) -> None:
        """Add ``lost`` to the job's ``steps_lost`` (a resumed attempt found them released but not
        checkpointed: they stay counted and are not run again)."""
        with self._tx() as x:
            x(
                "UPDATE {p}gdp_finetune_jobs SET steps_lost = steps_lost + ? "
                "WHERE id = ? AND worker = ? AND state = 'running'",
                (int(lost), job_id, worker),
            )

    def requeue(self, job_id: str, worker: str, why: str) -> bool:
        """Put a running job held by ``worker`` back in the queue (it resumes from its checkpoint);
        False when it was not ours any more."""
        with self._tx() as x:
            cur = x(
                "UPDATE {p}gdp_finetune_jobs SET state = 'queued', worker = NULL, error = ? "
                "WHERE id = ? AND worker = ? AND state = 'running' AND cancel_requested = 0",
                (why, job_id, worker),
            )
            return bool(cur.rowcount)

    def fail_abandoned(
        self,
        lease_s: float,
        *,
        charging_grace_s: float = 300.0,
        resume: bool = False,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> list[str]:
        """Deal with the running jobs whose worker is gone: no heartbeat for ``lease_s``, or a worker
        process on this host that no longer exists; and with ``charging`` rows older than
        ``charging_grace_s`` (the server died between the charge and the queueing: failed).

        With ``resume=False`` (the old rule) an interrupted job is marked failed and never re-run.
        With ``resume=True`` it is put back in the queue, to resume from its last checkpoint, unless
        it has been claimed ``max_attempts`` times already (a job that crashes its worker every
        time, e.g. out of memory, must not loop forever) or a cancel was requested: then failed.
        Charges always stay. Returns the ids of the rows changed."""
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise InvalidParameter(f"max_attempts must be an int >= 1, got max_attempts={max_attempts!r}")
        changed: list[str] = []
        with self._tx(immediate=True) as x:
            # the database's clock, as for heartbeats: workers' clocks on other machines may drift
            now = float(x("SELECT {now}", ()).fetchone()[0])
            rows = x(
                "SELECT id, state, worker, heartbeat_at, created_at, attempts, cancel_requested "
                "FROM {p}gdp_finetune_jobs WHERE state IN ('running', 'charging')",
                (),
            ).fetchall()
            for job_id, state, worker, beat, created, attempts, cancel in rows:
                if state == "running":
                    if (beat or 0) < now - lease_s:
                        why = f"worker {worker} sent no heartbeat for {lease_s:g} s (crash or restart)"
                    elif _dead_local_worker(worker):
                        why = f"worker {worker} is gone (crash or restart)"
                    else:
                        continue
                    if resume and not cancel and int(attempts) < max_attempts:
                        x(
                            "UPDATE {p}gdp_finetune_jobs SET state = 'queued', worker = NULL, error = ? "
                            "WHERE id = ? AND state = 'running'",
                            (f"interrupted: {why}; queued again to resume from its last checkpoint", job_id),
                        )
                        changed.append(job_id)
                        continue
                    if resume and not cancel:
                        why += f"; it was tried {attempts} times (max_attempts={max_attempts})"
                elif created < now - charging_grace_s:
                    why = "the server stopped while the job was being charged; it was never queued"
                else:
                    continue
                x(
                    "UPDATE {p}gdp_finetune_jobs SET state = 'failed', error = ?, finished_at = ? "
                    "WHERE id = ? AND state = ?",
                    (f"interrupted: {why}; the job is not re-run and its charge stays", now, job_id, state),
                )
                changed.append(job_id)
        return changed


class _Exec:
    """``x(sql, args)`` on a SQLite connection or a psycopg connection, with the dialect's SQL."""

    def __init__(self, conn: Any, sql: Any) -> None:
        self._conn, self._fix = conn, sql

    def __call__(self, sql: str, args: Sequence[Any]) -> Any:
        return self._conn.execute(self._fix(sql), tuple(args))


def _check_connection() -> Any:
    from psycopg_pool import ConnectionPool

    return ConnectionPool.check_connection
