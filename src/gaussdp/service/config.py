"""The service configured by environment variables (``gaussdp serve`` sets them from its options).

- ``GAUSSDP_DB``: ledger URL, ``sqlite:///...`` or ``postgresql://...`` (default
  ``sqlite:///gaussdp-ledger.db``)
- ``GAUSSDP_CPU_LIMIT_S``: CPU seconds of numeric work per request (default 1.0)
- ``GAUSSDP_MAX_BODY_BYTES``: larger bodies get 413 (default 8388608)
- ``GAUSSDP_RATE_LIMIT_PER_S``: requests/s per API key, all workers (429) (default none)
- ``GAUSSDP_RATE_LIMIT_BURST``: token bucket size (default the rate, rounded up)
- ``GAUSSDP_RATE_LIMIT_FILE``: buckets shared by this host's workers (default set by ``gaussdp serve``)
- ``GAUSSDP_TEXT``: ``keyed``, ``public`` or ``off`` (default ``keyed``)
- ``GAUSSDP_METRICS``: ``keyed``, ``public`` or ``off`` (default ``keyed``)
- ``GAUSSDP_NOISE``: ``secure`` or ``fast`` (default ``secure``)
- ``GAUSSDP_DATA_DIR``: corpora and adapters; enables fine-tuning (default none (off))
- ``GAUSSDP_MAX_STREAMS``: generations at once per worker (429 past it) (default 32)
- ``GAUSSDP_MAX_STREAMS_PER_TENANT``: one tenant's share of them (default 8)
- ``GAUSSDP_MAX_STREAM_S``: a stream ends (``time_limit``) after this many seconds (default 300)
- ``GAUSSDP_STREAM_IDLE_S``: and (``idle``) this long after its last token (default 60)
- ``GAUSSDP_CKKS_MEMORY_BYTES``: loaded CKKS contexts per worker, all tenants (default 536870912, 512 MiB)
- ``GAUSSDP_CKKS_TENANT_MEMORY_BYTES``: one tenant's loaded CKKS contexts, per worker (default
  134217728, 128 MiB)
- ``GAUSSDP_MAX_CORPORA_PER_TENANT``: corpora stored per tenant (default 100)
- ``GAUSSDP_MAX_CORPUS_BYTES_PER_TENANT``: bytes of a tenant's stored corpora (default 2000000000)
- ``GAUSSDP_MAX_JOBS_PER_TENANT``: a tenant's fine-tuning jobs not finished (default 4)

``gaussdp serve`` also reads ``GAUSSDP_HOST``, ``GAUSSDP_PORT``, ``GAUSSDP_WORKERS``,
``GAUSSDP_SSL_CERTFILE`` and ``GAUSSDP_SSL_KEYFILE``. A value that does not parse is refused at
start-up with the variable's name (fail closed: never a silent default).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ENV", "SWITCH_INTERVAL_S", "app_from_env", "settings_from_env"]

#: The thread switch interval of a ``gaussdp serve`` worker process (``sys.setswitchinterval``).
SWITCH_INTERVAL_S = 0.001

ENV = {
    "ledger_url": "GAUSSDP_DB",
    "cpu_limit_s": "GAUSSDP_CPU_LIMIT_S",
    "max_body_bytes": "GAUSSDP_MAX_BODY_BYTES",
    "rate_limit_per_s": "GAUSSDP_RATE_LIMIT_PER_S",
    "rate_limit_burst": "GAUSSDP_RATE_LIMIT_BURST",
    "rate_limit_file": "GAUSSDP_RATE_LIMIT_FILE",
    "text": "GAUSSDP_TEXT",
    "metrics": "GAUSSDP_METRICS",
    "noise": "GAUSSDP_NOISE",
    "data_dir": "GAUSSDP_DATA_DIR",
    "max_streams": "GAUSSDP_MAX_STREAMS",
    "max_streams_per_tenant": "GAUSSDP_MAX_STREAMS_PER_TENANT",
    "max_stream_s": "GAUSSDP_MAX_STREAM_S",
    "stream_idle_s": "GAUSSDP_STREAM_IDLE_S",
    "ckks_memory_bytes": "GAUSSDP_CKKS_MEMORY_BYTES",
    "ckks_tenant_memory_bytes": "GAUSSDP_CKKS_TENANT_MEMORY_BYTES",
    "max_corpora_per_tenant": "GAUSSDP_MAX_CORPORA_PER_TENANT",
    "max_corpus_bytes_per_tenant": "GAUSSDP_MAX_CORPUS_BYTES_PER_TENANT",
    "max_jobs_per_tenant": "GAUSSDP_MAX_JOBS_PER_TENANT",
}


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"one of {', '.join(allowed)}")
        return value

    return parse


_PARSE: dict[str, Callable[[str], Any]] = {
    "ledger_url": str,
    "cpu_limit_s": float,
    "max_body_bytes": int,
    "rate_limit_per_s": float,
    "rate_limit_burst": int,
    "rate_limit_file": str,
    "text": _choice("keyed", "public", "off"),
    "metrics": _choice("keyed", "public", "off"),
    "noise": _choice("secure", "fast"),
    "data_dir": str,
    "max_streams": int,
    "max_streams_per_tenant": int,
    "max_stream_s": float,
    "stream_idle_s": float,
    "ckks_memory_bytes": int,
    "ckks_tenant_memory_bytes": int,
    "max_corpora_per_tenant": int,
    "max_corpus_bytes_per_tenant": int,
    "max_jobs_per_tenant": int,
}


def settings_from_env(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The :func:`~gaussdp.service.app.create_app` arguments the environment sets (others default)."""
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {}
    for name, var in ENV.items():
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        try:
            out[name] = _PARSE[name](raw)
        except ValueError as exc:
            raise ValueError(f"{var}={raw!r} is not valid ({exc})") from None
    return out


# ``gaussdp serve --model/--adapter``: NAME=PATH specs, one per line, loaded by each worker at start-up.
MODELS_ENV = "GAUSSDP_MODELS"
ADAPTERS_ENV = "GAUSSDP_ADAPTERS"
# ``gaussdp serve --dtype/--device``: how every worker loads the --model checkpoints.
DTYPE_ENV = "GAUSSDP_MODEL_DTYPE"
DEVICE_ENV = "GAUSSDP_MODEL_DEVICE"


def _named_paths(var: str, environ: Mapping[str, str]) -> list[str]:
    return [line for line in environ.get(var, "").splitlines() if line.strip()]


def app_from_env() -> Any:
    """A service app configured by ``GAUSSDP_*`` (uvicorn factory of ``gaussdp serve``, per worker).

    Sets this process's thread switch interval to :data:`SWITCH_INTERVAL_S` (it is a server's
    process). Models and LoRA adapters named in ``GAUSSDP_MODELS`` / ``GAUSSDP_ADAPTERS`` are read
    here, once per worker, from local directories (``gaussdp serve`` checked them before listening), with the
    tokenizer saved next to each model when there is one (``/generate`` then takes text prompts).
    """
    import sys

    from gaussdp.service.app import create_app

    # This process is a server: its event loop waits for the GIL behind whatever request work runs
    # in threads (corpus checks, forward passes); Python hands the GIL over every 5 ms by default.
    # Every 1 ms, /healthz's p99 under 4 concurrent 20 MB corpus uploads went 78 -> 60 ms (p50
    # 24 -> 3 ms) on a shared 2-core machine, for a few percent more switching.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    models: dict[str, Any] = {}
    tokenizers: dict[str, Any] = {}
    adapters: dict[str, Any] = {}
    model_paths: dict[str, str] = {}
    model_specs, adapter_specs = _named_paths(MODELS_ENV, os.environ), _named_paths(ADAPTERS_ENV, os.environ)
    if model_specs or adapter_specs:
        from gaussdp.service.loading import (
            load_causal_lm,
            load_lora_adapter,
            load_tokenizer,
            parse_named_paths,
        )

        model_paths = parse_named_paths("--model", model_specs)
        how = {"dtype": os.environ.get(DTYPE_ENV) or "auto", "device": os.environ.get(DEVICE_ENV) or "auto"}
        models = {n: load_causal_lm(p, **how) for n, p in model_paths.items()}
        tokenizers = {n: t for n, p in model_paths.items() if (t := load_tokenizer(p)) is not None}
        adapters = {n: load_lora_adapter(p) for n, p in parse_named_paths("--adapter", adapter_specs).items()}
    app = create_app(**settings_from_env(), lora_adapters=adapters or None, model_paths=model_paths)
    app.state.models = models
    app.state.tokenizers = tokenizers  # served generation takes text prompts for these models
    return app
