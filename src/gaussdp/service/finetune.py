"""Fine-tuning over HTTP: perturbed corpora in, DP-LoRA jobs run by workers, private adapters out.

A data owner perturbs a corpus word by word (local DP: the ``/text`` page or ``gaussdp
perturb-text``) and uploads it; a data scientist opens a session with a budget, starts a DP-LoRA job
on the corpus, which is charged to the session *before* it is queued, and downloads the adapter.

Routes (all need an API key; ``release`` scope to change anything, ``read`` to look):

=======================================  ======================================================
``POST /v1/corpora``                      Upload a corpus as the raw body (201). Query: ``name``,
                                          ``format`` (``lines``: one record per line, or
                                          ``jsonl``: a ``text`` field per line), and the local-DP
                                          parameters the client declares: ``mechanism``
                                          (``gaussian`` | ``laplace``), ``sigma`` or ``epsilon``,
                                          ``vocabulary`` (id). At most 20,000,000 bytes (decimal,
                                          20 MB, :data:`MAX_CORPUS_BYTES`), streamed to disk.
``GET /v1/corpora[/{id}]``                The tenant's corpora (metadata: bytes, records, sha256,
                                          local_dp, created).
``DELETE /v1/corpora/{id}``               Delete the corpus and its file (204); a queued job on it
                                          then fails (its charge stays).
``GET /v1/models``                        Base models the operator registered
                                          (``gaussdp serve --model NAME=PATH``); names only.
``POST /v1/finetune-jobs``                Plan, charge the session, queue (201).
``GET /v1/finetune-jobs[/{id}]``          The tenant's jobs: state, step, steps, epsilon_so_far,
                                          loss (always null: computed without noise, it is not
                                          released), error.
``GET /v1/finetune-jobs/{id}/events``     Server-sent events (``text/event-stream``): the job as
                                          JSON on every change; ``event: end`` on a final state.
``POST /v1/finetune-jobs/{id}/cancel``    Cancel (202): a queued job at once, a running one at its
                                          next step. A cancelled or failed job keeps its charge.
``GET /v1/finetune-jobs/{id}/adapter``    Zip of the peft adapter directory (``adapter_config.json``,
                                          ``adapter_model.safetensors``, ``README.md`` model card,
                                          ``gaussdp_privacy.json``) once succeeded; 409 before.
=======================================  ======================================================

Status codes (from the service's one table, :mod:`gaussdp.service.errors`): 401/403/429 as every
route; 404 a corpus, job or session this tenant does not own: another tenant's are indistinguishable
from missing ones (same status, same body); 409 ``budget_exhausted`` (the session cannot pay for the
job: nothing charged, nothing queued), or ``job_not_succeeded`` (adapter of a job that has not
succeeded); 413 a corpus over 20,000,000 bytes: refused before a byte is read when
``Content-Length`` says so, and as soon as the count passes the limit for a chunked body (what was
written is deleted); 422 invalid parameters, a corpus that is not UTF-8 / not JSONL / empty, a JSONL
line nested deeper than 32 levels (``json_too_deep``), or that was declared perturbed by gaussdp's
mechanism but holds a token that is not a vocabulary word (the first such line is named, the word
is never echoed), a model that is not registered, a delta other than the session's, a plan that
does not fit the request's limits, or a corpus whose check needs more than the request's CPU limit
(``work_limit_exceeded``); 429 ``quota_exceeded``: the tenant's stored corpora (count or bytes,
:class:`~gaussdp.service.quotas.Quotas`) or its unfinished jobs are at their quota (checked before
the body is read when it can be, and again in the transaction that stores the row: nothing is
stored, nothing charged); 503 the database cannot be reached.

A corpus is checked, hashed and written in blocks of 1 MiB in worker threads, never on the event
loop, all blocks together under the request's CPU limit (``cpu_limit_s``), one block at a time per
worker process (:class:`~gaussdp.service.deps.HeavyLane`: concurrent uploads take turns).

Who pays: a job is charged to a **session** the request names (``session_id``; opened with
``POST /v1/sessions``, whose budget and accountant apply, as for every release), with the plan's
whole event (``plan.event``: every noisy step of the run) and the job id as idempotency key, before
the job is queued. The job's delta is the session's (a request may repeat it, not change it). The
job row is written in state ``charging`` first and becomes ``queued`` only after the charge is
committed; a refused charge deletes it. Training never runs in a request handler: see
:mod:`gaussdp.service.worker`; the queue and its claim protocol: :mod:`gaussdp.service.jobs`.

Vocabulary check: a corpus declared perturbed (``mechanism`` given) must hold only words of this
server's ``/text`` vocabulary (lower-cased tokens under :mod:`gaussdp.text.tokenize`'s rule):
perturbation can output nothing else, so anything else is raw text uploaded by mistake. Its id is
``sha256`` of the words joined by newlines, first 16 hex digits (:func:`vocabulary_id`); a declared
``vocabulary`` must match it. The server cannot verify the noise itself: ``local_dp`` records what
the client declares. A corpus declared without ``mechanism`` is taken as raw (central DP only).
"""

# No "from __future__ import annotations": FastAPI resolves the local Annotated aliases at runtime.

import functools
import hashlib
import json
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path as FsPath
from typing import Annotated, Any, Literal

import anyio
from fastapi import APIRouter, Depends, HTTPException, Path, Query, Request
from fastapi.responses import Response, StreamingResponse

from gaussdp._worklimit import no_cpu_limit
from gaussdp.accounting.events import event_json
from gaussdp.budget import UnknownPrincipal
from gaussdp.errors import PrivacyError, WorkLimitExceeded
from gaussdp.service.auth import Caller
from gaussdp.service.corpus_check import CorpusChecker
from gaussdp.service.deps import CPUBudget, Service
from gaussdp.service.errors import Refusal
from gaussdp.service.finetune_models import (
    ID_PATTERN,
    NAME_PATTERN,
    CorpusOut,
    JobIn,
    JobOut,
    LocalDP,
    ModelOut,
)
from gaussdp.service.jobs import TERMINAL_STATES, CorpusRow, JobRow, JobStore
from gaussdp.service.responses import responses as error_responses
from gaussdp.service.worker import adapter_dir, corpus_path, finetune_config
from gaussdp.text.tokenize import MAX_INPUT_BYTES, words
from gaussdp.text.vocabulary import vocabulary_id

MAX_VALIDATION_RECORDS = 2048  # gaussdp.finetune.train's (importing it here would need torch)

__all__ = ["CORPORA_PATH", "MAX_CORPUS_BYTES", "make_finetune_router", "vocabulary_id"]

LIST_DEFAULT_LIMIT = 100
# A list answer is bounded whatever a tenant has stored: the newest ``limit`` rows.
ListLimit = Annotated[int, Query(ge=1, le=1000, description="How many of the most recent to list.")]
MAX_CORPUS_BYTES = MAX_INPUT_BYTES  # 20,000,000 bytes (decimal 20 MB), as gaussdp.text's input limit
CORPORA_PATH = "/v1/corpora"
SSE_POLL_S = 0.5
_BLOCK_BYTES = 1 << 20  # a corpus is checked, hashed and written in blocks of this size, in a thread
SSE_MAX_S = 3600.0  # a stream ends after an hour; the client reconnects

CorpusId = Annotated[str, Path(pattern=ID_PATTERN, description="The corpus's id.")]
JobId = Annotated[str, Path(pattern=ID_PATTERN, description="The job's id.")]


# -- the router --------------------------------------------------------------------------------------
def make_finetune_router(
    svc: Service,
    *,
    jobs: JobStore,
    data_dir: str | os.PathLike[str],
    model_paths: Mapping[str, str],
    vocabulary: Callable[[], Any] | None = None,
) -> APIRouter:
    """The fine-tuning routes (module docstring), over ``svc``'s ledger and ``jobs`` (the same database).

    ``svc`` gives the key checks, the per-request CPU limit (the sync handlers that compute run
    under it, and a corpus upload's check, hashing and writing run in worker threads under it, all
    blocks together, taking turns in ``svc.lane``) and the tenants' quotas on stored corpora and
    unfinished jobs.

    Args:
        jobs: the job store (in the ledger's database).
        data_dir: where corpora and adapters are kept.
        model_paths: base models jobs may name: name -> local directory.
        vocabulary: loader of the ``/text`` vocabulary (default: :mod:`gaussdp.text.web`'s).
    """
    ledger, bounded, cpu_limit_s = svc.ledger, svc.bounded, svc.cpu_limit_s
    quotas, lane = svc.quotas, svc.lane
    import gaussdp.finetune  # noqa: F401  (imported now, not under a request's CPU limit)

    if model_paths:
        import transformers  # noqa: F401  (check_model reads model configs with it)

    root = FsPath(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    Who = Annotated[Caller, Depends(svc.reader)]
    Releaser = Annotated[Caller, Depends(svc.releaser)]
    cache: dict[str, Any] = {}

    def vocab() -> tuple[frozenset[str], frozenset[str], str]:
        """(words, words that are one token under the rule, id), loaded once."""
        if "v" not in cache:
            if vocabulary is not None:
                v = vocabulary()
            else:
                from gaussdp.text.web import _default_vocabulary

                v = _default_vocabulary()
            all_words = frozenset(v.words)
            cache["v"] = (all_words, frozenset(w for w in all_words if words(w) == [w]), vocabulary_id(v))
            cache["vocabulary"] = v
        return cache["v"]

    def per_word(mechanism: str, sigma: float | None, epsilon: float | None) -> dict[str, Any] | None:
        """The declared mechanism's per-word guarantee on this server's vocabulary, labelled: a
        word vs its typical nearest neighbour, and vs any word (the vocabulary's diameter)."""
        import math

        from gaussdp.text.mechanisms import make_mechanism

        vocab()
        kwargs: dict[str, Any] = {"sigma": sigma} if sigma is not None else {"epsilon": epsilon}
        if mechanism == "laplace" and epsilon is None:
            return None  # the Laplace (metric DP) mechanism is described by its epsilon per unit distance
        if mechanism == "laplace":
            kwargs = {"epsilon": epsilon}
        try:
            report = make_mechanism(mechanism, cache["vocabulary"], **kwargs).report()
        except (PrivacyError, TypeError, ValueError):
            return None
        out: dict[str, Any] = {}
        for label, key in (("nearest_neighbour", "nearest_neighbour"), ("worst_case", "vocabulary_diameter")):
            g = report[key]
            if not all(
                isinstance(g.get(k), int | float) and math.isfinite(g[k]) for k in ("distance", "epsilon")
            ):
                return None
            out[label] = {
                "distance": float(g["distance"]),
                "epsilon": float(g["epsilon"]),
                "delta": g["delta"],
            }
        return out

    api = APIRouter(tags=["fine-tuning"])

    def missing(what: str) -> HTTPException:
        # the same body for another tenant's id and a missing one: nothing tells them apart
        return HTTPException(404, f"no such {what} for this API key")

    def owned_job(tenant: str, job_id: str) -> JobRow:
        row = jobs.job(tenant, job_id)
        if row is None:
            raise missing("fine-tuning job")
        return row

    # -- corpora -------------------------------------------------------------------------------------
    @api.post(
        CORPORA_PATH,
        status_code=201,
        response_model=CorpusOut,
        responses=error_responses(401, 403, 413, 422, 429, 503),
        openapi_extra={
            "requestBody": {
                "required": True,
                "description": "The corpus: UTF-8, one record per line (format=lines) or JSON objects "
                "with a 'text' field (format=jsonl); at most 20,000,000 bytes.",
                "content": {
                    "text/plain": {"schema": {"type": "string"}},
                    "application/x-ndjson": {"schema": {"type": "string"}},
                },
            }
        },
    )
    async def upload_corpus(
        request: Request,
        who: Releaser,
        name: Annotated[str, Query(pattern=NAME_PATTERN, description="A name for the corpus.")] = "corpus",
        format: Annotated[Literal["lines", "jsonl"], Query(description="lines or jsonl.")] = "lines",
        mechanism: Annotated[
            Literal["gaussian", "laplace"] | None,
            Query(description="The local-DP word mechanism it was perturbed with (none: raw text)."),
        ] = None,
        sigma: Annotated[float | None, Query(gt=0, le=1e6, description="Gaussian sigma declared.")] = None,
        epsilon: Annotated[float | None, Query(gt=0, le=1e4, description="Per-word epsilon.")] = None,
        vocabulary: Annotated[
            str | None, Query(pattern=r"^[0-9a-f]{16}$", description="Id of the vocabulary used.")
        ] = None,
    ) -> CorpusOut:
        """Upload a corpus, streamed to disk (never held in memory); see the module docstring."""
        local_dp: dict[str, Any] | None = None
        words_all: frozenset[str] = frozenset()
        words_clean: frozenset[str] = frozenset()
        if mechanism is None:
            if sigma is not None or epsilon is not None or vocabulary is not None:
                raise HTTPException(422, "sigma, epsilon and vocabulary describe a mechanism: give mechanism")
        else:
            if sigma is None and epsilon is None:
                raise HTTPException(422, f"mechanism={mechanism!r} needs its sigma or epsilon")
            words_all, words_clean, vid = await anyio.to_thread.run_sync(vocab)
            if vocabulary is not None and vocabulary != vid:
                raise HTTPException(
                    422,
                    f"vocabulary={vocabulary!r} is not this server's vocabulary ({vid})",
                )
            guarantee = await anyio.to_thread.run_sync(per_word, mechanism, sigma, epsilon)
            local_dp = {"mechanism": mechanism, "sigma": sigma, "epsilon": epsilon, "vocabulary": vid}
            if guarantee is not None:
                local_dp["epsilon_per_word"] = guarantee
        count, stored = await anyio.to_thread.run_sync(jobs.corpus_usage, who.tenant)
        room = quotas.max_corpus_bytes_per_tenant - stored
        declared = request.headers.get("content-length")
        if count >= quotas.max_corpora_per_tenant or (
            declared and declared.isdigit() and int(declared) > room
        ):
            raise Refusal(  # before a byte of the body is read
                "quota_exceeded",
                f"this tenant stores {count} corpora of {stored} bytes; its quotas are "
                f"max_corpora_per_tenant={quotas.max_corpora_per_tenant} and "
                f"max_corpus_bytes_per_tenant={quotas.max_corpus_bytes_per_tenant}: delete some first",
            )
        corpus_id = "corpus_" + secrets.token_urlsafe(12)
        final = corpus_path(root, who.tenant, corpus_id, format)
        final.parent.mkdir(parents=True, exist_ok=True)
        part = final.with_name(final.name + ".part")
        checker = CorpusChecker(format, words_all if mechanism else None, words_clean)
        digest = hashlib.sha256()
        work = CPUBudget(cpu_limit_s)  # the check, hashing and writing of every block together
        size = 0
        try:
            with open(part, "wb") as fh:

                def consume(block: bytes) -> None:
                    digest.update(block)
                    checker.feed(block)
                    fh.write(block)

                pending: list[bytes] = []
                held = 0
                async for chunk in request.stream():
                    if not chunk:
                        continue
                    size += len(chunk)
                    if size > MAX_CORPUS_BYTES:  # the middleware stops it too; this route's own check
                        raise HTTPException(413, _too_large())
                    if size > room:
                        raise Refusal(
                            "quota_exceeded",
                            "this corpus would take the tenant's corpora past its quota "
                            f"(max_corpus_bytes_per_tenant={quotas.max_corpus_bytes_per_tenant}, {stored} "
                            "stored); nothing was stored",
                        )
                    pending.append(chunk)
                    held += len(chunk)
                    if held >= _BLOCK_BYTES:  # CPU work off the event loop, a block at a time
                        await lane.run(work, consume, b"".join(pending))
                        pending, held = [], 0
                await lane.run(work, consume, b"".join(pending))
                await lane.run(work, checker.finish)
                fh.flush()
                await anyio.to_thread.run_sync(os.fsync, fh.fileno())
            os.replace(part, final)
            row = CorpusRow(
                corpus_id, who.tenant, name, format, size, checker.records, digest.hexdigest(),
                local_dp, str(final), time.time(),
            )  # fmt: skip
            await anyio.to_thread.run_sync(
                functools.partial(
                    jobs.add_corpus,
                    row,
                    max_count=quotas.max_corpora_per_tenant,
                    max_bytes=quotas.max_corpus_bytes_per_tenant,
                )
            )
        except BaseException:
            part.unlink(missing_ok=True)
            final.unlink(missing_ok=True)
            raise
        return _corpus_out(row)

    @api.get(CORPORA_PATH, response_model=list[CorpusOut], responses=error_responses(401, 403, 429, 503))
    def list_corpora(who: Who, limit: ListLimit = LIST_DEFAULT_LIMIT) -> list[CorpusOut]:
        """This tenant's most recent corpora (``limit``, at most 1000), oldest first."""
        return [_corpus_out(c) for c in jobs.corpora(who.tenant, limit)]

    @api.get(
        CORPORA_PATH + "/{corpus_id}",
        response_model=CorpusOut,
        responses=error_responses(401, 403, 404, 422, 429, 503),
    )
    def get_corpus(corpus_id: CorpusId, who: Who) -> CorpusOut:
        """One corpus's metadata."""
        c = jobs.corpus(who.tenant, corpus_id)
        if c is None:
            raise missing("corpus")
        return _corpus_out(c)

    @api.delete(
        CORPORA_PATH + "/{corpus_id}",
        status_code=204,
        response_class=Response,
        responses=error_responses(401, 403, 404, 422, 429, 503),
    )
    def delete_corpus(corpus_id: CorpusId, who: Releaser) -> Response:
        """Delete a corpus and its file."""
        c = jobs.delete_corpus(who.tenant, corpus_id)
        if c is None:
            raise missing("corpus")
        FsPath(c.path).unlink(missing_ok=True)
        return Response(status_code=204)

    # -- models --------------------------------------------------------------------------------------
    @api.get("/v1/models", response_model=list[ModelOut], responses=error_responses(401, 403, 429))
    def list_models(who: Who) -> list[ModelOut]:
        """Base models registered by the operator (``gaussdp serve --model NAME=PATH``)."""
        return [ModelOut(name=n) for n in sorted(model_paths)]

    # -- jobs ----------------------------------------------------------------------------------------
    @api.post(
        "/v1/finetune-jobs",
        status_code=201,
        response_model=JobOut,
        responses=error_responses(400, 401, 403, 404, 409, 413, 422, 429, 503),
    )
    @bounded
    def create_job(body: JobIn, who: Releaser) -> JobOut:
        """Plan the job, charge its whole event to the session, then queue it (module docstring)."""
        from gaussdp.finetune import check_model, plan_finetune

        corpus = jobs.corpus(who.tenant, body.corpus_id)
        if corpus is None:
            raise missing("corpus")
        if body.validation_corpus_id is not None:
            val = jobs.corpus(who.tenant, body.validation_corpus_id)
            if val is None:
                raise missing("corpus")
            if val.records > MAX_VALIDATION_RECORDS:
                raise HTTPException(
                    422,
                    f"validation_corpus_id: the corpus has {val.records} records, more than "
                    f"{MAX_VALIDATION_RECORDS}",
                )
        principal = f"{who.tenant}/{body.session_id}"
        try:
            budget = ledger.budget(principal)
        except UnknownPrincipal:
            raise missing("session") from None
        if body.model not in model_paths:
            raise HTTPException(422, f"model: no base model named {body.model!r} here (GET /v1/models)")
        if body.delta is not None and body.delta != budget.delta:
            raise HTTPException(
                422, f"delta={body.delta!r} differs from the session's delta={budget.delta!r}; omit it"
            )
        session_accountant = ledger.accountant(principal)
        if session_accountant not in ("pld", "rdp"):
            raise HTTPException(
                422,
                f"session_id: the session composes with the {session_accountant!r} accountant; a "
                "fine-tuning job needs a session with accountant 'pld' or 'rdp'",
            )
        config = body.model_dump()
        config["delta"] = budget.delta
        config["accountant"] = session_accountant  # the plan's epsilon is the ledger's
        del config["corpus_id"], config["model"], config["session_id"]
        ft_config = finetune_config(config)
        plan = plan_finetune(ft_config, n_records=corpus.records)
        check_model(model_paths[body.model], ft_config)  # what training would refuse: refused uncharged
        event = json.loads(event_json(plan.event))
        job_id = "job_" + secrets.token_urlsafe(12)
        row = JobRow(
            job_id, who.tenant, corpus.id, body.model, principal, config, event, float(plan.epsilon),
            float(plan.delta), None, "charging", 0, int(plan.steps), 0.0, None, None, False, None, 0,
            None, time.time(), None, None, None,
        )  # fmt: skip
        jobs.add_job(row, max_active=quotas.max_jobs_per_tenant)  # QuotaExceeded: nothing stored or charged
        try:
            receipt = ledger.charge(principal, plan.event, job_id, key_id=who.key_id)
        except (PrivacyError, WorkLimitExceeded):
            # refused before anything was written (BudgetExhausted, LedgerContention, the CPU limit):
            # nothing charged, nothing queued
            with no_cpu_limit():
                jobs.drop_uncharged(job_id)
            raise
        # Any other failure (the database lost mid-charge: charged or not, unknown) leaves the row
        # 'charging': never claimed, marked failed later by fail_abandoned.
        with no_cpu_limit():  # charged: queue it whatever the limit says now
            jobs.charged(job_id, receipt.charge_id)
            return _job_out(jobs.job(who.tenant, job_id) or row, plan)

    @api.get("/v1/finetune-jobs", response_model=list[JobOut], responses=error_responses(401, 403, 429, 503))
    def list_jobs(who: Who, limit: ListLimit = LIST_DEFAULT_LIMIT) -> list[JobOut]:
        """This tenant's most recent jobs (``limit``, at most 1000), oldest first."""
        return [_job_out(j) for j in jobs.jobs(who.tenant, limit)]

    @api.get(
        "/v1/finetune-jobs/{job_id}",
        response_model=JobOut,
        responses=error_responses(401, 403, 404, 422, 429, 503),
    )
    def get_job(job_id: JobId, who: Who) -> JobOut:
        """A job's state and progress."""
        return _job_out(owned_job(who.tenant, job_id))

    @api.post(
        "/v1/finetune-jobs/{job_id}/cancel",
        status_code=202,
        response_model=JobOut,
        responses=error_responses(401, 403, 404, 422, 429, 503),
    )
    def cancel_job(job_id: JobId, who: Releaser) -> JobOut:
        """Cancel a job (queued: now; running: at its next step; final: unchanged). The charge stays."""
        owned_job(who.tenant, job_id)
        row = jobs.request_cancel(who.tenant, job_id)
        if row is None:
            raise missing("fine-tuning job")
        return _job_out(row)

    @api.get(
        "/v1/finetune-jobs/{job_id}/events",
        response_class=StreamingResponse,
        responses={
            200: {
                "description": "Server-sent events: 'progress' with the job as JSON on each change, "
                "'end' with its final state.",
                "content": {"text/event-stream": {"schema": {"type": "string"}}},
            },
            **error_responses(401, 403, 404, 422, 429, 503),
        },
    )
    async def job_events(job_id: JobId, who: Who) -> StreamingResponse:
        """Progress as server-sent events, until the job ends (or an hour passes: reconnect)."""
        first = await anyio.to_thread.run_sync(jobs.job, who.tenant, job_id)
        if first is None:
            raise missing("fine-tuning job")
        tenant = who.tenant

        async def stream() -> AsyncIterator[str]:
            last, sent_at, started = "", time.monotonic(), time.monotonic()
            row: JobRow | None = first
            while row is not None and time.monotonic() - started < SSE_MAX_S:
                data = _job_out(row).model_dump_json()
                final = row.state in TERMINAL_STATES
                if data != last:
                    yield f"event: {'end' if final else 'progress'}\ndata: {data}\n\n"
                    last, sent_at = data, time.monotonic()
                elif time.monotonic() - sent_at > 15:
                    yield ": keep-alive\n\n"
                    sent_at = time.monotonic()
                if final:
                    return
                await anyio.sleep(SSE_POLL_S)
                row = await anyio.to_thread.run_sync(jobs.job, tenant, job_id)

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )

    @api.get(
        "/v1/finetune-jobs/{job_id}/adapter",
        response_class=Response,
        responses={
            200: {"description": "The adapter directory, zipped.", "content": {"application/zip": {}}},
            **error_responses(401, 403, 404, 409, 422, 429, 503),
        },
    )
    def download_adapter(job_id: JobId, who: Who) -> Response:
        """The zipped peft adapter of a succeeded job (409 ``job_not_succeeded`` otherwise)."""
        from gaussdp.finetune import adapter_zip

        row = owned_job(who.tenant, job_id)
        path = row.adapter_path or str(adapter_dir(root, who.tenant, job_id))
        if row.state != "succeeded" or not FsPath(path).is_dir():
            raise Refusal(
                "job_not_succeeded", f"the job is {row.state}: an adapter exists only once it has succeeded"
            )
        return Response(
            adapter_zip(path),
            media_type="application/zip",
            headers={"Content-Disposition": f'attachment; filename="{job_id}-adapter.zip"'},
        )

    return api


def _too_large() -> str:
    return (
        f"request body too large: a corpus may hold at most {MAX_CORPUS_BYTES} bytes "
        "(20,000,000, decimal 20 MB); split it"
    )


def _corpus_out(c: CorpusRow) -> CorpusOut:
    return CorpusOut(
        id=c.id,
        name=c.name,
        format=c.format,  # type: ignore[arg-type]
        bytes=c.bytes,
        records=c.records,
        sha256=c.sha256,
        local_dp=None if c.local_dp is None else LocalDP(**c.local_dp),
        created_at=c.created_at,
    )


def _job_out(j: JobRow, plan: Any = None) -> JobOut:
    step_event = j.event
    while isinstance(step_event.get("event"), dict):  # a self-composed event: the step inside
        step_event = step_event["event"]
    nm = step_event.get("noise_multiplier") if plan is None else getattr(plan, "noise_multiplier", None)
    rate = step_event.get("sample_rate") if plan is None else getattr(plan, "sample_rate", None)
    return JobOut(
        id=j.id,
        state=j.state,  # type: ignore[arg-type]
        corpus_id=j.corpus_id,
        model=j.model,
        session_id=j.principal.partition("/")[2],
        step=j.step,
        steps=j.steps,
        epsilon=j.epsilon,
        delta=j.delta,
        epsilon_so_far=j.epsilon_so_far,
        loss=j.loss,
        error=j.error,
        validation_loss=j.validation_loss,
        attempts=j.attempts,
        steps_lost=j.steps_lost,
        noise_multiplier=None if nm is None else float(nm),
        sample_rate=None if rate is None else float(rate),
        charge_id=j.charge_id,
        cancel_requested=j.cancel_requested,
        created_at=j.created_at,
        started_at=j.started_at,
        finished_at=j.finished_at,
    )
