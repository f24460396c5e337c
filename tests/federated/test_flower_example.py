"""examples/flower-digits without a Flower runtime: its task and its in-process run.

The same app on Flower's deployment runtime is tested in ``test_flower_deployment.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("sklearn")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "flower-digits"


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    yield
    for name in [m for m in sys.modules if m == "gaussdp_digits" or m.startswith("gaussdp_digits.")]:
        del sys.modules[name]


def test_the_in_process_run_charges_one_pld_event_per_round(example) -> None:
    from gaussdp_digits import inprocess

    from gaussdp.accounting import SubsampledGaussianEvent, accountant
    from gaussdp.noise import GRID_SLACK

    cfg = inprocess.run_config(
        ["num-clients=50", "sample-rate=0.2", "num-server-rounds=4", 'ledger="memory://"']
    )
    sim = inprocess.run(cfg)
    assert [r.round_num for r in sim.rounds] == [1, 2, 3, 4]
    expected = (
        accountant("pld").compose(SubsampledGaussianEvent(1.0 / (1 + GRID_SLACK), 0.2), 4).epsilon(1e-5)
    )
    assert sim.rounds[-1].epsilon == pytest.approx(expected, rel=1e-12)
    assert sim.rounds[-1].metrics["accuracy"] > 0.3  # ten classes: chance is 0.1


def test_the_task_round_trips_the_model_and_partitions_the_data(example) -> None:
    from gaussdp_digits import task

    flat = np.arange(task.NUM_FEATURES * task.NUM_CLASSES + task.NUM_CLASSES, dtype=np.float32)
    arrays = task.to_arrays(flat)
    assert list(arrays.keys()) == ["W", "b"]
    np.testing.assert_array_equal(task.to_flat(arrays), flat)
    parts = task.partitions(7)
    joined = np.concatenate(parts)
    assert len(parts) == 7 and np.array_equal(np.sort(joined), np.arange(joined.size))
    delta, n = task.local_update(task.initial_flat(), 3, 7, local_steps=2, learning_rate=0.5)
    assert n == len(parts[3]) and delta.shape == flat.shape and np.isfinite(delta).all()


def test_run_config_overrides_must_name_a_key(example) -> None:
    from gaussdp_digits import inprocess

    with pytest.raises(KeyError, match="not-a-key"):
        inprocess.run_config(["not-a-key=1"])
