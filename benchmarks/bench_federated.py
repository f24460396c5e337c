"""Rounds per second of DP-FedAvg: gaussdp's in-process simulator vs the same run through Flower.

1,000 clients x 100,000-parameter updates (float32), every client sampled (q = 1), clip norm 1,
noise multiplier 1, the same seed on both sides so that the two runs must release the same models.

Flower's simulation (``flwr.simulation.start_simulation`` / ``run_simulation``) needs Ray, which is
not installed here: the Flower side is Flower's real legacy ``Server.fit`` with a
``SimpleClientManager``, ``GridClientProxy`` per client (FitIns <-> RecordDict <-> Message
serialisation), a ``ClientApp`` with its ``NumPyClient``, driven through an in-memory ``Grid``
(:func:`gaussdp.federated.flower.run_inprocess`), with :class:`DPFedAvgStrategy`. Ray's own start-up
(about 8 s measured on the issue author's machine) is therefore *not* included: the ratio printed
here is a lower bound on the gap to Flower's Ray simulation.

``--ray`` adds Flower's real simulation (``flwr.simulation.run_simulation``, Ray backend, one CPU per
ClientApp actor) when ``ray`` is importable (``pip install 'flwr[simulation]'``, never a dependency
of gaussdp); otherwise it says why it is skipped. Its clients read their update from a memory-mapped
copy of the same matrix (Flower pickles the ClientApp into every message sent to an actor). Its
start-up (Ray and the registration of the nodes, up to the first round) is reported apart from the
rounds; the first round also starts the actors, so the median of 3 or more rounds is the figure.
The simulation gives the nodes random ids, which the strategy sorts: the clients are summed in
another order, so the released models agree to float rounding, not bit for bit.

Run: ``.venv/bin/python benchmarks/bench_federated.py [--clients 1000 --params 100000 --rounds 3]
[--ray]``
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import statistics
import tempfile
import time
import warnings
from typing import Any

import numpy as np

from gaussdp.errors import NotPrivateWarning
from gaussdp.federated import DPFedAvg

SEED = 20261122


def _server(n: int, accountant: str) -> DPFedAvg:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)  # seeded on purpose: equal results
        return DPFedAvg(
            num_clients=n,
            sample_rate=1.0,
            noise_multiplier=1.0,
            clip_norm=1.0,
            ledger="memory://",
            epsilon=1e3,
            delta=1e-6,
            accountant=accountant,
            seed=SEED,
        )


def run_inprocess(deltas: np.ndarray, rounds: int, accountant: str) -> tuple[list[float], np.ndarray, float]:
    srv = _server(deltas.shape[0], accountant)
    params = np.zeros(deltas.shape[1], dtype=np.float32)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        res = srv.run_round(params, lambda g, ids: deltas[ids])
        params = params + res.update
        times.append(time.perf_counter() - t0)
    return times, params, srv.epsilon()


def run_flower(deltas: np.ndarray, rounds: int, accountant: str) -> tuple[list[float], np.ndarray, float]:
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import parameters_to_ndarrays

    from gaussdp.federated.flower import run_inprocess

    logging.getLogger("flwr").setLevel(logging.WARNING)

    class Client(NumPyClient):
        def __init__(self, cid: int) -> None:
            self.cid = cid

        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            return [parameters[0] + deltas[self.cid]], 1, {}

        def evaluate(self, parameters, config):  # type: ignore[no-untyped-def]
            return 0.0, 1, {}

    srv = _server(deltas.shape[0], accountant)
    strategy, stamps = _timed_strategy(srv, deltas.shape[1])
    app = ClientApp(client_fn=lambda context: Client(int(context.node_id)).to_client())
    run_inprocess(app, strategy, num_clients=deltas.shape[0], num_rounds=rounds)
    times = [stamps[2 * i + 1] - stamps[2 * i] for i in range(rounds)]
    params = parameters_to_ndarrays(strategy.parameters)[0]
    return times, params, srv.epsilon()


def _timed_strategy(srv: DPFedAvg, num_params: int, *, wait: bool = False) -> tuple[Any, list[float]]:
    """DPFedAvgStrategy whose rounds are timed from configure_fit to the end of aggregate_fit.

    ``wait``: first wait for every client to be registered (the simulation registers its nodes in the
    background), so that the wait counts as start-up, not as the first round.
    """
    from flwr.common import ndarrays_to_parameters
    from flwr.server.strategy import FedAvg

    from gaussdp.federated.flower import DPFedAvgStrategy

    init = ndarrays_to_parameters([np.zeros(num_params, dtype=np.float32)])
    strategy = DPFedAvgStrategy(srv, FedAvg(fraction_evaluate=0.0, initial_parameters=init))
    stamps: list[float] = []
    inner_aggregate = strategy.aggregate_fit
    inner_configure = strategy.configure_fit

    def configure_fit(server_round, parameters, client_manager):  # type: ignore[no-untyped-def]
        if wait:
            client_manager.wait_for(srv.num_clients)
        stamps.append(time.perf_counter())
        return inner_configure(server_round, parameters, client_manager)

    def aggregate_fit(*a, **k):  # type: ignore[no-untyped-def]
        out = inner_aggregate(*a, **k)
        stamps.append(time.perf_counter())
        return out

    strategy.configure_fit = configure_fit  # type: ignore[method-assign]
    strategy.aggregate_fit = aggregate_fit  # type: ignore[method-assign]
    return strategy, stamps


def run_ray(
    deltas: np.ndarray, rounds: int, accountant: str
) -> tuple[list[float], np.ndarray, float, float] | None:
    """Flower's ``run_simulation`` with the Ray backend; None (and why) when ray is not importable."""
    try:
        import ray  # noqa: F401
    except ImportError:
        print("Flower + Ray simulation     : skipped, ray is not importable (pip install 'flwr[simulation]')")
        return None
    from flwr.client import ClientApp, NumPyClient
    from flwr.common import parameters_to_ndarrays
    from flwr.server import ServerApp, ServerConfig
    from flwr.simulation import run_simulation

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "deltas.npy")
        np.save(path, deltas)

        class Client(NumPyClient):
            def __init__(self, pid: int) -> None:
                self.pid = pid

            def fit(self, parameters, config):  # type: ignore[no-untyped-def]
                return [parameters[0] + np.load(path, mmap_mode="r")[self.pid]], 1, {}

            def evaluate(self, parameters, config):  # type: ignore[no-untyped-def]
                return 0.0, 1, {}

        app = ClientApp(
            client_fn=lambda context: Client(int(context.node_config["partition-id"])).to_client()
        )
        srv = _server(deltas.shape[0], accountant)
        strategy, stamps = _timed_strategy(srv, deltas.shape[1], wait=True)
        t0 = time.perf_counter()
        run_simulation(
            server_app=ServerApp(config=ServerConfig(num_rounds=rounds), strategy=strategy),
            client_app=app,
            num_supernodes=deltas.shape[0],
            backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
        )
    times = [stamps[2 * i + 1] - stamps[2 * i] for i in range(rounds)]
    params = parameters_to_ndarrays(strategy.parameters)[0]
    return times, params, srv.epsilon(), stamps[0] - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--params", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--accountant", default="pld")
    ap.add_argument("--ray", action="store_true", help="also run Flower's Ray simulation (needs ray)")
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    deltas = rng.normal(scale=1.0 / np.sqrt(args.params), size=(args.clients, args.params)).astype(np.float32)
    deltas[::7] *= 3.0  # some updates above the clip norm
    print(
        f"DP-FedAvg, {args.clients} clients x {args.params:,} float32 parameters, q=1, z=1, C=1, "
        f"{args.rounds} rounds, {args.accountant} accountant"
    )
    t_in, p_in, eps_in = run_inprocess(deltas, args.rounds, args.accountant)
    gc.collect()
    t_fl, p_fl, eps_fl = run_flower(deltas, args.rounds, args.accountant)
    m_in, m_fl = statistics.median(t_in), statistics.median(t_fl)
    print(f"gaussdp in-process simulator : median {m_in:.3f} s/round = {1 / m_in:.2f} rounds/s  {t_in}")
    print(f"Flower (in-process Server)   : median {m_fl:.3f} s/round = {1 / m_fl:.2f} rounds/s  {t_fl}")
    print(f"ratio (in-process / Flower rounds/s): {m_fl / m_in:.1f}x")
    diff = float(np.max(np.abs(p_in - p_fl)))
    print(
        f"equal results: max |params_inprocess - params_flower| = {diff:.3g}; "
        f"epsilon in-process {eps_in:.6f}, Flower {eps_fl:.6f} (equal: {eps_in == eps_fl})"
    )
    if args.ray:
        gc.collect()
        ray_run = run_ray(deltas, args.rounds, args.accountant)
        if ray_run is not None:
            t_ray, p_ray, eps_ray, startup = ray_run
            m_ray = statistics.median(t_ray)
            print(
                f"Flower + Ray simulation     : median {m_ray:.3f} s/round = {1 / m_ray:.2f} rounds/s  "
                f"{t_ray}; start-up {startup:.1f} s"
            )
            print(f"ratio (in-process / Flower + Ray rounds/s): {m_ray / m_in:.1f}x")
            diff = float(np.max(np.abs(p_in - p_ray)))
            print(
                f"equal results: max |params_inprocess - params_ray| = {diff:.3g}; "
                f"epsilon Ray {eps_ray:.6f} (equal: {eps_in == eps_ray})"
            )


if __name__ == "__main__":
    main()
