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

Run: ``.venv/bin/python benchmarks/bench_federated.py [--clients 1000 --params 100000 --rounds 3]``
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import time
import warnings

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
    from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg

    from gaussdp.federated.flower import DPFedAvgStrategy, run_inprocess

    logging.getLogger("flwr").setLevel(logging.WARNING)

    class Client(NumPyClient):
        def __init__(self, cid: int) -> None:
            self.cid = cid

        def fit(self, parameters, config):  # type: ignore[no-untyped-def]
            return [parameters[0] + deltas[self.cid]], 1, {}

        def evaluate(self, parameters, config):  # type: ignore[no-untyped-def]
            return 0.0, 1, {}

    srv = _server(deltas.shape[0], accountant)
    init = ndarrays_to_parameters([np.zeros(deltas.shape[1], dtype=np.float32)])
    strategy = DPFedAvgStrategy(srv, FedAvg(fraction_evaluate=0.0, initial_parameters=init))
    app = ClientApp(client_fn=lambda context: Client(int(context.node_id)).to_client())
    stamps: list[float] = []
    inner_aggregate = strategy.aggregate_fit
    inner_configure = strategy.configure_fit

    def configure_fit(*a, **k):  # type: ignore[no-untyped-def]
        stamps.append(time.perf_counter())
        return inner_configure(*a, **k)

    def aggregate_fit(*a, **k):  # type: ignore[no-untyped-def]
        out = inner_aggregate(*a, **k)
        stamps.append(time.perf_counter())
        return out

    strategy.configure_fit = configure_fit  # type: ignore[method-assign]
    strategy.aggregate_fit = aggregate_fit  # type: ignore[method-assign]
    run_inprocess(app, strategy, num_clients=deltas.shape[0], num_rounds=rounds)
    times = [stamps[2 * i + 1] - stamps[2 * i] for i in range(rounds)]
    params = parameters_to_ndarrays(strategy.parameters)[0]
    return times, params, srv.epsilon()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--params", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--accountant", default="pld")
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


if __name__ == "__main__":
    main()
