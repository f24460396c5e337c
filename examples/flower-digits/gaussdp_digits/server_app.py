"""The ServerApp: gaussdp's DP-FedAvg server behind Flower's Message-API strategy interface.

Every round: check the budget, Poisson-sample the nodes (OS entropy), clip, charge the ledger,
noise once, release with the fixed denominator qN. The ledger and the checkpoint make the run
resumable: start this ServerApp again (``flwr run`` with the same ``ledger``, ``run-name`` and
``checkpoint``) and it continues after the last round the ledger holds.
"""

from __future__ import annotations

import logging
import time

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from gaussdp.federated import DPFedAvg
from gaussdp.federated.flower import DPFedAvgStrategy
from gaussdp_digits import task

app = ServerApp()


def build_server(cfg: dict) -> DPFedAvg:
    """The gaussdp server of this run from the run config (also used by the in-process run)."""
    return DPFedAvg(
        num_clients=int(cfg["num-clients"]),
        sample_rate=float(cfg["sample-rate"]),
        noise_multiplier=float(cfg["noise-multiplier"]),
        clip_norm=float(cfg["clip-norm"]),
        ledger=str(cfg["ledger"]),
        run_id=str(cfg["run-name"]),
        epsilon=float(cfg["target-epsilon"]),
        delta=float(cfg["target-delta"]),
        accountant=str(cfg["accountant"]),
    )


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = dict(context.run_config)
    logging.getLogger("gaussdp").setLevel(logging.INFO)
    server = build_server(cfg)
    strategy = DPFedAvgStrategy(server, server_lr=float(cfg["server-lr"]), checkpoint=str(cfg["checkpoint"]))
    pause = float(cfg["round-pause-s"])
    print(f"run {cfg['run-name']!r}: rounds in the ledger: {server.rounds_done}", flush=True)

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        acc = task.test_accuracy(task.to_flat(arrays))
        eps, delta = server.epsilon(), server.ledger.delta
        print(
            f"round {server_round}: test accuracy {acc:.4f}, epsilon {eps:.4f} at delta {delta:g}", flush=True
        )
        if server_round > 0 and pause > 0:
            time.sleep(pause)
        return MetricRecord({"accuracy": acc, "epsilon": eps})

    strategy.start(
        grid,
        task.to_arrays(task.initial_flat()),
        num_rounds=int(cfg["num-server-rounds"]),
        evaluate_fn=evaluate,
    )
    if strategy.stopped:
        print(f"stopped: {strategy.stopped}", flush=True)
    print(
        f"done: {server.rounds_done} rounds, epsilon {server.epsilon():.4f} at delta {server.ledger.delta:g}",
        flush=True,
    )
