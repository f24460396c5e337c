"""The release a table job makes: its calibrated mechanism, its charge, and the record written with it.

One :class:`TableRelease` per job, built on the driver before any row is read: the mechanism is
calibrated once (:class:`gaussdp.mechanism.GaussianMechanism`, exact analytic sigma at sensitivity
``clip_norm``), its ``event`` is what the ledger is charged, and :meth:`TableRelease.record` is the
JSON written into the output's metadata (and a Ray job's manifest), so that a reader of the output can
tell what it cost.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gaussdp import mechanism as _mechanism
from gaussdp._rows import release_epsilon
from gaussdp._validate import check_choice, check_delta, check_epsilon, check_positive
from gaussdp.errors import InvalidParameter
from gaussdp.noise import SourceKind

__all__ = ["METADATA_KEY", "TableRelease", "check_positive_int"]

# The key of the release record in the output's Parquet (Arrow schema) metadata.
METADATA_KEY = b"gaussdp.release"


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise InvalidParameter(f"{name} must be a positive int, got {name}={value!r}")
    return int(value)


@dataclass
class TableRelease:
    """One job's calibrated mechanism and, once charged, its ledger charge.

    Guarantee: every row of the embedding column is one individual's embedding, clipped to L2 norm
    ``clip_norm`` and noised with ``N(0, sigma^2)`` per coordinate once; under add/remove of one row
    (an absent row counting as zero) the release is ``(epsilon, delta)``-DP per individual
    (``epsilon_add_remove`` at ``delta`` is the mechanism's true epsilon, never above the target),
    and under replacement of one row it is ``epsilon_replace`` (sensitivity ``2 * clip_norm``).
    """

    column: str
    epsilon: float
    delta: float
    clip_norm: float
    noise: SourceKind
    mechanism: Any = field(init=False, repr=False)
    charge: dict[str, Any] | None = field(default=None, init=False)

    @classmethod
    def plan(
        cls, *, column: str, epsilon: float, delta: float, clip_norm: float, noise: SourceKind
    ) -> TableRelease:
        """Validate the parameters (naming the bad one) and calibrate the mechanism."""
        if not isinstance(column, str) or not column:
            raise TypeError(f"column must be a non-empty str, got column={column!r}")
        rel = cls(
            column=column,
            epsilon=check_epsilon(epsilon),
            delta=check_delta(delta),
            clip_norm=check_positive("clip_norm", clip_norm),
            noise=noise,
        )
        check_choice("noise", noise, ("secure", "fast"))
        rel.mechanism = _mechanism.GaussianMechanism(
            epsilon=rel.epsilon, delta=rel.delta, sensitivity=rel.clip_norm, noise=noise
        )
        return rel

    @property
    def sigma(self) -> float:
        return float(self.mechanism.sigma)

    @property
    def event(self) -> Any:
        """The accounting event of the release (one Gaussian release per individual)."""
        return self.mechanism.event

    @property
    def epsilon_add_remove(self) -> float:
        return release_epsilon(self.mechanism, self.delta, "add_remove")

    @property
    def epsilon_replace(self) -> float:
        return release_epsilon(self.mechanism, self.delta, "replace_one")

    def charge_with(self, charge: Callable[[Any], object] | None) -> None:
        """Call ``charge(event)`` (e.g. ``lambda ev: ledger.charge("dataset-42", ev)``); keep its receipt.

        The receipt's ``principal`` and ``charge_id`` (a :class:`gaussdp.budget.Receipt`) go into the
        record; any other return value is recorded as charged without an id.
        """
        if charge is None:
            return
        receipt = charge(self.event)
        self.charge = {
            "principal": getattr(receipt, "principal", None),
            "charge_id": getattr(receipt, "charge_id", None),
        }

    def record(self, **extra: Any) -> dict[str, Any]:
        """The release as a JSON-ready dict: what was released, under which relation, and its charge."""
        from gaussdp import __version__

        return {
            "mechanism": "gaussian",
            "column": self.column,
            "clip_norm": self.clip_norm,
            "sigma": self.sigma,
            "noise": self.noise,
            "neighbouring": "add_remove",
            "epsilon": self.epsilon_add_remove,
            "delta": self.delta,
            "epsilon_replace": self.epsilon_replace,
            "event": self.event.to_dict(),
            "charge": self.charge,
            "gaussdp_version": __version__,
            **extra,
        }

    def metadata(self, **extra: Any) -> dict[bytes, bytes]:
        """:meth:`record` as Parquet key-value metadata under :data:`METADATA_KEY`."""
        return {METADATA_KEY: json.dumps(self.record(**extra), sort_keys=True).encode()}
