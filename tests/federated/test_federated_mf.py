"""DP-FTRL / banded MF for federated learning: the server in process, and on Flower's simulation runtime."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from gaussdp.accounting import accountant
from gaussdp.errors import InvalidParameter, UnsafeInput
from gaussdp.federated.mf import BandedMFServer
from gaussdp.federated.rounds import round_of
from gaussdp.mf import toeplitz_matrix

pytestmark = pytest.mark.filterwarnings("ignore::gaussdp.errors.NotPrivateWarning")

N, M, P = 20, 4, 16  # 5 rounds per epoch


def _server(ledger="memory://", **kw) -> BandedMFServer:
    args = dict(
        num_clients=N,
        clients_per_round=M,
        num_rounds=12,
        bands=3,
        noise_multiplier=2.0,
        clip_norm=1.0,
        ledger=ledger,
        epsilon=100.0,
        delta=1e-5,
        noise="fast",
    )
    args.update(kw)
    return BandedMFServer(**args)


def _deltas() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(N, P))


def _mf_epsilon(srv: BandedMFServer, rounds: int) -> float:
    return accountant("pld").compose(srv.plan.event(srv.noise_multiplier, upto=rounds)).epsilon(1e-5)


def test_each_round_charged_once_and_epsilon_equals_the_mf_accountant():
    srv = _server()
    params = np.zeros(P)
    for r in range(1, 13):
        res = srv.run_round(params, lambda g, ids: _deltas()[ids])
        params = params + res.update
        want = _mf_epsilon(srv, r)
        assert want <= res.epsilon == pytest.approx(want, rel=1e-12)
    rounds = [round_of(c.idempotency_key) for c in srv.ledger.ledger.history(srv.ledger.principal)]
    assert sorted(rounds) == list(range(1, 13))
    # the whole run: the existing accounting of the same strategy, 3 participations 5 rounds apart
    from gaussdp.accounting import banded_matrix_factorization_event

    whole = banded_matrix_factorization_event(
        2.0, toeplitz_matrix(srv.plan.coefficients, 12), bands=3, min_separation=5, max_participations=3
    )
    assert srv.epsilon() == pytest.approx(accountant("pld").compose(whole).epsilon(1e-5), rel=1e-12)
    with pytest.raises(InvalidParameter, match="outside the planned run"):
        srv.begin_round()


def test_each_client_once_per_epoch_of_rounds():
    srv = _server()
    seen = [srv.clients_of_round(r) for r in range(1, 6)]
    assert sorted(np.concatenate(seen).tolist()) == list(range(N))
    np.testing.assert_array_equal(srv.clients_of_round(6), seen[0])
    plan = srv.begin_round()
    with pytest.raises(UnsafeInput, match="without being its clients"):
        srv.finish_round(plan, _deltas()[[0, 5]], [0, 5])
    assert srv.rounds_done == 0  # refused before the charge


def test_bands_past_the_rounds_per_epoch_refused():
    with pytest.raises(InvalidParameter, match=r"bands must be <= the rounds per epoch .* = 5\)"):
        _server(bands=6)


def test_a_restarted_server_continues_from_the_ledger(tmp_path):
    url = f"sqlite:///{tmp_path / 'run.db'}"
    first = _server(url)
    for _ in range(4):
        first.run_round(np.zeros(P), lambda g, ids: _deltas()[ids])
    second = _server(url)  # a new process: the noise buffer starts afresh, the ledger continues
    assert second.rounds_done == 4
    for r in range(5, 9):
        res = second.run_round(np.zeros(P), lambda g, ids: _deltas()[ids])
        assert res.round_num == r
        assert res.epsilon == pytest.approx(_mf_epsilon(second, r), rel=1e-12)


def test_updates_carry_the_strategys_correlated_noise():
    """Zero deltas: the released sums are the noise; whitened by C they are iid N(0, (zC)^2)."""
    srv = _server(num_clients=200, clients_per_round=40, num_rounds=5, bands=3)
    srv.num_params = 50_000
    ys = [
        srv.run_round(np.zeros(1), lambda g, ids: None, dropout=lambda ids: ids < 0).update for _ in range(5)
    ]
    y = np.stack(ys) * 40 / 2.0  # back to the sum, in units of zC
    w = toeplitz_matrix(srv.plan.coefficients, 5) @ y
    emp = w @ w.T / w.shape[1]
    assert np.all(np.abs(emp - np.eye(5)) < 6 * np.sqrt(2 / w.shape[1]))
    assert (y @ y.T / y.shape[1])[1, 0] < -0.1  # correlated, not DP-FedAvg's independent noise


@pytest.mark.slow
def test_dpftrl_strategy_on_flowers_simulation_runtime():
    pytest.importorskip("ray", reason="Flower's simulation runtime needs Ray")
    from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from gaussdp.federated.flower import DPFTRLStrategy

    nodes, rounds = 8, 6
    logging.getLogger("flwr").setLevel(logging.WARNING)
    client = ClientApp()

    @client.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        w = msg.content["arrays"]["w"].numpy() + np.random.default_rng(pid).normal(size=P).astype(np.float32)
        content = RecordDict({"arrays": ArrayRecord({"w": Array(w)}), "metrics": MetricRecord({"n": 1})})
        return Message(content=content, reply_to=msg)

    out: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        srv = _server(num_clients=nodes, clients_per_round=2, num_rounds=rounds, bands=2)
        strategy = DPFTRLStrategy(srv)
        init = ArrayRecord({"w": Array(np.zeros(P, dtype=np.float32))})
        out["result"] = strategy.start(grid, init, num_rounds=rounds, timeout=120)
        out["server"], out["strategy"] = srv, strategy

    run_simulation(
        server_app,
        client,
        num_supernodes=nodes,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 2}},
    )
    srv, strategy = out["server"], out["strategy"]
    assert srv.rounds_done == rounds
    assert [r.answered for r in strategy.rounds] == [2] * rounds
    assert srv.epsilon() == pytest.approx(_mf_epsilon(srv, rounds), rel=1e-12)
    rows = [round_of(c.idempotency_key) for c in srv.ledger.ledger.history(srv.ledger.principal)]
    assert sorted(rows) == list(range(1, rounds + 1))


def test_the_strategy_says_what_it_waits_for(caplog):
    """A Grid with fewer nodes than the population: the ServerApp reports the wait (not silent)."""
    pytest.importorskip("flwr")
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from gaussdp.federated.flower import DPFTRLStrategy

    strategy = DPFTRLStrategy(_server(), wait_timeout=1.5)
    strategy.report_every = 0.5
    init = ArrayRecord({"w": Array(np.zeros(P, dtype=np.float32))})
    with caplog.at_level(logging.WARNING, logger="gaussdp"), pytest.raises(InvalidParameter, match="20"):
        strategy.configure_train(1, init, ConfigRecord(), _nodes(range(7)))
    waits = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
    assert len(waits) >= 2
    assert "waiting for 20 SuperNodes to connect to the SuperLink: 7 connected" in waits[0]


def _nodes(ids):
    """A Grid stub that only lists its nodes (for the checks that need no message exchange)."""
    from flwr.serverapp import Grid

    class _Nodes(Grid):
        def __init__(self, nodes):
            self.nodes = list(nodes)

        def get_node_ids(self):
            return self.nodes

        def set_run(self, run):  # pragma: no cover - not used
            raise NotImplementedError

        @property
        def run(self):  # pragma: no cover - not used
            raise NotImplementedError

        def create_message(self, *a, **k):  # pragma: no cover - not used
            raise NotImplementedError

        def push_messages(self, *a, **k):  # pragma: no cover - not used
            raise NotImplementedError

        def pull_messages(self, *a, **k):  # pragma: no cover - not used
            raise NotImplementedError

        def send_and_receive(self, *a, **k):  # pragma: no cover - not used
            raise NotImplementedError

    return _Nodes(ids)


def test_a_superlink_error_reply_is_a_dropout(monkeypatch):
    """After a SuperLink restart, the SuperLink answers for a node it holds unavailable, with its own
    node id (1): that is a dropout, not a reply from a node outside the round."""
    pytest.importorskip("flwr")
    from flwr.app import Array, ArrayRecord, ConfigRecord, Metadata
    from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message
    from flwr.supercore.task_identity import TaskIdentity

    from gaussdp.federated.flower import DPFTRLStrategy

    for name, value in (("_run_id", 7), ("_node_id", 1), ("_task_id", 3)):  # what a ServerApp process has
        monkeypatch.setattr(TaskIdentity, name, value, raising=False)
    strategy = DPFTRLStrategy(_server(), wait_timeout=0)
    init = ArrayRecord({"w": Array(np.zeros(P, dtype=np.float32))})
    messages = list(strategy.configure_train(1, init, ConfigRecord(), _nodes(range(100, 100 + N))))
    assert len(messages) == M
    ins = Metadata(
        run_id=7,
        message_id="m1",
        src_node_id=1,
        dst_node_id=int(messages[0].metadata.dst_node_id),
        reply_to_message_id="",
        group_id="1",
        created_at=time.time(),
        ttl=600.0,
        message_type="train",
    )
    reply = create_message_error_unavailable_res_message(ins, "node_unavail")
    assert int(reply.metadata.src_node_id) == 1 and reply.has_error()
    _, metrics = strategy.aggregate_train(1, [reply])
    assert metrics["answered"] == 0 and strategy.server.rounds_done == 1


def test_a_restart_with_other_parameters_is_refused(tmp_path):
    from gaussdp.errors import PrivacyError

    url = f"sqlite:///{tmp_path / 'run.db'}"
    first = _server(url)
    for _ in range(3):
        first.run_round(np.zeros(P), lambda g, ids: _deltas()[ids])
    with pytest.raises(PrivacyError, match="not the same run"):
        _server(url, noise_multiplier=3.0).begin_round()
    with pytest.raises(PrivacyError, match="not the same run"):
        _server(url, bands=2).begin_round()
    assert _server(url).begin_round().round_num == 4
