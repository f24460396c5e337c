"""Prometheus metrics of the service (text format at ``/metrics``), one registry per app.

- ``gaussdp_request_seconds{route,method,status}``: latency histogram, by route template.
- ``gaussdp_charges_total{tenant}``: charges recorded (replays not counted).
- ``gaussdp_refusals_total{reason}``: requests refused: ``budget_exhausted``,
  ``tenant_limit_exceeded``, ``work_limit_exceeded``, ``ledger_contention``,
  ``database_unavailable``, ``rate_limited``, ``unauthorized``, ``forbidden``.
- ``gaussdp_epsilon_spent_total{tenant}``: the sum, over the tenant's charges, of how much each
  raised its session's composed epsilon (so, per session, its spent epsilon; per tenant, the sum).

With several worker processes each keeps its own figures, unless ``PROMETHEUS_MULTIPROC_DIR`` names
a directory (prometheus_client's multiprocess mode): then every worker writes there and ``/metrics``
aggregates them all.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["Metrics"]

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    """The service's counters and histograms (needs ``prometheus_client``, in the service extra)."""

    def __init__(self) -> None:
        try:
            from prometheus_client import CollectorRegistry, Counter, Histogram
        except ImportError:  # pragma: no cover - depends on the environment
            raise ImportError("metrics need prometheus_client: pip install 'gaussdp[service]'") from None
        self.registry = CollectorRegistry()
        self.requests = Histogram(
            "gaussdp_request_seconds",
            "Request latency by route template, method and status.",
            ["route", "method", "status"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.charges = Counter("gaussdp_charges", "Charges recorded.", ["tenant"], registry=self.registry)
        self.refusals = Counter(
            "gaussdp_refusals", "Requests refused, by reason.", ["reason"], registry=self.registry
        )
        self.epsilon = Counter(
            "gaussdp_epsilon_spent",
            "Increase of the sessions' composed epsilon, summed per tenant.",
            ["tenant"],
            registry=self.registry,
        )

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry: Any = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
