"""Request and response bodies of the fine-tuning routes (:mod:`gaussdp.service.finetune`)."""

# No "from __future__ import annotations": pydantic resolves the annotations at runtime.

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gaussdp.service.models import SESSION_ID_PATTERN

__all__ = ["ID_PATTERN", "NAME_PATTERN", "CorpusOut", "JobIn", "JobOut", "LocalDP", "LoraIn", "ModelOut"]

ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
NAME_PATTERN = r"^[^\x00-\x1f/\\]{1,128}$"


class LocalDP(BaseModel):
    """The local-DP parameters the uploader declares (the server checks the words, not the noise)."""

    mechanism: Literal["gaussian", "laplace"]
    sigma: float | None = None
    epsilon: float | None = None
    vocabulary: str
    epsilon_per_word: dict[str, dict[str, float | None]] | None = Field(
        None,
        description="The declared mechanism's per-word guarantee on this server's vocabulary: "
        "'nearest_neighbour' (a word vs its typical nearest neighbour) and 'worst_case' (vs any "
        "word), each with its distance, epsilon and delta (delta 0: metric DP).",
    )


class CorpusOut(BaseModel):
    id: str
    name: str
    format: Literal["lines", "jsonl"]
    bytes: int
    records: int
    sha256: str
    local_dp: LocalDP | None
    created_at: float


class ModelOut(BaseModel):
    name: str


class LoraIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: int = Field(8, ge=1, le=256)
    alpha: float = Field(16.0, gt=0, le=1e4, allow_inf_nan=False)
    target_modules: list[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.]{1,128}$")]] | None = Field(
        None,
        min_length=1,
        max_length=32,
        description="Modules to adapt (default: the attention).",
    )


class JobIn(BaseModel):
    """A DP-LoRA fine-tuning job: exactly one of ``target_epsilon`` and ``noise_multiplier``."""

    model_config = ConfigDict(extra="forbid")
    corpus_id: str = Field(..., pattern=ID_PATTERN)
    model: str = Field(..., min_length=1, max_length=128, description="A name from GET /v1/models.")
    session_id: str = Field(..., pattern=SESSION_ID_PATTERN, description="The session that pays.")
    lora: LoraIn = Field(default_factory=lambda: LoraIn.model_validate({}))
    target_epsilon: float | None = Field(None, gt=0, le=1e3, allow_inf_nan=False)
    noise_multiplier: float | None = Field(None, gt=0, le=1e4, allow_inf_nan=False)
    delta: float | None = Field(None, gt=0, lt=1, allow_inf_nan=False, description="Default: the session's.")
    epochs: int = Field(1, ge=1, le=100)
    batch_size: int = Field(8, ge=1, le=4096)
    learning_rate: float = Field(1e-3, gt=0, le=10, allow_inf_nan=False)
    max_seq_len: int = Field(64, ge=4, le=4096)
    clip_norm: float = Field(1.0, gt=0, le=1e4, allow_inf_nan=False)
    validation_corpus_id: str | None = Field(
        None,
        pattern=ID_PATTERN,
        description="A corpus of yours (at most 2048 records) on which the adapter's loss is measured "
        "during training and shown on the job and the card. Its loss is released WITHOUT noise and "
        "not charged: it must be public data (set validation_public=true to declare it).",
    )
    validation_public: bool = Field(
        False, description="Your declaration that the validation corpus is public (required with it)."
    )

    @model_validator(mode="after")
    def _one_noise_spec(self) -> "JobIn":
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("give exactly one of target_epsilon and noise_multiplier")
        if self.validation_corpus_id is not None and not self.validation_public:
            raise ValueError(
                "validation_public must be true with validation_corpus_id: its loss is released "
                "without noise, so the validation corpus must be public data"
            )
        if self.validation_corpus_id is not None and self.validation_corpus_id == self.corpus_id:
            raise ValueError("validation_corpus_id must differ from corpus_id (the private training corpus)")
        return self


class JobOut(BaseModel):
    id: str
    state: Literal["queued", "running", "succeeded", "failed", "cancelled", "charging"]
    corpus_id: str
    model: str
    session_id: str
    step: int
    steps: int
    epsilon: float = Field(..., description="The plan's epsilon at delta (the whole run), charged up front.")
    delta: float
    epsilon_so_far: float = Field(..., description="Epsilon of the steps done so far (at delta).")
    loss: float | None = Field(
        None,
        description="Always null: the training loss is computed from the records without noise, "
        "so it is not covered by the guarantee and is not released.",
    )
    error: str | None
    validation_loss: float | None = Field(
        None,
        description="The adapter's latest mean per-record loss on the public validation corpus "
        "(validation_corpus_id); null without one.",
    )
    attempts: int = Field(0, description="Workers that took the job (> 1: resumed after interruptions).")
    steps_lost: int = Field(
        0,
        description="Steps released before an interruption but not in the checkpoint the job resumed "
        "from: counted in epsilon_so_far and the charge, never run again, not in the adapter.",
    )
    noise_multiplier: float | None
    sample_rate: float | None
    charge_id: int | None
    cancel_requested: bool
    created_at: float
    started_at: float | None
    finished_at: float | None
