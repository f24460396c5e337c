"""The same task in gaussdp's in-process simulator, no Flower runtime: ``python -m gaussdp_digits.inprocess``.

Reads the run config of ``pyproject.toml`` (``key=value`` arguments override it, as
``flwr run --run-config`` does) and runs the same server (``server_app.build_server``) with all
clients vectorised (:class:`gaussdp.federated.FederatedSimulator`).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

from gaussdp.federated import FederatedSimulator
from gaussdp_digits import task
from gaussdp_digits.server_app import build_server


def run_config(overrides: list[str] | None = None) -> dict[str, Any]:
    """The ``[tool.flwr.app.config]`` of this app, with ``key=value`` (TOML values) overrides."""
    path = Path(__file__).resolve().parent.parent / "pyproject.toml"
    cfg = dict(tomllib.loads(path.read_text())["tool"]["flwr"]["app"]["config"])
    for item in overrides or []:
        key, _, value = item.partition("=")
        if key not in cfg:
            raise KeyError(f"{key!r} is not in the run config of {path}")
        cfg[key] = tomllib.loads(f"v = {value}")["v"]
    return cfg


def run(cfg: dict[str, Any]) -> FederatedSimulator:
    n = int(cfg["num-clients"])
    server = build_server(cfg)
    clients = task.clients(n, local_steps=int(cfg["local-steps"]), learning_rate=float(cfg["learning-rate"]))
    sim = FederatedSimulator(
        server,
        clients,
        task.initial_flat(),
        server_lr=float(cfg["server-lr"]),
        evaluate=lambda p: {"accuracy": task.test_accuracy(p)},
    )
    remaining = int(cfg["num-server-rounds"]) - server.rounds_done
    for r in sim.run(max(0, remaining)):
        print(f"round {r.round_num}: test accuracy {r.metrics['accuracy']:.4f}, epsilon {r.epsilon:.4f}")
    if sim.stopped:
        print(f"stopped: {sim.stopped}")
    return sim


if __name__ == "__main__":
    run(run_config(sys.argv[1:]))
