"""Flower integration: a DP-FedAvg strategy wrapper and client mods that use gaussdp's layers.

* :class:`DPFedAvgStrategy` wraps a ``flwr.server.strategy.FedAvg`` (kept for initial parameters and
  evaluation) and drives a :class:`gaussdp.federated.DPFedAvg` server: Poisson sampling from OS
  entropy, server-side clipping of every update's *difference* to the global model, one noise on the
  sum, the fixed denominator ``qN``, the ledger charged before each release, and the dropout rule
  (a failed client contributes zero; the round still counts). Compare Flower's own
  ``DifferentialPrivacyServerSideFixedClipping``: uniform fixed-size sampling with no amplification
  accounted, noise from ``np.random``, division by the number of answers.
* :func:`clip_mod` (client-side clipping of the update with :func:`gaussdp.federated.clip_update`)
  and :func:`local_dp_mod` (local DP with :class:`gaussdp.federated.LocalGaussian`, each client charged
  in its own ledger principal) are Flower mods for ``ClientApp(..., mods=[...])``.
* :func:`run_inprocess` runs Flower's real ``Server`` / ``ClientManager`` / ``GridClientProxy`` /
  ``ClientApp`` (with its mods) code paths in one process, through a small in-memory ``Grid``; Flower's
  ``start_simulation`` / ``run_simulation`` need Ray, which is not installed here.

Needs the ``federated`` extra (``pip install 'gaussdp[federated]'``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from gaussdp.errors import InvalidParameter, UnsafeInput
from gaussdp.federated._tree import flatten, unflatten

try:
    from flwr.app import Context, Message, RecordDict
    from flwr.app.message_type import MessageType
    from flwr.common import (
        EvaluateIns,
        EvaluateRes,
        FitIns,
        FitRes,
        Parameters,
        Scalar,
        ndarrays_to_parameters,
        parameters_to_ndarrays,
    )
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server.client_manager import ClientManager
    from flwr.server.client_proxy import ClientProxy
    from flwr.server.strategy import FedAvg, Strategy
    from flwr.serverapp.grid import Grid
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("gaussdp.federated.flower needs Flower: pip install 'gaussdp[federated]'") from exc

__all__ = [
    "KEY_CLIP_NORM",
    "KEY_NORM",
    "KEY_ROUND",
    "DPFedAvgStrategy",
    "InProcessGrid",
    "clip_mod",
    "local_dp_mod",
    "run_inprocess",
]

KEY_CLIP_NORM = "gaussdp.clip_norm"
KEY_ROUND = "gaussdp.round"
KEY_NORM = "gaussdp.update_norm"


class DPFedAvgStrategy(Strategy):
    """Flower strategy running DP-FedAvg through a :class:`gaussdp.federated.DPFedAvg` server.

    Every answering client weighs the same (DP-FedAvg's fixed denominator): the ``num_examples`` a
    client reports is ignored, since weighting by it would let one client's weight, hence the
    sensitivity, grow without bound. The population is fixed: the server's ``num_clients`` must equal
    the clients Flower knows, or the sampling rate ``q`` the accounting uses would be wrong.

    Args:
        server: the gaussdp server (its ``num_clients`` must equal the clients Flower knows).
        strategy: a ``FedAvg`` for ``initialize_parameters`` and evaluation (default ``FedAvg()``).
        server_lr: global += server_lr * released update.
        wait_timeout: seconds each round waits for the ``num_clients`` clients to be registered
            (Flower's simulation and SuperLink register nodes in the background) before the
            population check.
    """

    def __init__(
        self,
        server: Any,
        strategy: FedAvg | None = None,
        *,
        server_lr: float = 1.0,
        wait_timeout: int = 600,
    ) -> None:
        super().__init__()
        self.server = server
        self.inner = strategy if strategy is not None else FedAvg()
        self.server_lr = float(server_lr)
        self.wait_timeout = int(wait_timeout)
        self._plan: Any = None
        self._ids: dict[str, int] = {}
        self._global: np.ndarray | None = None
        self._spec: Any = None
        self.rounds: list[Any] = []

    def __repr__(self) -> str:
        return f"DPFedAvgStrategy({self.server!r})"

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return self.inner.initialize_parameters(client_manager)

    def _set_global(self, parameters: Parameters) -> None:
        if self._global is None:
            self._global, self._spec = flatten(parameters_to_ndarrays(parameters), "parameters")
            self.server.num_params = int(self._global.size)

    @property
    def parameters(self) -> Parameters:
        """The current global model (the strategy, not Flower's copy, is the source of truth)."""
        if self._global is None:
            raise InvalidParameter("no round has run yet")
        return ndarrays_to_parameters(unflatten(self._global, self._spec))

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        """Check the budget (raises BudgetExhausted to stop training), Poisson-sample, send C."""
        self._set_global(parameters)
        client_manager.wait_for(self.server.num_clients, timeout=self.wait_timeout)
        proxies = client_manager.all()
        if len(proxies) != self.server.num_clients:
            raise InvalidParameter(
                f"the server was built for num_clients={self.server.num_clients} but Flower knows "
                f"{len(proxies)} clients: the sampling rate q would be wrong"
            )
        cids = sorted(proxies, key=_cid_order)
        self._ids = {cid: i for i, cid in enumerate(cids)}
        plan = self.server.begin_round()
        self._plan = plan
        if plan.clients.size == 0:
            # Nobody sampled: Flower would skip the round; the rule says it is released and counted.
            self._finish([], np.zeros((0, self._global.size), self._global.dtype), None)  # type: ignore[union-attr]
            return []
        config: dict[str, Scalar] = {KEY_CLIP_NORM: float(plan.clip_norm), KEY_ROUND: int(plan.round_num)}
        fit_ins = FitIns(self.parameters, config)
        return [(proxies[cids[i]], fit_ins) for i in plan.clients.tolist()]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[tuple[ClientProxy, FitRes] | BaseException],
    ) -> tuple[Parameters | None, dict[str, Scalar]]:
        """Deltas to the global model, server-side clip, charge, noise, fixed denominator.

        Failures are dropouts: they contribute zero and the round is charged and counted.
        """
        assert self._global is not None
        rows: list[tuple[int, np.ndarray, float | None]] = []
        for proxy, res in results:
            if proxy.cid not in self._ids:
                raise UnsafeInput(f"result from unknown client {proxy.cid!r}: refused")
            vec, _ = flatten(parameters_to_ndarrays(res.parameters), "parameters")
            if vec.size != self._global.size:
                raise UnsafeInput(
                    f"client {proxy.cid} sent {vec.size} parameters, the model has {self._global.size}"
                )
            norm = res.metrics.get(KEY_NORM)
            rows.append((self._ids[proxy.cid], vec.astype(self._global.dtype) - self._global, norm))  # type: ignore[arg-type]
        rows.sort(key=lambda r: r[0])  # completion order of Flower's thread pool is not deterministic
        ids = [r[0] for r in rows]
        deltas = (
            np.stack([r[1] for r in rows]) if rows else np.zeros((0, self._global.size), self._global.dtype)
        )
        norms = [r[2] for r in rows]
        res_ = self._finish(
            ids, deltas, None if any(n is None for n in norms) or not rows else np.asarray(norms, float)
        )
        metrics: dict[str, Scalar] = {
            "epsilon": float(res_.epsilon),
            "delta": float(res_.delta),
            "clip_norm": float(res_.clip_norm),
            "answered": int(res_.answered),
            "sampled": int(res_.sampled),
        }
        return self.parameters, metrics

    def _finish(self, ids: list[int], deltas: np.ndarray, norms: np.ndarray | None) -> Any:
        res = self.server.finish_round(self._plan, deltas, np.asarray(ids, dtype=np.int64), norms=norms)
        assert self._global is not None
        self._global = self._global + (self.server_lr * res.update).astype(self._global.dtype, copy=False)
        self._plan = None
        self.rounds.append(res)
        return res

    def configure_evaluate(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, EvaluateIns]]:
        return self.inner.configure_evaluate(server_round, self.parameters, client_manager)

    def aggregate_evaluate(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, EvaluateRes]],
        failures: list[tuple[ClientProxy, EvaluateRes] | BaseException],
    ) -> tuple[float | None, dict[str, Scalar]]:
        return self.inner.aggregate_evaluate(server_round, results, failures)

    def evaluate(self, server_round: int, parameters: Parameters) -> tuple[float, dict[str, Scalar]] | None:
        return self.inner.evaluate(server_round, self.parameters if self._global is not None else parameters)


def _cid_order(cid: str) -> tuple[int, Any]:
    return (0, int(cid)) if cid.isdigit() else (1, cid)


# -- client mods -------------------------------------------------------------------------------------


def _fit_io(msg: Message) -> tuple[FitIns, list[np.ndarray]]:
    fit_ins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    return fit_ins, parameters_to_ndarrays(fit_ins.parameters)


def clip_mod(msg: Message, ctxt: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Client-side clipping: the client's update (new params minus the global ones) is clipped to the
    ``gaussdp.clip_norm`` the server sent, with :func:`gaussdp.federated.clip_update`; the norm before
    clipping travels back as a metric for adaptive clipping (the server is trusted in central DP)."""
    from gaussdp.federated.client import clip_update

    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    fit_ins, global_params = _fit_io(msg)
    if KEY_CLIP_NORM not in fit_ins.config:
        raise KeyError(f"{KEY_CLIP_NORM} not in the fit config: use DPFedAvgStrategy on the server")
    clip_norm = float(fit_ins.config[KEY_CLIP_NORM])
    out = call_next(msg, ctxt)
    if out.has_error():
        return out
    fit_res = compat.recorddict_to_fitres(out.content, keep_input=True)
    local = parameters_to_ndarrays(fit_res.parameters)
    delta, norm = clip_update(local, global_params, clip_norm)
    fit_res.parameters = ndarrays_to_parameters([g + d for g, d in zip(global_params, delta, strict=True)])
    fit_res.metrics[KEY_NORM] = float(norm)
    out.content = compat.fitres_to_recorddict(fit_res, keep_input=True)
    return out


def local_dp_mod(local: Any) -> Callable[[Message, Context, Callable[[Message, Context], Message]], Message]:
    """A mod adding local DP with ``local`` (:class:`gaussdp.federated.LocalGaussian`) to every update.

    The client (principal ``client/<node_id>``) is charged in ``local``'s ledger before its noisy update
    is returned; a client whose budget is spent raises and sends nothing.
    """

    def mod(msg: Message, ctxt: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        if msg.metadata.message_type != MessageType.TRAIN:
            return call_next(msg, ctxt)
        fit_ins, global_params = _fit_io(msg)
        round_num = fit_ins.config.get(KEY_ROUND)
        out = call_next(msg, ctxt)
        if out.has_error():
            return out
        fit_res = compat.recorddict_to_fitres(out.content, keep_input=True)
        local_params = parameters_to_ndarrays(fit_res.parameters)
        noisy = local.privatize(
            local_params,
            global_params,
            client_id=ctxt.node_id,
            round_num=int(round_num) if round_num is not None else None,  # type: ignore[arg-type]
        )
        fit_res.parameters = ndarrays_to_parameters(
            [g + d for g, d in zip(global_params, noisy, strict=True)]
        )
        out.content = compat.fitres_to_recorddict(fit_res, keep_input=True)
        return out

    return mod


# -- in-process transport for Flower's legacy Server ---------------------------------------------------


class InProcessGrid(Grid):
    """A Flower ``Grid`` that delivers each message to a ``ClientApp`` in this process.

    Each node keeps its own ``Context`` (with its ``state``) across rounds, as a SuperNode would.
    """

    def __init__(self, app: Any, node_ids: Iterable[int], run_id: int = 1) -> None:
        self.app = app
        self._node_ids = list(node_ids)
        self.run_id = run_id
        self._contexts: dict[int, Context] = {}

    def set_run(self, run: Any) -> None:  # the legacy server does not use runs
        pass

    @property
    def run(self) -> Any:
        return None

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(
            content=content, message_type=message_type, dst_node_id=dst_node_id, group_id=group_id, ttl=ttl
        )

    def get_node_ids(self) -> Iterable[int]:
        return list(self._node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("InProcessGrid only supports send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("InProcessGrid only supports send_and_receive")

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        out = []
        for m in messages:
            nid = m.metadata.dst_node_id
            ctx = self._contexts.get(nid)
            if ctx is None:
                ctx = Context(
                    run_id=self.run_id, node_id=nid, node_config={}, state=RecordDict(), run_config={}
                )
                self._contexts[nid] = ctx
            out.append(self.app(m, ctx))
        return out


def run_inprocess(
    client_app: Any,
    strategy: Strategy,
    *,
    num_clients: int,
    num_rounds: int,
    max_workers: int | None = None,
) -> tuple[Any, float]:
    """Run Flower's legacy ``Server.fit`` over ``num_clients`` in-process nodes; returns (History, seconds).

    Node ids are ``0 .. num_clients - 1`` (client ``i`` of the gaussdp server). The messages go through
    Flower's ``GridClientProxy`` (FitIns <-> RecordDict <-> Message), the ``ClientApp`` and its mods.
    """
    from flwr.server import Server, SimpleClientManager
    from flwr.server.compat.grid_client_proxy import GridClientProxy

    identity: Any = None
    try:
        from flwr.supercore.task_identity import TaskIdentity

        identity = TaskIdentity
    except ImportError:  # pragma: no cover - older Flower: messages take the run id from elsewhere
        pass

    # A ServerApp process sets its identity before creating messages; the legacy in-process path must too.
    for attr, value in (("run_id", 1), ("task_id", 1), ("node_id", 0)):
        if identity is None:
            break
        try:
            getattr(identity, attr)
        except RuntimeError:
            setattr(identity, attr, value)
    grid = InProcessGrid(client_app, range(num_clients))
    manager = SimpleClientManager()
    for i in range(num_clients):
        manager.register(GridClientProxy(i, grid, 1))
    server = Server(client_manager=manager, strategy=strategy)
    server.set_max_workers(max_workers)
    t0 = time.perf_counter()
    history, _ = server.fit(num_rounds=num_rounds, timeout=None)
    return history, time.perf_counter() - t0
