"""DP-FedAvg on the digits task of ``examples/flower-digits``: throughput, and gaussdp vs Flower's own DP.

1. **Throughput**, 1,000 clients, 5 rounds, every client sampled (q = 1): gaussdp's in-process
   simulator (all clients vectorised) beside Flower's simulation runtime (``run_simulation``, Ray
   backend, one virtual SuperNode per client, :class:`DPFedAvgStrategy` in the ServerApp). Clients/s
   is the number of client updates trained, clipped and aggregated per second of rounds; the
   simulation's start-up (Ray, the actors, the nodes' registration) is printed apart.
2. **Side by side** with Flower's ``DifferentialPrivacyServerSideFixedClipping`` in the same
   simulation, on the same 1,000 clients, noise multiplier ``z`` and clip norm ``C``: gaussdp samples
   each client with probability ``q`` (Poisson) and divides by ``qN``; Flower samples ``m = qN``
   clients uniformly and divides by ``m``, so the noise on the average is ``z C / (qN)`` for both.
   Test accuracy after each round and the client-level epsilon each reports at the same delta:
   gaussdp's ledger (PLD, Poisson amplification accounted) and Flower's ``RdpAccountant`` (the only
   sampling model its fixed-clipping wrapper accepts is ``no-amplification``). A table and one PNG.

Both clients report ``num-examples`` and a unit weight: Flower's accounted mode requires equal
weights, gaussdp ignores the weights (fixed denominator).

Run: ``.venv/bin/python benchmarks/bench_federated.py [--clients 1000 --rounds 5 --compare-rounds 20
--out bench_federated.png]`` (needs ``ray``: ``pip install 'flwr[simulation]'``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from gaussdp.errors import NotPrivateWarning
from gaussdp.federated import DPFedAvg, FederatedSimulator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "flower-digits"))
from gaussdp_digits import task

DELTA = 1e-5
LOCAL = {"local_steps": 5, "learning_rate": 0.5}


def _server(n: int, q: float, z: float, c: float, rounds: int) -> DPFedAvg:
    return DPFedAvg(
        num_clients=n,
        sample_rate=q,
        noise_multiplier=z,
        clip_norm=c,
        ledger="memory://",
        epsilon=1e4,
        delta=DELTA,
        accountant="pld",
    )


def run_inprocess(n: int, rounds: int) -> tuple[float, int]:
    """Seconds of ``rounds`` rounds of the in-process simulator, and the client updates aggregated."""
    srv = _server(n, 1.0, 1.0, 1.0, rounds)
    sim = FederatedSimulator(srv, task.clients(n, **LOCAL), task.initial_flat())
    t0 = time.perf_counter()
    out = sim.run(rounds)
    return time.perf_counter() - t0, sum(r.answered for r in out)


def _client_app() -> Any:
    from flwr.app import Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        flat = task.to_flat(msg.content["arrays"])
        pid, n = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
        delta, count = task.local_update(flat, pid, n, **LOCAL)
        metrics = MetricRecord({"num-examples": count, "unit-weight": 1})
        return Message(RecordDict({"arrays": task.to_arrays(flat + delta), "metrics": metrics}), reply_to=msg)

    return app


def run_simulation(n: int, rounds: int, compare_rounds: int, q: float, z: float, c: float) -> dict[str, Any]:
    """One Flower simulation: the throughput rounds, then gaussdp's and Flower's DP strategies."""
    from flwr.app import ArrayRecord, Context, MetricRecord
    from flwr.serverapp import Grid, PrivacyConfig, RdpAccountant, ServerApp
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg
    from flwr.simulation import run_simulation as flower_run_simulation
    from flwr.supercore.privacy_accounting import NeighboringRelation, SamplingMethod

    from gaussdp.federated.flower import DPFedAvgStrategy

    out: dict[str, Any] = {"t0": time.perf_counter()}
    server_app = ServerApp()

    def accuracy(arrays: ArrayRecord) -> float:
        return task.test_accuracy(task.to_flat(arrays))

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        # 1. Throughput, q = 1 (the nodes' registration is waited for before the clock starts).
        while len(list(grid.get_node_ids())) < n:
            time.sleep(0.2)
        # One untimed round starts Ray's actors (and imports the task in them): start-up.
        DPFedAvgStrategy(_server(n, 1.0, 1.0, 1.0, 1)).start(
            grid, task.to_arrays(task.initial_flat()), num_rounds=1
        )
        out["startup"] = time.perf_counter() - out["t0"]
        fast = DPFedAvgStrategy(_server(n, 1.0, 1.0, 1.0, rounds))
        stamps = [time.perf_counter()]
        fast.start(
            grid,
            task.to_arrays(task.initial_flat()),
            num_rounds=rounds,
            evaluate_fn=lambda r, a: stamps.append(time.perf_counter()) if r > 0 else None,
        )
        out["sim_round_seconds"] = np.diff(stamps).tolist()
        out["sim_seconds"] = stamps[-1] - stamps[0]
        out["sim_updates"] = sum(r.answered for r in fast.rounds)

        # 2. gaussdp and Flower's DP strategy, same z and C, m = qN.
        ours = DPFedAvgStrategy(_server(n, q, z, c, compare_rounds))
        res = ours.start(
            grid,
            task.to_arrays(task.initial_flat()),
            num_rounds=compare_rounds,
            evaluate_fn=lambda r, a: MetricRecord({"accuracy": accuracy(a)}),
        )
        out["gaussdp_acc"] = [
            float(res.evaluate_metrics_serverapp[r]["accuracy"]) for r in range(1, compare_rounds + 1)
        ]
        out["gaussdp_eps"] = [float(m["epsilon"]) for m in res.train_metrics_clientapp.values()]

        m = round(q * n)
        flower_acc = RdpAccountant(
            PrivacyConfig(
                target_delta=DELTA,
                population_size=n,
                neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                sampling_method=SamplingMethod.NO_AMPLIFICATION,
            )
        )
        inner = FedAvg(
            fraction_train=m / n, fraction_evaluate=0.0, min_train_nodes=m, weighted_by_key="unit-weight"
        )
        theirs = DifferentialPrivacyServerSideFixedClipping(inner, z, c, m, accountant=flower_acc)
        eps: list[float] = []

        def evaluate(r: int, a: ArrayRecord) -> MetricRecord:
            if r > 0:
                eps.append(float(theirs.privacy_spent().epsilon))
            return MetricRecord({"accuracy": accuracy(a)})

        res = theirs.start(
            grid, task.to_arrays(task.initial_flat()), num_rounds=compare_rounds, evaluate_fn=evaluate
        )
        out["flower_acc"] = [
            float(res.evaluate_metrics_serverapp[r]["accuracy"]) for r in range(1, compare_rounds + 1)
        ]
        out["flower_eps"] = eps

    flower_run_simulation(
        server_app,
        _client_app(),
        num_supernodes=n,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    return out


def _plot(out: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = np.arange(1, len(out["gaussdp_acc"]) + 1)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(r, out["gaussdp_acc"], marker="o", label="gaussdp DPFedAvgStrategy")
    ax1.plot(r, out["flower_acc"], marker="s", label="Flower DifferentialPrivacyServerSideFixedClipping")
    ax1.set_xlabel("round")
    ax1.set_ylabel("test accuracy")
    ax1.legend(fontsize=8)
    ax2.plot(r, out["gaussdp_eps"], marker="o", label="gaussdp: ledger, PLD, Poisson amplification")
    ax2.plot(r, out["flower_eps"], marker="s", label="Flower: RdpAccountant, no amplification")
    ax2.set_xlabel("round")
    ax2.set_ylabel(f"client-level epsilon at delta={DELTA:g}")
    ax2.set_yscale("log")
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--compare-rounds", type=int, default=20)
    ap.add_argument("--sample-rate", type=float, default=0.1)
    ap.add_argument("--noise-multiplier", type=float, default=1.0)
    ap.add_argument("--clip-norm", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=Path("bench_federated.png"))
    args = ap.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)
    logging.getLogger("gaussdp").setLevel(logging.WARNING)
    warnings.simplefilter("ignore", NotPrivateWarning)

    n, rounds = args.clients, args.rounds
    print(f"digits, softmax regression, {n} clients (one partition each), z=1, C=1, q=1, {rounds} rounds")
    t_in, u_in = run_inprocess(n, rounds)
    print(
        f"gaussdp in-process simulator      : {u_in} updates in {t_in:.2f} s = {u_in / t_in:,.0f} clients/s"
    )
    try:
        import ray  # noqa: F401
    except ImportError:
        print("Flower simulation runtime: skipped, ray is not importable (pip install 'flwr[simulation]')")
        return
    q, z, c = args.sample_rate, args.noise_multiplier, args.clip_norm
    out = run_simulation(n, rounds, args.compare_rounds, q, z, c)
    t_sim, u_sim = out["sim_seconds"], out["sim_updates"]
    rate = u_sim / t_sim
    print(f"Flower simulation runtime (Ray)   : {u_sim} updates in {t_sim:.2f} s = {rate:,.0f} clients/s")
    per_round = ", ".join(f"{x:.2f}" for x in out["sim_round_seconds"])
    print(f"  (start-up {out['startup']:.1f} s apart: Ray, nodes, one untimed round; rounds {per_round} s)")
    print(f"ratio (in-process / simulation clients/s): {(u_in / t_in) / (u_sim / t_sim):.1f}x")

    m = round(q * n)
    print()
    print(
        f"gaussdp vs Flower's DifferentialPrivacyServerSideFixedClipping, {n} clients, z={z:g}, C={c:g}, "
        f"gaussdp q={q:g} (Poisson), Flower m={m} (uniform); epsilon at delta={DELTA:g}"
    )
    print(f"{'round':>5}  {'gaussdp acc':>11}  {'gaussdp eps':>11}  {'Flower acc':>10}  {'Flower eps':>10}")
    for i, (ga, ge, fa, fe) in enumerate(
        zip(out["gaussdp_acc"], out["gaussdp_eps"], out["flower_acc"], out["flower_eps"], strict=True), 1
    ):
        print(f"{i:>5}  {ga:>11.4f}  {ge:>11.4f}  {fa:>10.4f}  {fe:>10.4f}")
    _plot(out, args.out, f"digits, {n} clients, z={z:g}, C={c:g}, {m} clients per round (expected)")
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
