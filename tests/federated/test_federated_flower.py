"""gaussdp's Message-API strategy and mods on Flower's own runtimes.

The strategy is driven by Flower's simulation runtime (``flwr.simulation.run_simulation``, Ray
backend: a real ``ServerApp``, ``Grid`` and ``ClientApp`` with its mods, messages and replies) and
compared with gaussdp's in-process simulator. The deployment runtime (SuperLink and SuperNodes as
processes, ``flwr run``) is tested in ``test_flower_deployment.py``. Checks that need no message
(the budget stop, resuming, the population check, checkpoints) run without a runtime.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from gaussdp.accounting import GaussianEvent, SubsampledGaussianEvent, accountant
from gaussdp.budget import Ledger
from gaussdp.errors import InvalidParameter, PrivacyError
from gaussdp.federated import DPFedAvg, LocalGaussian
from gaussdp.federated.flower import (
    KEY_CLIPPING_NORM,
    DPFedAvgStrategy,
    load_checkpoint,
    local_dp_mod,
    save_checkpoint,
)

pytestmark = pytest.mark.filterwarnings("ignore::gaussdp.errors.NotPrivateWarning")

N, P = 12, 16
SHAPES = {"w": (3, 4), "b": (4,)}
DROPPED = {3, 7}  # these nodes crash (an error reply)
MALFORMED = {5}  # this node answers with arrays under other keys
LOST = DROPPED | MALFORMED  # dropouts, for the server


def _deltas() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(N, P)).astype(np.float32)


def _init() -> ArrayRecord:
    return ArrayRecord({k: Array(np.zeros(s, dtype=np.float32)) for k, s in SHAPES.items()})


def _flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([a.reshape(-1) for a in arrays.to_numpy_ndarrays()])


def _server(**kw) -> DPFedAvg:
    args = dict(
        num_clients=N,
        sample_rate=1.0,
        noise_multiplier=1.0,
        clip_norm=1.0,
        ledger="memory://",
        epsilon=50.0,
        delta=1e-5,
        accountant="rdp",
        noise="fast",
        seed=7,
    )
    args.update(kw)
    return DPFedAvg(**args)


def _client_app(mods=(), malformed=MALFORMED) -> ClientApp:
    app = ClientApp(mods=list(mods))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        pid = int(context.node_config["partition-id"])
        if pid in DROPPED:
            raise RuntimeError("client crashed")  # an error reply: a dropout
        arrays = msg.content["arrays"]
        assert msg.content["config"][KEY_CLIPPING_NORM] > 0
        flat = _flat(arrays) + _deltas()[pid]
        out, start = {}, 0
        for k, s in SHAPES.items():
            n = int(np.prod(s))
            out[k if pid not in malformed else f"other-{k}"] = Array(flat[start : start + n].reshape(s))
            start += n
        content = RecordDict({"arrays": ArrayRecord(out), "metrics": MetricRecord({"num-examples": 1})})
        return Message(content=content, reply_to=msg)

    return app


def _simulate(make_server, rounds: int, mods=(), malformed=MALFORMED) -> dict:
    pytest.importorskip("ray", reason="Flower's simulation runtime needs Ray: pip install 'flwr[simulation]'")
    from flwr.simulation import run_simulation

    logging.getLogger("flwr").setLevel(logging.WARNING)
    out: dict = {}
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        srv = make_server()
        strategy = DPFedAvgStrategy(srv)
        out["result"] = strategy.start(grid, _init(), num_rounds=rounds, timeout=120)
        out["server"], out["strategy"] = srv, strategy

    run_simulation(
        server_app,
        _client_app(mods, malformed),
        num_supernodes=N,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 2}},
    )
    assert "strategy" in out, "the ServerApp did not finish"
    return out


def _inprocess(rounds: int, lost=LOST, **kw):
    srv = _server(**kw)
    params = np.zeros(P, dtype=np.float32)
    deltas = _deltas()
    for _ in range(rounds):
        res = srv.run_round(params, lambda g, ids: deltas[ids], dropout=lambda ids: ~np.isin(ids, list(lost)))
        params = params + res.update
    return srv, params


@pytest.mark.slow
def test_simulation_runtime_equals_the_inprocess_simulator_and_stops_at_the_budget() -> None:
    # q = 1: every node is sampled, so the clipped sum does not depend on which node is client i,
    # and the seeded noise of each round is the in-process simulator's. The budget fits 3 rounds.
    budget = accountant("rdp").compose(GaussianEvent(1.0), 3).epsilon(1e-5) * 1.0001
    out = _simulate(lambda: _server(epsilon=budget), rounds=5)
    srv_i, params_i = _inprocess(3)
    strategy, srv = out["strategy"], out["server"]
    assert srv.rounds_done == 3 and "stopping before round 4" in strategy.stopped
    # The crashed and the malformed nodes were dropouts: zero contribution, the rounds still counted.
    assert [r.answered for r in strategy.rounds] == [N - len(LOST)] * 3
    np.testing.assert_allclose(_flat(out["result"].arrays), params_i, rtol=1e-5, atol=1e-6)
    assert srv.epsilon() == srv_i.epsilon() <= budget
    eps = [m["epsilon"] for m in out["result"].train_metrics_clientapp.values()]
    assert eps == sorted(eps) and eps[-1] == pytest.approx(srv.epsilon())


@pytest.mark.slow
def test_local_dp_mod_charges_each_client_in_its_own_principal(tmp_path) -> None:
    # The ClientApps run in Ray's worker processes: the clients' ledger is a SQLite file.
    url = f"sqlite:///{tmp_path / 'clients.db'}"

    def local() -> LocalGaussian:  # built in the worker: a ledger is opened, never pickled
        return LocalGaussian(
            clip_norm=1.0,
            noise_multiplier=2.0,
            ledger=url,
            budget_epsilon=10.0,
            budget_delta=1e-5,
            accountant="rdp",
            noise="fast",
        )

    out = _simulate(lambda: _server(sample_rate=0.5), rounds=2, mods=[local_dp_mod(local)])
    led = Ledger(url)
    answered = sum(r.answered for r in out["strategy"].rounds)
    principals = led.principals("client/")
    assert sum(len(led.history(p)) for p in principals) == answered > 0
    assert {int(p.split("/")[1]) for p in principals} <= set(range(N)) - LOST
    for p in principals:
        keys = [r.idempotency_key for r in led.history(p)]
        assert len(keys) == len(set(keys))  # at most one charge per round


@pytest.mark.slow
def test_flowers_adaptiveclipping_mod_gives_the_server_the_bits_of_the_true_norms() -> None:
    # Flower's mod clips on the client and reports whether it clipped (norm_bit); the strategy turns
    # that bit into the server's adaptive-clipping bit. With q = 1 and the same seed, the clip-norm
    # trajectory and the model equal the in-process run, where the server sees the true norms.
    from flwr.clientapp.mod import adaptiveclipping_mod

    from gaussdp.federated import AdaptiveClipping

    def adaptive() -> AdaptiveClipping:
        return AdaptiveClipping(
            initial_clip_norm=4.0, target_quantile=0.5, learning_rate=0.2, count_stddev=2.0
        )

    # No malformed node here: Flower 1.42's mods answer a malformed reply with an error message
    # built as a reply to the reply; the server did not receive it in this runtime (the round
    # then waits for send_and_receive's timeout).
    out = _simulate(
        lambda: _server(adaptive=adaptive()), rounds=3, mods=[adaptiveclipping_mod], malformed=set()
    )
    srv_i, params_i = _inprocess(3, lost=DROPPED, adaptive=adaptive())
    clip_f = [r.clip_norm for r in out["strategy"].rounds] + [out["server"].clip_norm]
    clip_i = [r.clip_norm for r in srv_i.history] + [srv_i.clip_norm]
    assert clip_f == pytest.approx(clip_i, rel=1e-12) and len(set(clip_i)) == 4  # it moved every round
    np.testing.assert_allclose(_flat(out["result"].arrays), params_i, rtol=1e-5, atol=1e-6)


# -- without a runtime: nothing here creates a message ---------------------------------------------------


class _NodesOnly(Grid):
    """A Grid stub for the checks that stop before any message is created."""

    def __init__(self, nodes: Iterable[int]) -> None:
        self.nodes = list(nodes)

    def set_run(self, run):  # pragma: no cover - not used
        raise NotImplementedError

    @property
    def run(self):  # pragma: no cover - not used
        raise NotImplementedError

    def create_message(self, *a, **k):  # pragma: no cover - not used
        raise NotImplementedError

    def get_node_ids(self) -> Iterable[int]:
        return list(self.nodes)

    def get_nodes(self):  # pragma: no cover - not used
        raise NotImplementedError

    def push_messages(self, messages):  # pragma: no cover - not used
        raise NotImplementedError

    def pull_messages(self, message_ids):  # pragma: no cover - not used
        raise NotImplementedError

    def send_and_receive(self, messages, *, timeout=None):
        raise AssertionError("no message may be sent")


def test_a_round_past_the_budget_is_never_configured() -> None:
    one = accountant("rdp").compose(SubsampledGaussianEvent(1.0, 0.5), 1).epsilon(1e-5)
    strategy = DPFedAvgStrategy(_server(sample_rate=0.5, epsilon=one * 0.99))
    result = strategy.start(_NodesOnly(range(N)), _init(), num_rounds=3)
    assert strategy.stopped and "stopping before round 1" in strategy.stopped
    assert strategy.server.rounds_done == 0 and not result.train_metrics_clientapp


def test_the_population_must_be_the_servers() -> None:
    strategy = DPFedAvgStrategy(_server(), wait_timeout=0)
    with pytest.raises(InvalidParameter, match="num_clients=12 but the Grid has 5 nodes"):
        strategy.configure_train(1, _init(), ConfigRecord(), _NodesOnly(range(5)))


def test_checkpoint_round_trip(tmp_path) -> None:
    arrays = ArrayRecord({"w": Array(np.arange(6, dtype=np.float32).reshape(2, 3)), "b": Array(np.ones(3))})
    path = tmp_path / "ck.npz"
    assert load_checkpoint(path) is None
    save_checkpoint(path, round_num=4, arrays=arrays, clip_norm=0.25)
    r, back, c = load_checkpoint(path)
    assert (r, c, list(back.keys())) == (4, 0.25, ["w", "b"])
    for a, b in zip(arrays.to_numpy_ndarrays(), back.to_numpy_ndarrays(), strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    assert [p.name for p in tmp_path.iterdir()] == ["ck.npz"]  # no temporary file left


def _charged(url: str, rounds: int) -> np.ndarray:
    srv = _server(ledger=url, sample_rate=0.5)
    params = np.zeros(P, dtype=np.float32)
    for _ in range(rounds):
        params = params + srv.run_round(params, lambda g, ids: _deltas()[ids]).update
    return params


def test_start_resumes_from_the_ledger_and_the_checkpoint(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'run.db'}"
    _charged(url, 2)
    saved = ArrayRecord({k: Array(np.full(s, 0.5, dtype=np.float32)) for k, s in SHAPES.items()})
    ck = tmp_path / "ck.npz"
    # The ledger holds 2 rounds and no checkpoint says which model they made: refused.
    with pytest.raises(PrivacyError, match=r"holds 2 rounds .* no checkpoint"):
        DPFedAvgStrategy(_server(ledger=url, sample_rate=0.5), checkpoint=ck).start(
            _NodesOnly(range(N)), _init(), num_rounds=2
        )
    save_checkpoint(ck, round_num=2, arrays=saved, clip_norm=0.75)
    strategy = DPFedAvgStrategy(_server(ledger=url, sample_rate=0.5), checkpoint=ck)
    result = strategy.start(_NodesOnly(range(N)), _init(), num_rounds=2)  # all rounds done: none runs
    np.testing.assert_array_equal(_flat(result.arrays), 0.5)
    assert strategy.server.clip_norm == 0.75 and strategy.server.rounds_done == 2
    # A checkpoint from another run (ahead of the ledger, or two rounds behind) is refused.
    for r in (3, 0):
        save_checkpoint(ck, round_num=r, arrays=saved, clip_norm=1.0)
        with pytest.raises(PrivacyError, match="belong to different runs"):
            DPFedAvgStrategy(_server(ledger=url, sample_rate=0.5), checkpoint=ck).start(
                _NodesOnly(range(N)), _init(), num_rounds=3
            )


def test_a_round_charged_but_not_saved_stays_spent(tmp_path, caplog) -> None:
    url = f"sqlite:///{tmp_path / 'run.db'}"
    _charged(url, 2)
    ck = tmp_path / "ck.npz"
    save_checkpoint(ck, round_num=1, arrays=_init(), clip_norm=1.0)
    strategy = DPFedAvgStrategy(_server(ledger=url, sample_rate=0.5), checkpoint=ck)
    with caplog.at_level(logging.WARNING, logger="gaussdp.federated.flower"):
        strategy.start(_NodesOnly(range(N)), _init(), num_rounds=2)
    assert "round 2 was charged but its model was not saved" in caplog.text
    assert strategy.server.rounds_done == 2  # never charged again


def test_the_strategy_and_the_mod_take_gaussdp_objects() -> None:
    with pytest.raises(TypeError, match="DPFedAvg"):
        DPFedAvgStrategy(object())
    with pytest.raises(TypeError, match="LocalGaussian"):
        local_dp_mod(object())
