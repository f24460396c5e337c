"""Federated learning with the Gaussian mechanism: clients clip (and may noise), the server aggregates
once with calibrated noise and keeps every round in the ledger.

* client side (:mod:`~gaussdp.federated.client`): :func:`clip_update`, :class:`LocalGaussian`
  (local DP, one ledger principal per client), :func:`sanitize_coreset` (the federated anomaly detector's
  flow);
* server side (:mod:`~gaussdp.federated.server`): :class:`DPFedAvg` (Poisson client sampling with the
  amplification accounted, fixed denominator, explicit dropout rule), :class:`AdaptiveClipping`
  (Andrew et al. 2021), robust aggregators (:mod:`~gaussdp.federated.robust`);
* accounting (:mod:`~gaussdp.federated.rounds`): :class:`RoundLedger` (resumable runs,
  ``would_exceed``), :func:`round_report` (the federated anomaly detector's report grouped by round);
* :class:`FederatedSimulator` (in process, vectorised) and the Flower integration
  (:mod:`gaussdp.federated.flower`, needs the ``federated`` extra; imported on demand).

Every guarantee is client-level: add/remove of one client's whole data (see each module).
"""

from __future__ import annotations

from gaussdp.federated.adaptive import AdaptiveClipping, effective_noise_multiplier
from gaussdp.federated.client import LocalGaussian, client_principal, clip_update, sanitize_coreset
from gaussdp.federated.robust import (
    CoordinateMedian,
    Krum,
    RobustAggregator,
    TrimmedMean,
    coordinate_median,
    krum,
    robust_aggregator,
    trimmed_mean,
)
from gaussdp.federated.rounds import RoundLedger, privacy_accountant, round_report
from gaussdp.federated.server import DPFedAvg, RoundPlan, RoundResult
from gaussdp.federated.simulator import (
    FederatedSimulator,
    SoftmaxRegressionClients,
    dirichlet_split,
    shard_split,
    softmax_accuracy,
)

__all__ = [
    "AdaptiveClipping",
    "CoordinateMedian",
    "DPFedAvg",
    "FederatedSimulator",
    "Krum",
    "LocalGaussian",
    "RobustAggregator",
    "RoundLedger",
    "RoundPlan",
    "RoundResult",
    "SoftmaxRegressionClients",
    "TrimmedMean",
    "client_principal",
    "clip_update",
    "coordinate_median",
    "dirichlet_split",
    "effective_noise_multiplier",
    "krum",
    "privacy_accountant",
    "robust_aggregator",
    "round_report",
    "sanitize_coreset",
    "shard_split",
    "softmax_accuracy",
    "trimmed_mean",
]
