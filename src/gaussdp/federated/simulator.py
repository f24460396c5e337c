"""An in-process federated simulator: N clients vectorised with numpy, no Ray, no network.

The clients of a round are a ``[clients, params]`` matrix: local training of all sampled clients is
one batched computation (:class:`SoftmaxRegressionClients` pads every client's data to the largest
client and masks the padding), and the server's clip / sum / noise work on the stacked matrix
(:class:`gaussdp.federated.DPFedAvg`). For tests, studies and the demo; real deployments use the
Flower integration (:mod:`gaussdp.federated.flower`), which drives the same server object.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gaussdp.errors import InvalidParameter, UnsafeInput

__all__ = [
    "FederatedSimulator",
    "SimulationRound",
    "SoftmaxRegressionClients",
    "dirichlet_split",
    "shard_split",
    "softmax_accuracy",
]


def shard_split(
    y: np.ndarray, num_clients: int, shards_per_client: int = 2, *, rng: np.random.Generator
) -> list[np.ndarray]:
    """Non-IID split of McMahan et al. 2017: sort by label, cut into shards, deal shards to clients."""
    order = np.argsort(y, kind="stable")
    n_shards = num_clients * shards_per_client
    shards = np.array_split(order, n_shards)
    perm = rng.permutation(n_shards)
    return [
        np.concatenate([shards[s] for s in perm[i * shards_per_client : (i + 1) * shards_per_client]])
        for i in range(num_clients)
    ]


def dirichlet_split(
    y: np.ndarray, num_clients: int, alpha: float, *, rng: np.random.Generator
) -> list[np.ndarray]:
    """Non-IID split with label proportions ``Dirichlet(alpha)`` per class (Hsu et al. 2019)."""
    parts: list[list[int]] = [[] for _ in range(num_clients)]
    for label in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == label))
        p = rng.dirichlet(np.full(num_clients, alpha))
        cuts = (np.cumsum(p)[:-1] * idx.size).astype(int)
        for i, chunk in enumerate(np.split(idx, cuts)):
            parts[i].extend(chunk.tolist())
    return [np.asarray(sorted(p), dtype=np.int64) for p in parts]


def softmax_accuracy(params: np.ndarray, X: np.ndarray, y: np.ndarray, num_classes: int) -> float:
    """Accuracy of the flat softmax-regression ``params`` (``[W (d x k), b (k)]``) on ``(X, y)``."""
    d = X.shape[1]
    W = params[: d * num_classes].reshape(d, num_classes)
    b = params[d * num_classes :]
    return float(np.mean(np.argmax(X @ W + b, axis=1) == y))


class SoftmaxRegressionClients:
    """Clients that each run ``local_steps`` of full-batch gradient descent on softmax regression.

    The client data are stacked into ``[N, n_max, d]`` with a mask, so the local training of any set
    of clients is a few batched matrix products. Parameters are flat: ``W`` (``d x k``) then ``b``.
    """

    def __init__(
        self,
        X: np.ndarray,
        y: np.ndarray,
        partitions: list[np.ndarray],
        num_classes: int,
        *,
        local_steps: int = 5,
        learning_rate: float = 0.5,
        dtype: Any = np.float32,
    ) -> None:
        if X.ndim != 2 or y.shape[0] != X.shape[0]:
            raise UnsafeInput(
                f"X must be [n, d] with y of length n, got X.shape={X.shape}, y.shape={y.shape}"
            )
        self.num_clients = len(partitions)
        self.d = X.shape[1]
        self.k = int(num_classes)
        self.local_steps = int(local_steps)
        self.learning_rate = float(learning_rate)
        n_max = max(1, max(len(p) for p in partitions))
        self.Xs = np.zeros((self.num_clients, n_max, self.d), dtype=dtype)
        self.Ys = np.zeros((self.num_clients, n_max, self.k), dtype=dtype)
        self.mask = np.zeros((self.num_clients, n_max), dtype=dtype)
        for i, idx in enumerate(partitions):
            self.Xs[i, : len(idx)] = X[idx]
            self.Ys[i, np.arange(len(idx)), y[idx]] = 1
            self.mask[i, : len(idx)] = 1
        self.counts = self.mask.sum(axis=1)

    @property
    def num_params(self) -> int:
        return self.d * self.k + self.k

    def init_params(self) -> np.ndarray:
        return np.zeros(self.num_params, dtype=self.Xs.dtype)

    def __call__(self, global_params: np.ndarray, client_ids: np.ndarray) -> np.ndarray:
        """Model deltas ``[len(client_ids), P]`` after local training from ``global_params``."""
        ids = np.asarray(client_ids, dtype=np.int64)
        X, Y, m = self.Xs[ids], self.Ys[ids], self.mask[ids]
        n = np.maximum(self.counts[ids], 1.0)[:, None, None]
        dk = self.d * self.k
        W = np.broadcast_to(global_params[:dk].reshape(self.d, self.k), (ids.size, self.d, self.k)).copy()
        b = np.broadcast_to(global_params[dk:], (ids.size, self.k)).copy()
        for _ in range(self.local_steps):
            logits = np.einsum("cnd,cdk->cnk", X, W) + b[:, None, :]
            logits -= logits.max(axis=2, keepdims=True)
            p = np.exp(logits)
            p /= p.sum(axis=2, keepdims=True)
            err = (p - Y) * m[:, :, None]
            W -= self.learning_rate * np.einsum("cnd,cnk->cdk", X, err) / n
            b -= self.learning_rate * err.sum(axis=1) / n[:, :, 0]
        new = np.concatenate([W.reshape(ids.size, -1), b], axis=1)
        return (new - global_params[None, :]).astype(self.Xs.dtype, copy=False)


@dataclass
class SimulationRound:
    """One simulated round: the server's result plus the evaluation of the new global model."""

    round_num: int
    epsilon: float
    sampled: int
    answered: int
    clip_norm: float
    metrics: dict[str, float] = field(default_factory=dict)


class FederatedSimulator:
    """Run DP-FedAvg rounds in process: sample, local updates (vectorised), aggregate, evaluate.

    Args:
        server: a :class:`gaussdp.federated.DPFedAvg`.
        clients: ``clients(global_params, client_ids) -> [k, P]`` deltas (e.g.
            :class:`SoftmaxRegressionClients`).
        init_params: the initial flat global model.
        server_lr: the server learning rate (``global += server_lr * update``).
        dropout_rate: probability that a sampled client drops out of a round (simulated failures,
            handled by the server's dropout rule).
        evaluate: ``evaluate(global_params) -> dict`` of metrics after each round.
        rng: the generator of simulated dropouts (not a privacy mechanism).
    """

    def __init__(
        self,
        server: Any,
        clients: Callable[[np.ndarray, np.ndarray], np.ndarray],
        init_params: np.ndarray,
        *,
        server_lr: float = 1.0,
        dropout_rate: float = 0.0,
        evaluate: Callable[[np.ndarray], dict[str, float]] | None = None,
        rng: np.random.Generator | None = None,
    ) -> None:
        if not 0.0 <= dropout_rate < 1.0:
            raise InvalidParameter(f"dropout_rate must be in [0, 1), got dropout_rate={dropout_rate!r}")
        self.server = server
        self.clients = clients
        self.params = np.array(init_params, copy=True)
        self.server.num_params = int(self.params.size)
        self.server_lr = float(server_lr)
        self.dropout_rate = float(dropout_rate)
        self.evaluate = evaluate
        self.rng = rng if rng is not None else np.random.default_rng()
        self.rounds: list[SimulationRound] = []

    def _dropout(self, ids: np.ndarray) -> np.ndarray:
        return self.rng.random(ids.size) >= self.dropout_rate

    def step(self) -> SimulationRound:
        """One round. Raises :class:`~gaussdp.errors.BudgetExhausted` before a round that would not fit."""
        res = self.server.run_round(
            self.params, self.clients, dropout=self._dropout if self.dropout_rate else None
        )
        self.params = self.params + (self.server_lr * res.update).astype(self.params.dtype, copy=False)
        metrics = self.evaluate(self.params) if self.evaluate is not None else {}
        out = SimulationRound(res.round_num, res.epsilon, res.sampled, res.answered, res.clip_norm, metrics)
        self.rounds.append(out)
        return out

    def run(
        self, rounds: int, *, callback: Callable[[SimulationRound], None] | None = None
    ) -> list[SimulationRound]:
        """Up to ``rounds`` rounds; stops early when the budget ends (message in ``self.stopped``)."""
        from gaussdp.errors import BudgetExhausted

        self.stopped: str | None = None
        for _ in range(int(rounds)):
            try:
                r = self.step()
            except BudgetExhausted as exc:
                self.stopped = str(exc)
                break
            if callback is not None:
                callback(r)
        return self.rounds
