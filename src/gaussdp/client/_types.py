"""What the client's calls return: small frozen records, built from the service's JSON answers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "Charge",
    "Corpus",
    "FinetuneJob",
    "Generation",
    "HiddenState",
    "LoraDelta",
    "Privacy",
    "Release",
    "Session",
    "Token",
]


@dataclass(frozen=True)
class Privacy:
    epsilon: float
    delta: float

    @classmethod
    def of(cls, d: dict[str, Any]) -> Privacy:
        return cls(float(d["epsilon"]), float(d["delta"]))


@dataclass(frozen=True)
class Session:
    session_id: str
    accountant: str
    budget: Privacy
    spent: Privacy
    remaining: Privacy
    charges: int

    @classmethod
    def of(cls, d: dict[str, Any]) -> Session:
        return cls(
            d["session_id"],
            d["accountant"],
            Privacy.of(d["budget"]),
            Privacy.of(d["spent"]),
            Privacy.of(d["remaining"]),
            int(d["charges"]),
        )


@dataclass(frozen=True)
class Charge:
    """One charge of a session's history (what was released, when, under which idempotency key)."""

    charge_id: int
    event: dict[str, Any]
    idempotency_key: str | None
    created_at: float
    within_budget: bool
    key_id: str | None

    @classmethod
    def of(cls, d: dict[str, Any]) -> Charge:
        return cls(
            int(d["charge_id"]),
            d["event"],
            d.get("idempotency_key"),
            float(d["created_at"]),
            bool(d["within_budget"]),
            d.get("key_id"),
        )


@dataclass(frozen=True)
class Release:
    """A clipped and noised vector, with what it cost."""

    vector: np.ndarray
    sigma: float
    sensitivity: float
    charge_id: int
    spent: Privacy
    remaining: Privacy


@dataclass(frozen=True)
class HiddenState:
    """A hidden state clipped and noised by a trusted server (``/hidden-state``)."""

    noised: np.ndarray
    sigma: float
    clip_norm: float
    neighbouring: str
    sensitivity: float
    epsilon_spent: float
    charge_id: int


@dataclass(frozen=True)
class LoraDelta:
    """The server's LoRA delta of rows the client privatized (``/lora-delta``), float32 ``(rows, d_out)``."""

    delta: np.ndarray
    rows: int
    adapter: str
    neighbouring: str
    sensitivity: float
    noise_multiplier: float
    charge_id: int
    spent: Privacy
    remaining: Privacy

    @classmethod
    def of(cls, delta: np.ndarray, d: dict[str, Any]) -> LoraDelta:
        """From the decoded (or decrypted) ``delta`` and the rest of the service's answer."""
        return cls(
            delta,
            int(d["rows"]),
            str(d["adapter"]),
            str(d["neighbouring"]),
            float(d["sensitivity"]),
            float(d["noise_multiplier"]),
            int(d["charge_id"]),
            Privacy.of(d["spent"]),
            Privacy.of(d["remaining"]),
        )


@dataclass(frozen=True)
class Token:
    """One generated token; ``charge_id`` is the charge that paid for it (made before it was sent)."""

    index: int
    token_id: int
    text: str | None
    charge_id: int

    @classmethod
    def of(cls, d: dict[str, Any]) -> Token:
        return cls(int(d["index"]), int(d["token_id"]), d.get("text"), int(d["charge_id"]))


@dataclass(frozen=True)
class Generation:
    """A whole generation (``POST /generate``): the tokens, why it ended, and what it cost."""

    stream_id: str
    tokens: list[Token]
    text: str | None
    finish_reason: str
    error: str | None
    detail: str | None
    spent: Privacy
    remaining: Privacy
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


@dataclass(frozen=True)
class Corpus:
    """An uploaded (perturbed) corpus: what the server stored and the local DP the uploader declared."""

    id: str
    name: str
    format: str
    bytes: int
    records: int
    sha256: str
    local_dp: dict[str, Any] | None
    created_at: float

    @classmethod
    def of(cls, d: dict[str, Any]) -> Corpus:
        return cls(
            d["id"],
            d["name"],
            d["format"],
            int(d["bytes"]),
            int(d["records"]),
            d["sha256"],
            d.get("local_dp"),
            float(d["created_at"]),
        )


@dataclass(frozen=True)
class FinetuneJob:
    """A DP-LoRA fine-tuning job: its state, progress and the privacy its plan charged up front."""

    id: str
    state: str
    corpus_id: str
    model: str
    session_id: str
    step: int
    steps: int
    epsilon: float
    delta: float
    epsilon_so_far: float
    error: str | None
    noise_multiplier: float | None
    sample_rate: float | None
    charge_id: int | None
    validation_loss: float | None = None  # on the job's public validation corpus, if it has one
    attempts: int = 0  # workers that took it (> 1: resumed after interruptions)
    steps_lost: int = 0  # released before an interruption, not in the resumed checkpoint

    @property
    def done(self) -> bool:
        return self.state in ("succeeded", "failed", "cancelled")

    @classmethod
    def of(cls, d: dict[str, Any]) -> FinetuneJob:
        return cls(
            d["id"],
            d["state"],
            d["corpus_id"],
            d["model"],
            d["session_id"],
            int(d["step"]),
            int(d["steps"]),
            float(d["epsilon"]),
            float(d["delta"]),
            float(d["epsilon_so_far"]),
            d.get("error"),
            d.get("noise_multiplier"),
            d.get("sample_rate"),
            d.get("charge_id"),
            d.get("validation_loss"),
            int(d.get("attempts", 0)),
            int(d.get("steps_lost", 0)),
        )
