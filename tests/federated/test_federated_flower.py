"""Flower integration, end to end through Flower's own Server, ClientManager, proxies, ClientApp and mods.

Flower's ``start_simulation`` / ``run_simulation`` need Ray, which is not installed: these tests drive
Flower's legacy ``Server.fit`` over ``GridClientProxy`` objects whose messages an in-memory ``Grid``
delivers to a real ``ClientApp`` (see :func:`gaussdp.federated.flower.run_inprocess`).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.client import ClientApp, NumPyClient
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.strategy import FedAvg

from gaussdp.budget import Ledger
from gaussdp.errors import BudgetExhausted
from gaussdp.federated import DPFedAvg, LocalGaussian
from gaussdp.federated.flower import DPFedAvgStrategy, clip_mod, local_dp_mod, run_inprocess

pytestmark = pytest.mark.filterwarnings("ignore::gaussdp.errors.NotPrivateWarning")
logging.getLogger("flwr").setLevel(logging.WARNING)

N, SHAPES = 20, [(3, 4), (4,)]
P = 16
DROPPED = {3, 11}


def _deltas() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(N, P)).astype(np.float32)


class _Client(NumPyClient):
    def __init__(self, cid: int) -> None:
        self.cid = cid

    def fit(self, parameters, config):
        if self.cid in DROPPED:
            raise RuntimeError("client crashed")  # a dropout: Flower records a failure
        d = _deltas()[self.cid]
        flat = np.concatenate([p.reshape(-1) for p in parameters]) + d
        out, start = [], 0
        for s in SHAPES:
            n = int(np.prod(s))
            out.append(flat[start : start + n].reshape(s))
            start += n
        return out, 1, {}

    def evaluate(self, parameters, config):
        return 0.0, 1, {}


def _server(**kw) -> DPFedAvg:
    args = dict(
        num_clients=N,
        sample_rate=0.5,
        noise_multiplier=1.0,
        clip_norm=1.0,
        ledger="memory://",
        epsilon=20.0,
        delta=1e-5,
        accountant="rdp",
        noise="fast",
        seed=7,
    )
    args.update(kw)
    return DPFedAvg(**args)


def _init() -> list[np.ndarray]:
    return [np.zeros(s, dtype=np.float32) for s in SHAPES]


def _flower(rounds: int, mods=(), **kw):
    srv = _server(**kw)
    inner = FedAvg(fraction_evaluate=0.0, initial_parameters=ndarrays_to_parameters(_init()))
    strategy = DPFedAvgStrategy(srv, inner)
    app = ClientApp(client_fn=lambda context: _Client(int(context.node_id)).to_client(), mods=list(mods))
    # One worker: Flower's thread pool otherwise answers in an order that depends on machine load.
    history, _ = run_inprocess(app, strategy, num_clients=N, num_rounds=rounds, max_workers=1)
    return srv, strategy, history


def _inprocess(rounds: int, **kw):
    srv = _server(**kw)
    params = np.zeros(P, dtype=np.float32)
    deltas = _deltas()
    for _ in range(rounds):
        res = srv.run_round(
            params, lambda g, ids: deltas[ids], dropout=lambda ids: ~np.isin(ids, list(DROPPED))
        )
        params = params + res.update
    return srv, params


@pytest.mark.parametrize("mods", [(), (clip_mod,)])
def test_flower_run_equals_the_inprocess_simulator(mods) -> None:
    srv_f, strategy, history = _flower(3, mods)
    srv_i, params_i = _inprocess(3)
    flat_f = np.concatenate([p.reshape(-1) for p in parameters_to_ndarrays(strategy.parameters)])
    # Dropouts were Flower failures: they contributed zero, the rounds still counted.
    assert [r.answered for r in strategy.rounds] == [r.answered for r in srv_i.history]
    np.testing.assert_allclose(flat_f, params_i, rtol=1e-5, atol=1e-6)
    assert srv_f.epsilon() == srv_i.epsilon() and srv_f.rounds_done == 3
    assert any(r.answered < r.sampled for r in strategy.rounds)
    eps = [m[1] for m in history.metrics_distributed_fit["epsilon"]]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(srv_f.epsilon())


def test_flower_stops_before_a_round_that_would_exceed_the_budget() -> None:
    from gaussdp.accounting import SubsampledGaussianEvent, accountant

    budget = accountant("rdp").compose(SubsampledGaussianEvent(1.0, 0.5), 2).epsilon(1e-5) * 1.0001
    with pytest.raises(BudgetExhausted, match="stopping before round 3"):
        _flower(5, epsilon=budget)


def test_local_dp_mod_charges_each_client_in_its_own_principal() -> None:
    led = Ledger("memory://")
    local = LocalGaussian(
        clip_norm=1.0,
        noise_multiplier=2.0,
        ledger=led,
        budget_epsilon=10.0,
        budget_delta=1e-5,
        accountant="rdp",
        noise="fast",
    )
    _srv, strategy, _ = _flower(2, (local_dp_mod(local),))
    answered = sum(r.answered for r in strategy.rounds)
    charged = sum(len(led.history(p)) for p in led.principals("client/"))
    assert charged == answered > 0
    assert all(p.split("/")[1].isdigit() for p in led.principals("client/"))


def test_a_round_with_nobody_sampled_still_counts_under_flower() -> None:
    # q = 0.02 with 20 clients: most rounds sample nobody. Flower would skip them ("no clients
    # selected, cancel"); the strategy releases the noise-only round, charges it and counts it.
    srv, strategy, _ = _flower(4, sample_rate=0.02)
    assert srv.rounds_done == 4 and len(strategy.rounds) == 4
    assert any(r.sampled == 0 for r in strategy.rounds)
    from gaussdp.accounting import SubsampledGaussianEvent, accountant

    assert srv.epsilon() == pytest.approx(
        accountant("rdp").compose(SubsampledGaussianEvent(1.0, 0.02), 4).epsilon(1e-5)
    )


def test_the_strategy_waits_for_the_population_then_refuses_a_wrong_one() -> None:
    # Flower's simulation and SuperLink register nodes in the background: configure_fit first waits
    # (up to wait_timeout) for num_clients nodes; a population that stays smaller is refused.
    import threading

    from flwr.server import SimpleClientManager
    from flwr.server.compat.grid_client_proxy import GridClientProxy

    from gaussdp.errors import InvalidParameter

    strategy = DPFedAvgStrategy(_server(), wait_timeout=5)
    params = ndarrays_to_parameters(_init())
    manager = SimpleClientManager()

    def register_later() -> None:
        for i in range(N):
            manager.register(GridClientProxy(i, None, 1))  # type: ignore[arg-type]

    late = threading.Timer(0.2, register_later)
    late.start()
    instructions = strategy.configure_fit(1, params, manager)
    late.join()
    assert 0 < len(instructions) <= N
    short = DPFedAvgStrategy(_server(), wait_timeout=0)
    with pytest.raises(InvalidParameter, match="Flower knows 0 clients"):
        short.configure_fit(1, params, SimpleClientManager())
