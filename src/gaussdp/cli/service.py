"""Service commands: ``gaussdp serve``, ``gaussdp worker``, and the "privacy ledger and service"
section of ``gaussdp demo`` (keys, tenants and the ledger's table: :mod:`gaussdp.cli.ledger_admin`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import typer

from gaussdp.cli.ledger_admin import _DB_HELP, DEFAULT_DB, _ledger_table


def register(app: typer.Typer) -> None:
    app.command()(serve)
    app.command()(worker)


def _missing_extra() -> None:
    typer.echo("The service needs the 'service' extra: pip install 'gaussdp[service]'", err=True)
    raise typer.Exit(2)


def serve(
    db: str = typer.Option(DEFAULT_DB, "--db", envvar="GAUSSDP_DB", help=_DB_HELP),
    host: str = typer.Option("127.0.0.1", envvar="GAUSSDP_HOST", help="Interface to listen on."),
    port: int = typer.Option(8000, envvar="GAUSSDP_PORT", help="TCP port."),
    workers: int = typer.Option(1, "--workers", envvar="GAUSSDP_WORKERS", min=1, help="Worker processes."),
    max_body_bytes: int = typer.Option(
        8 * 1024 * 1024, envvar="GAUSSDP_MAX_BODY_BYTES", help="Larger request bodies get 413."
    ),
    cpu_limit_s: float = typer.Option(
        1.0,
        "--cpu-limit-s",
        envvar="GAUSSDP_CPU_LIMIT_S",
        help="CPU seconds of numeric work per request; past it 422, nothing charged.",
    ),
    rate_limit_per_s: float | None = typer.Option(
        None,
        envvar="GAUSSDP_RATE_LIMIT_PER_S",
        help="Requests/s per API key, shared by all workers (memory-mapped buckets); past it 429.",
    ),
    rate_limit_burst: int | None = typer.Option(None, envvar="GAUSSDP_RATE_LIMIT_BURST", help="Bucket size."),
    text: str = typer.Option("keyed", envvar="GAUSSDP_TEXT", help="/text routes: keyed, public or off."),
    text_vocab: Path | None = typer.Option(
        None,
        "--text-vocab",
        envvar="GAUSSDP_TEXT_VOCAB",
        help="Vocabulary of the /text page and of perturbed corpora (a .npz from `gaussdp "
        "build-vocab`, or word2vec text/binary); default: the shipped demo vocabulary.",
    ),
    metrics: str = typer.Option(
        "keyed", envvar="GAUSSDP_METRICS", help="/metrics: keyed (admin), public or off."
    ),
    ssl_certfile: Path | None = typer.Option(
        None, envvar="GAUSSDP_SSL_CERTFILE", help="TLS certificate (PEM)."
    ),
    ssl_keyfile: Path | None = typer.Option(
        None, envvar="GAUSSDP_SSL_KEYFILE", help="TLS private key (PEM)."
    ),
    model: list[str] = typer.Option(
        [],
        "--model",
        help="NAME=PATH: a Hugging Face causal LM in a local directory (with its tokenizer, if saved "
        "there), loaded at start-up and served by /v1/sessions/{id}/generate (POST and WebSocket).",
    ),
    dtype: str = typer.Option(
        "auto",
        "--dtype",
        envvar="GAUSSDP_MODEL_DTYPE",
        click_type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
        help="dtype of the --model weights: auto keeps what the checkpoint holds.",
    ),
    device: str = typer.Option(
        "auto",
        "--device",
        envvar="GAUSSDP_MODEL_DEVICE",
        click_type=click.Choice(["auto", "cpu", "cuda"]),
        help="Where the --model weights run: auto is CUDA when present, else the CPU.",
    ),
    adapter: list[str] = typer.Option(
        [],
        "--adapter",
        help="NAME=PATH[#MODULE]: a peft LoRA adapter directory served by /lora-delta under NAME "
        "(one module's A and B; #MODULE picks it when the adapter has several).",
    ),
    data_dir: Path | None = typer.Option(
        None,
        "--data-dir",
        envvar="GAUSSDP_DATA_DIR",
        help="Directory for uploaded corpora and trained adapters; given, the fine-tuning routes are on.",
    ),
    finetune_workers: int = typer.Option(
        1,
        "--finetune-workers",
        envvar="GAUSSDP_FINETUNE_WORKERS",
        min=0,
        help="Local fine-tuning worker processes started with the server (with --data-dir); 0: none "
        "(run `gaussdp worker` elsewhere).",
    ),
    lease_s: float = typer.Option(
        60.0,
        "--finetune-lease-s",
        envvar="GAUSSDP_FINETUNE_LEASE_S",
        help="A running job without a worker heartbeat this long is interrupted (see --on-interrupt).",
    ),
    on_interrupt: str = typer.Option(
        "resume",
        "--on-interrupt",
        envvar="GAUSSDP_FINETUNE_ON_INTERRUPT",
        help="A job interrupted by a crash or stop: 'resume' (queued again, resumed from its last "
        "checkpoint, no released step run twice) or 'fail' (failed, never re-run). The charge stays.",
    ),
    checkpoint_every: int = typer.Option(
        10,
        "--checkpoint-every",
        envvar="GAUSSDP_FINETUNE_CHECKPOINT_EVERY",
        min=1,
        help="Steps between a job's checkpoints under --data-dir (1: a crash loses no step).",
    ),
    max_attempts: int = typer.Option(
        3, "--max-attempts", min=1, help="Workers that may take one job before an interruption fails it."
    ),
    max_streams: int = typer.Option(
        32, envvar="GAUSSDP_MAX_STREAMS", min=0, help="Generations (streams or POSTs) at once, per worker."
    ),
    max_streams_per_tenant: int = typer.Option(
        8,
        envvar="GAUSSDP_MAX_STREAMS_PER_TENANT",
        min=0,
        help="A tenant's share of --max-streams, whatever its streams cost in privacy; past it 429.",
    ),
    max_stream_s: float = typer.Option(
        300.0, envvar="GAUSSDP_MAX_STREAM_S", help="A stream ends (time_limit) after this many seconds."
    ),
    stream_idle_s: float = typer.Option(
        60.0,
        envvar="GAUSSDP_STREAM_IDLE_S",
        help="A stream ends (idle) this long after its last token, whatever the client sends.",
    ),
    ckks_memory_bytes: int = typer.Option(
        512 << 20,
        envvar="GAUSSDP_CKKS_MEMORY_BYTES",
        min=0,
        help="Memory for loaded CKKS contexts per worker, all tenants (about 14-37 MiB each).",
    ),
    ckks_tenant_memory_bytes: int = typer.Option(
        128 << 20,
        envvar="GAUSSDP_CKKS_TENANT_MEMORY_BYTES",
        min=0,
        help="One tenant's share of --ckks-memory-bytes; its uploads evict only its own contexts.",
    ),
    max_corpora_per_tenant: int = typer.Option(
        100, envvar="GAUSSDP_MAX_CORPORA_PER_TENANT", min=0, help="Corpora a tenant may store (429 past it)."
    ),
    max_corpus_bytes_per_tenant: int = typer.Option(
        2_000_000_000,
        envvar="GAUSSDP_MAX_CORPUS_BYTES_PER_TENANT",
        min=0,
        help="Bytes of a tenant's stored corpora together (429 past it).",
    ),
    max_jobs_per_tenant: int = typer.Option(
        4,
        envvar="GAUSSDP_MAX_JOBS_PER_TENANT",
        min=0,
        help="A tenant's fine-tuning jobs not yet finished (429 past it).",
    ),
) -> None:
    """Run the gaussdp HTTP service (OpenAPI docs at /docs). Every option also reads GAUSSDP_*.

    Models and adapters are read once, at start-up, from local directories (by every worker); no
    request can name a path. WebSocket messages are at most 128 KiB, uncompressed; the limits per
    tenant (generation slots, CKKS memory, stored corpora, jobs) answer 429 past them.
    """
    import os

    try:
        from gaussdp.budget import Ledger
        from gaussdp.service.config import (
            ADAPTERS_ENV,
            DEVICE_ENV,
            DTYPE_ENV,
            ENV,
            MODELS_ENV,
            settings_from_env,
        )
        from gaussdp.service.server import serve_factory
    except ImportError:
        _missing_extra()
    if (ssl_certfile is None) != (ssl_keyfile is None):
        typer.echo("error: TLS needs both --ssl-certfile and --ssl-keyfile", err=True)
        raise typer.Exit(2)
    chosen = {
        "ledger_url": db,
        "cpu_limit_s": cpu_limit_s,
        "max_body_bytes": max_body_bytes,
        "rate_limit_per_s": rate_limit_per_s,
        "rate_limit_burst": rate_limit_burst,
        "text": text,
        "metrics": metrics,
        "data_dir": None if data_dir is None else str(data_dir.resolve()),
        "max_streams": max_streams,
        "max_streams_per_tenant": max_streams_per_tenant,
        "max_stream_s": max_stream_s,
        "stream_idle_s": stream_idle_s,
        "ckks_memory_bytes": ckks_memory_bytes,
        "ckks_tenant_memory_bytes": ckks_tenant_memory_bytes,
        "max_corpora_per_tenant": max_corpora_per_tenant,
        "max_corpus_bytes_per_tenant": max_corpus_bytes_per_tenant,
        "max_jobs_per_tenant": max_jobs_per_tenant,
    }
    shared_dir = None
    if rate_limit_per_s is not None:  # one bucket file per run, shared by this run's workers
        import tempfile

        shared_dir = tempfile.mkdtemp(prefix="gaussdp-serve-")
        chosen["rate_limit_file"] = os.path.join(shared_dir, "rate-limits")
    if text_vocab is not None:  # checked (and its id shown) before listening; workers read the env
        from gaussdp.text.vocabulary import Vocabulary, vocabulary_id

        try:
            vocabulary = Vocabulary.load(str(text_vocab))
        except (OSError, ValueError) as exc:
            typer.echo(f"error: --text-vocab {str(text_vocab)!r}: {exc}", err=True)
            raise typer.Exit(2) from None
        typer.echo(f"text vocabulary: {len(vocabulary.words)} words, id {vocabulary_id(vocabulary)}")
        os.environ["GAUSSDP_TEXT_VOCAB"] = str(text_vocab.resolve())
    else:
        os.environ.pop("GAUSSDP_TEXT_VOCAB", None)
    for name, value in chosen.items():  # the workers build their app from the environment
        if value is None:
            os.environ.pop(ENV[name], None)
        else:
            os.environ[ENV[name]] = str(value)
    models, adapters = _load_models_and_adapters(model, adapter, dtype, device)  # fail before listening
    for name, spec in adapters.items():
        a, b, scaling = spec
        typer.echo(
            f"adapter {name}: LoRA rank {a.shape[0]}, {a.shape[1]} -> {b.shape[0]}, scaling {scaling:g}"
        )
    for name in models:
        first = next(models[name].parameters(), None)
        where = "" if first is None else f", {str(first.dtype).removeprefix('torch.')} on {first.device}"
        typer.echo(f"model {name}: {type(models[name]).__name__}{where}")
    os.environ[DTYPE_ENV], os.environ[DEVICE_ENV] = dtype, device
    del models, adapters  # each worker loads its own copy (gaussdp.service.config.app_from_env)
    for var, specs in ((MODELS_ENV, model), (ADAPTERS_ENV, adapter)):
        if specs:
            os.environ[var] = "\n".join(specs)
        else:
            os.environ.pop(var, None)
    try:
        settings = settings_from_env()
        from gaussdp.service.app import create_app

        checked = {k: v for k, v in settings.items() if k not in ("ledger_url", "data_dir")}
        create_app(ledger=Ledger("memory://"), **checked)  # fine-tuning is checked by its JobStore
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    with Ledger(db) as ledger:  # the schema is migrated once here, before any worker starts
        if not ledger.store.list_api_keys():
            typer.echo(f"no API keys yet: create one with  gaussdp keys create TENANT --db {db}", err=True)
    job_workers: list[Any] = []
    if data_dir is not None:
        if on_interrupt not in ("resume", "fail"):
            raise typer.BadParameter(f"--on-interrupt must be 'resume' or 'fail', got {on_interrupt!r}")
        job_workers = _start_job_workers(
            db, data_dir, model, finetune_workers, lease_s, on_interrupt, checkpoint_every, max_attempts
        )
    scheme = "https" if ssl_certfile else "http"
    typer.echo(
        f"gaussdp service on {scheme}://{host}:{port} with {workers} worker(s)  "
        f"(docs: {scheme}://{host}:{port}/docs, ledger: {db})"
    )
    try:
        serve_factory(
            "gaussdp.service.config:app_from_env",
            host=host,
            port=port,
            workers=workers,
            ssl_certfile=None if ssl_certfile is None else str(ssl_certfile),
            ssl_keyfile=None if ssl_keyfile is None else str(ssl_keyfile),
        )
    finally:
        for proc in job_workers:
            proc.terminate()
        for proc in job_workers:
            try:
                proc.wait(timeout=10)
            except Exception:
                proc.kill()
        if shared_dir is not None:
            import shutil

            shutil.rmtree(shared_dir, ignore_errors=True)


def _start_job_workers(
    db: str,
    data_dir: Path,
    model: list[str],
    n: int,
    lease_s: float,
    on_interrupt: str = "resume",
    checkpoint_every: int = 10,
    max_attempts: int = 3,
) -> list[Any]:
    """Queue again (or fail) jobs interrupted by a crash, then start ``n`` local ``gaussdp worker``s."""
    import subprocess
    import sys

    from gaussdp.service.jobs import JobStore

    data_dir.mkdir(parents=True, exist_ok=True)
    store = JobStore(db)
    try:
        resume = on_interrupt == "resume"
        for job_id in store.fail_abandoned(lease_s, resume=resume, max_attempts=max_attempts):
            job = store.job(None, job_id)
            what = "queued again to resume" if job is not None and job.state == "queued" else "marked failed"
            typer.echo(f"fine-tuning job {job_id} was interrupted by a restart: {what}", err=True)
    finally:
        store.close()
    args = [sys.executable, "-m", "gaussdp.cli", "worker", "--db", db, "--data-dir", str(data_dir.resolve())]
    args += ["--lease-s", str(lease_s), "--parent-pid", str(_pid()), "--on-interrupt", on_interrupt]
    args += ["--checkpoint-every", str(checkpoint_every), "--max-attempts", str(max_attempts)]
    for spec in model:
        args += ["--model", spec]
    procs = [subprocess.Popen(args) for _ in range(n)]
    if n:
        typer.echo(f"{n} fine-tuning worker(s): pids {', '.join(str(p.pid) for p in procs)}")
    return procs


def _pid() -> int:
    import os

    return os.getpid()


def worker(
    db: str = typer.Option(DEFAULT_DB, "--db", envvar="GAUSSDP_DB", help=_DB_HELP),
    data_dir: Path = typer.Option(
        ..., "--data-dir", envvar="GAUSSDP_DATA_DIR", help="The server's data directory (shared)."
    ),
    model: list[str] = typer.Option(
        [], "--model", help="NAME=PATH: a base model this worker trains (a local Hugging Face directory)."
    ),
    lease_s: float = typer.Option(
        60.0, "--lease-s", envvar="GAUSSDP_FINETUNE_LEASE_S", help="Heartbeat lease of a running job."
    ),
    poll_s: float = typer.Option(1.0, "--poll-s", help="Seconds between looks at an empty queue."),
    max_jobs: int | None = typer.Option(None, "--max-jobs", min=1, help="Exit after this many jobs."),
    parent_pid: int | None = typer.Option(None, "--parent-pid", hidden=True),
    on_interrupt: str = typer.Option(
        "resume",
        "--on-interrupt",
        envvar="GAUSSDP_FINETUNE_ON_INTERRUPT",
        help="'resume' (an interrupted job is queued again and resumed from its checkpoint) or 'fail'.",
    ),
    checkpoint_every: int = typer.Option(
        10,
        "--checkpoint-every",
        envvar="GAUSSDP_FINETUNE_CHECKPOINT_EVERY",
        min=1,
        help="Steps between a job's checkpoints (1: a crash loses no step).",
    ),
    max_attempts: int = typer.Option(3, "--max-attempts", min=1, help="Claims of a job before it fails."),
) -> None:
    """Run fine-tuning jobs from the ledger's database (PostgreSQL for several machines).

    Takes queued jobs for the --model names given (the same names as the server's), trains each in
    this process, writes the adapter under --data-dir (shared with the server), until interrupted.
    """
    import logging
    import os

    from gaussdp.service.loading import parse_named_paths
    from gaussdp.service.worker import run_worker

    specs = model or [line for line in os.environ.get("GAUSSDP_MODELS", "").splitlines() if line.strip()]
    try:
        models = parse_named_paths("--model", specs)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    for name, path in models.items():
        if not Path(path).is_dir():
            typer.echo(f"error: model {name}: {path!r} is not a local directory", err=True)
            raise typer.Exit(2)
    if not models:
        typer.echo("warning: no --model given: this worker takes no job", err=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import signal

    def _interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _interrupt)  # a stopped server's workers requeue (or fail) their job
    try:
        if on_interrupt not in ("resume", "fail"):
            raise typer.BadParameter(f"--on-interrupt must be 'resume' or 'fail', got {on_interrupt!r}")
        run_worker(
            db, data_dir, models, poll_s=poll_s, lease_s=lease_s, max_jobs=max_jobs, parent_pid=parent_pid,
            on_interrupt=on_interrupt, checkpoint_every=checkpoint_every, max_attempts=max_attempts,
        )  # fmt: skip
    except KeyboardInterrupt:
        pass


def _load_models_and_adapters(
    model: list[str], adapter: list[str], dtype: str = "auto", device: str = "auto"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Parse and load ``--model`` / ``--adapter`` once; a bad one stops the server before it starts."""
    try:
        from gaussdp.service.loading import load_causal_lm, load_lora_adapter, parse_named_paths

        model_paths = parse_named_paths("--model", model)
        adapter_paths = parse_named_paths("--adapter", adapter)
    except ImportError:
        typer.echo("--model and --adapter need the 'torch' extra: pip install 'gaussdp[torch]'", err=True)
        raise typer.Exit(2) from None
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        models = {
            name: load_causal_lm(path, dtype=dtype, device=device) for name, path in model_paths.items()
        }
        adapters = {name: load_lora_adapter(path) for name, path in adapter_paths.items()}
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    return models, adapters


def _one_more(released: int) -> float:
    from gaussdp.accounting import accountant
    from gaussdp.mechanism import GaussianMechanism

    event = GaussianMechanism(epsilon=1.0, delta=1e-5, sensitivity=1.0).event
    return accountant("pld").compose(event, released + 1).epsilon(1e-5)


def demo(console: Any, out_dir: Path) -> None:
    """Start the service on a free port, open a session, release until refused, print the ledger."""
    import httpx
    import numpy as np

    from gaussdp._format import format_upper
    from gaussdp.budget import Ledger
    from gaussdp.calibration import classical_sigma
    from gaussdp.service.app import create_app
    from gaussdp.service.keys import create_api_key
    from gaussdp.service.server import ServerThread

    db_path = out_dir / "demo-ledger.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db_path}{suffix}").unlink(missing_ok=True)
    url = f"sqlite:///{db_path.resolve()}"
    with Ledger(url) as ledger:
        key = create_api_key(ledger.store, "demo-tenant")
        with ServerThread(create_app(ledger=ledger)) as server, httpx.Client(base_url=server.url) as http:
            h = {"Authorization": f"Bearer {key}"}
            console.print(f"service up at {server.url} (OpenAPI at {server.url}/docs), ledger {db_path}")
            session = http.post("/v1/sessions", json={"epsilon": 10.0, "delta": 1e-5}, headers=h).json()
            sid = session["session_id"]
            console.print(f"session {sid}: budget epsilon=10, delta=1e-5 (max_epsilon), PLD accountant")
            rng = np.random.default_rng()
            state = rng.normal(size=1536)
            # the inference server's setting: post-transformer hidden state norm ~177.5
            state *= 177.5 / np.linalg.norm(state)
            released, last = 0, None
            while True:
                # the inference server's relation (Delta_f = C): stated, since the default is replace-one
                r = http.post(
                    f"/v1/sessions/{sid}/hidden-state",
                    json={"hidden_state": state.tolist(), "neighbouring": "add_remove"},
                    headers=h,
                )
                if r.status_code != 200:
                    last = r
                    break
                released += 1
                out = r.json()
            sigma, classical = out["sigma"], classical_sigma(epsilon=1.0, delta=1e-5)
            console.print(
                f"released {released} noised hidden states (d=1536, clip 1, epsilon=1, delta=1e-5 each, "
                f"neighbouring={out['neighbouring']}, "
                f"analytic sigma={format_upper(sigma, 5)} instead of the classical "
                f"{format_upper(classical, 5)}); "
                f"then HTTP {last.status_code}: {last.json()['detail'][:110]}..."
            )
            spent = ledger.spent(f"demo-tenant/{sid}").epsilon
            console.print(
                f"basic composition (summing epsilons) would have stopped at 10 releases; the PLD ledger "
                f"allowed {released}, spending epsilon={format_upper(spent, 5)} <= 10 (an upper bound); a "
                f"single further release would take it to {format_upper(_one_more(released), 5)}"
            )
        console.print(_ledger_table(ledger, ledger.principals()))
