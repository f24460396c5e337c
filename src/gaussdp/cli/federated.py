"""``gaussdp federated-demo``: DP-FedAvg on 100 simulated clients (scikit-learn's digits, non-IID).

Each client holds the images of (mostly) two digits; every round the server Poisson-samples clients,
some drop out, the sampled ones train softmax regression locally, and the server clips, noises once,
divides by the fixed expected number of clients, with adaptive clipping, and charges each round to a
SQLite ledger before releasing it. It prints the client-level epsilon after every round and stops,
with the ledger's message, before a round that would exceed the budget. A PNG shows accuracy and
epsilon over rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer

from gaussdp._extras import require_extra
from gaussdp.cli._output import JSON_PRECISION


@dataclass
class DemoResult:
    rounds: list[Any]
    stopped: str | None
    epsilon: float
    delta: float
    accuracy: float
    png: Path | None
    ledger_url: str
    resumed_rounds: int
    report_rounds: int


def run_demo(
    *,
    num_clients: int = 100,
    rounds: int = 40,
    sample_rate: float = 0.6,
    noise_multiplier: float = 2.5,
    target_epsilon: float = 6.0,
    delta: float = 1e-4,
    dropout_rate: float = 0.1,
    accountant: str = "pld",
    out_dir: Path = Path("demo_out"),
    on_round: Any = None,
    plot: bool = True,
) -> DemoResult:
    """Run the demo; returns what it printed (for tests and the ``demo`` section)."""
    import numpy as np
    from sklearn.datasets import load_digits

    from gaussdp.federated import (
        AdaptiveClipping,
        DPFedAvg,
        FederatedSimulator,
        SoftmaxRegressionClients,
        shard_split,
        softmax_accuracy,
    )

    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    split = np.random.default_rng(0)  # the data split is not a privacy mechanism: fixed for the demo
    perm = split.permutation(len(y))
    test, train = perm[:360], perm[360:]
    parts = [train[p] for p in shard_split(y[train], num_clients, 2, rng=split)]
    clients = SoftmaxRegressionClients(X, y, parts, 10, local_steps=10, learning_rate=0.5)

    out_dir.mkdir(parents=True, exist_ok=True)
    db = out_dir / "federated_ledger.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)  # a fresh run; the ledger would otherwise resume
    url = f"sqlite:///{db.resolve()}"
    m = sample_rate * num_clients

    def make_server() -> DPFedAvg:
        return DPFedAvg(
            num_clients=num_clients,
            sample_rate=sample_rate,
            noise_multiplier=noise_multiplier,
            adaptive=AdaptiveClipping(initial_clip_norm=1.0, target_quantile=0.5, count_stddev=m / 20),
            ledger=url,
            run_id="digits-demo",
            epsilon=target_epsilon,
            delta=delta,
            accountant=accountant,
        )

    server = make_server()

    def evaluate(params: Any) -> dict[str, float]:
        return {"accuracy": softmax_accuracy(params, X[test], y[test], 10)}

    sim = FederatedSimulator(
        server,
        clients,
        clients.init_params(),
        dropout_rate=dropout_rate,
        evaluate=evaluate,
        rng=np.random.default_rng(1),
    )
    sim.run(rounds, callback=on_round)
    # A restarted server on the same ledger URL sees the same rounds and budget.
    resumed = make_server()
    # the federated anomaly detector's PrivacyTracker report, from the ledger's records
    report = resumed.ledger.report()
    png = _plot(sim.rounds, out_dir / "federated.png", target_epsilon, delta) if plot else None
    last = sim.rounds[-1] if sim.rounds else None
    return DemoResult(
        rounds=sim.rounds,
        stopped=sim.stopped,
        epsilon=server.epsilon(),
        delta=delta,
        accuracy=last.metrics["accuracy"] if last else float("nan"),
        png=png,
        ledger_url=url,
        resumed_rounds=resumed.rounds_done,
        report_rounds=len(report["expenditures_by_round"]),
    )


def _plot(rounds: list[Any], path: Path, budget: float, delta: float) -> Path:
    require_extra("plot", feature="the federated plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gaussdp._format import format_exact

    r = [x.round_num for x in rounds]
    fig, ax1 = plt.subplots(figsize=(7, 4))
    ax1.plot(r, [x.metrics["accuracy"] for x in rounds], color="tab:blue", marker=".")
    ax1.set_xlabel("round")
    ax1.set_ylabel("test accuracy", color="tab:blue")
    ax1.set_ylim(0, 1)
    ax2 = ax1.twinx()
    ax2.plot(r, [x.epsilon for x in rounds], color="tab:red", marker=".")
    ax2.axhline(budget, color="tab:red", linestyle=":", linewidth=1)
    ax2.set_ylabel(f"client-level epsilon (delta={format_exact(delta)})", color="tab:red")
    ax1.set_title("DP-FedAvg, 100 clients, digits (non-IID)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _print_round(console: Any) -> Any:
    from gaussdp._format import format_upper

    def show(r: Any) -> None:
        console.print(
            f"round {r.round_num:>3}: {r.answered:>3}/{r.sampled:<3} clients answered, "
            f"clip norm {r.clip_norm:.3f}, accuracy {r.metrics['accuracy']:.3f}, "
            f"epsilon {format_upper(r.epsilon, 4)}"
        )

    return show


def _summary(console: Any, res: DemoResult, budget: float) -> None:
    from gaussdp._format import format_exact, format_upper

    if res.stopped:
        console.print(f"[yellow]stopped:[/yellow] {res.stopped}")
    console.print(
        f"{len(res.rounds)} rounds, test accuracy {res.accuracy:.3f}; client-level "
        f"(epsilon={format_upper(res.epsilon, 4)}, delta={format_exact(res.delta)})-DP (budget "
        f"epsilon={format_exact(budget)}), Poisson "
        "sampling amplification accounted"
    )
    console.print(
        f"ledger {res.ledger_url}: a restarted server resumes at round {res.resumed_rounds + 1}; "
        f"the federated anomaly detector's report groups {res.report_rounds} rounds"
    )
    if res.png is not None:
        console.print(f"plot: {res.png}")


def register(app: typer.Typer) -> None:
    app.command("federated-demo")(federated_demo)


class LedgerAccountant(StrEnum):
    pld = "pld"
    rdp = "rdp"


def federated_demo(
    rounds: int = typer.Option(40, help="Rounds to attempt (training stops earlier if the budget ends)."),
    clients: int = typer.Option(100, help="Number of simulated clients."),
    sample_rate: float = typer.Option(0.6, help="Poisson sampling rate q of clients per round."),
    noise_multiplier: float = typer.Option(2.5, help="Noise multiplier z of each round."),
    epsilon: float = typer.Option(6.0, help="Client-level epsilon budget of the run."),
    delta: float = typer.Option(1e-4, help="Delta of the budget (much smaller than 1/clients)."),
    accountant: LedgerAccountant = typer.Option(LedgerAccountant.pld, help="Ledger accountant: pld or rdp."),
    out_dir: str = typer.Option("demo_out", help="Where the ledger and the PNG go."),
    json_output: bool = typer.Option(
        False,
        "--json",
        help="Print the run as one JSON document on stdout, rounds on stderr" + JSON_PRECISION,
    ),
) -> None:
    """DP-FedAvg on 100 simulated clients (digits, non-IID), epsilon printed after every round."""
    from gaussdp.cli._output import EXIT_USAGE, emit_json, fail, make_console
    from gaussdp.errors import PrivacyError

    console = make_console(stderr=json_output)
    try:
        res = run_demo(
            num_clients=clients,
            rounds=rounds,
            sample_rate=sample_rate,
            noise_multiplier=noise_multiplier,
            target_epsilon=epsilon,
            delta=delta,
            accountant=accountant.value,
            out_dir=Path(out_dir),
            on_round=_print_round(console),
        )
    except PrivacyError as exc:
        fail(str(exc), EXIT_USAGE)
    if json_output:
        emit_json(
            {
                "rounds": [
                    {
                        "round": r.round_num,
                        "sampled": r.sampled,
                        "answered": r.answered,
                        "clip_norm": r.clip_norm,
                        "accuracy": r.metrics["accuracy"],
                        "epsilon": r.epsilon,
                    }
                    for r in res.rounds
                ],
                "stopped": res.stopped,
                "epsilon": res.epsilon,
                "epsilon_budget": epsilon,
                "delta": res.delta,
                "accuracy": res.accuracy,
                "png": None if res.png is None else str(res.png),
                "ledger_url": res.ledger_url,
            }
        )
        return
    _summary(console, res, epsilon)


def demo(console: Any, out_dir: Path) -> None:
    """Federated learning section of ``gaussdp demo``."""
    budget = 6.0
    res = run_demo(out_dir=out_dir, target_epsilon=budget, on_round=_print_round(console))
    _summary(console, res, budget)
