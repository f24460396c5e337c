"""The digits task shared by the ServerApp, the ClientApp and the in-process run.

Softmax regression on ``sklearn.datasets.load_digits`` (1,797 8x8 images, shipped with scikit-learn).
A fixed permutation holds out a test set for the server's own evaluation and deals the rest into
``num_partitions`` partitions, one per client. The split is data layout, not a privacy mechanism:
its generator is seeded so that every process builds the same partitions.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from flwr.app import Array, ArrayRecord

from gaussdp.federated import SoftmaxRegressionClients, softmax_accuracy

NUM_FEATURES, NUM_CLASSES = 64, 10
TEST_FRACTION = 0.2


@lru_cache(maxsize=1)
def _data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = (X / 16.0).astype(np.float32)
    order = np.random.default_rng(0).permutation(len(y))
    n_test = int(TEST_FRACTION * len(y))
    test, train = order[:n_test], order[n_test:]
    return X[train], y[train], X[test], y[test]


def partitions(num_partitions: int) -> list[np.ndarray]:
    """Indices into the training set of each client (IID, nearly equal sizes)."""
    _, y_train, _, _ = _data()
    return np.array_split(np.arange(len(y_train)), int(num_partitions))


def clients(num_partitions: int, *, local_steps: int, learning_rate: float) -> SoftmaxRegressionClients:
    """All ``num_partitions`` clients, vectorised (the in-process simulator uses them at once)."""
    X_train, y_train, _, _ = _data()
    return SoftmaxRegressionClients(
        X_train,
        y_train,
        partitions(num_partitions),
        NUM_CLASSES,
        local_steps=local_steps,
        learning_rate=learning_rate,
    )


def local_update(
    flat: np.ndarray, partition_id: int, num_partitions: int, *, local_steps: int, learning_rate: float
) -> tuple[np.ndarray, int]:
    """One client's model delta after local training from ``flat``, and its number of examples."""
    X_train, y_train, _, _ = _data()
    idx = partitions(num_partitions)[int(partition_id)]
    one = SoftmaxRegressionClients(
        X_train, y_train, [idx], NUM_CLASSES, local_steps=local_steps, learning_rate=learning_rate
    )
    return one(flat.astype(np.float32), np.array([0]))[0], len(idx)


def initial_flat() -> np.ndarray:
    return np.zeros(NUM_FEATURES * NUM_CLASSES + NUM_CLASSES, dtype=np.float32)


def to_arrays(flat: np.ndarray) -> ArrayRecord:
    """The flat ``[W (64 x 10), b (10)]`` vector as an ArrayRecord with keys ``W`` and ``b``."""
    dk = NUM_FEATURES * NUM_CLASSES
    W = np.ascontiguousarray(flat[:dk].reshape(NUM_FEATURES, NUM_CLASSES))
    b = np.ascontiguousarray(flat[dk:])
    return ArrayRecord({"W": Array(W), "b": Array(b)})


def to_flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([a.reshape(-1) for a in arrays.to_numpy_ndarrays()]).astype(np.float32)


def test_accuracy(flat: np.ndarray) -> float:
    """Accuracy of the global model on the server's held-out test set."""
    _, _, X_test, y_test = _data()
    return softmax_accuracy(flat, X_test, y_test, NUM_CLASSES)
