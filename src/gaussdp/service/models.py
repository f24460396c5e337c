"""Request and response bodies of the service (pydantic v2): validated at the boundary, names kept."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from gaussdp._neighbouring import (
    DEFAULT_HIDDEN_STATE_NEIGHBOURING,
    HiddenStateNeighbouring,
    check_neighbouring,
)

__all__ = [
    "AuditLine",
    "BudgetIn",
    "ErrorOut",
    "GenerateIn",
    "GenerateOut",
    "GeneratedToken",
    "GenerationPrivacy",
    "HiddenStateIn",
    "HiddenStateOut",
    "HistoryPage",
    "InvalidOut",
    "LoraDeltaIn",
    "LoraDeltaOut",
    "OpenAIErrorOut",
    "ReadyOut",
    "ReleaseIn",
    "ReleaseOut",
    "Sampling",
    "SessionIn",
    "SessionOut",
]

MAX_DIM = 1 << 20  # floats per vector (the byte limit usually binds first)
MAX_ROWS = 1 << 16  # rows per LoRA-delta request (the byte limit usually binds first)
SESSION_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"

Finite = Annotated[float, Field(allow_inf_nan=False)]
AccountantName = Literal["pld", "rdp", "advanced", "basic"]
Vector = Annotated[list[Finite], Field(min_length=1, max_length=MAX_DIM)]
Base64 = Annotated[str, Field(min_length=4, max_length=(MAX_DIM * 4 * 4) // 3 + 4)]
Rows = Annotated[list[Vector], Field(min_length=1, max_length=MAX_ROWS)]


def _one_spelling(value: object) -> object:
    # An older spelling of the relation is refused naming the value to write (InvalidParameter is a
    # ValueError: a 422); anything else that is not a relation is left to the Literal to refuse.
    return check_neighbouring(value).value if isinstance(value, str) else value


Neighbouring = Annotated[HiddenStateNeighbouring, BeforeValidator(_one_spelling)]
_RELATION_HELP = (
    "Neighbouring relation the epsilon is for: 'replace_one' (default everywhere for hidden states, as in "
    "gaussdp.inference: any state against any other, sensitivity 2 * clip_norm) or 'add_remove' (a "
    "state against its absence, the zero vector; sensitivity clip_norm, the inference server's Delta_f)."
)
IdempotencyKey = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[\x21-\x7e]+$")]


class _Strict(BaseModel):
    # strict: a number is a JSON number (true, "1" are refused, not coerced); unknown fields refused
    model_config = ConfigDict(extra="forbid", strict=True)


class ErrorOut(BaseModel):
    """The body of every error answer but invalid input: what went wrong, and a stable code."""

    detail: str = Field(description="What went wrong, for people.")
    error: str | None = Field(None, description="A stable code for programs (e.g. budget_exhausted).")


class ReadyOut(BaseModel):
    status: Literal["ok", "unavailable"]
    error: str | None = None


class ValidationIssue(BaseModel):
    loc: list[str | int] = Field(description="Where: body/query/path, then field names and indices.")
    msg: str
    type: str


class InvalidOut(BaseModel):
    """422: the request's fields (a list of issues) or its values (a message and a code) are invalid."""

    detail: str | list[ValidationIssue]
    error: str | None = Field(None, description="e.g. work_limit_exceeded, InvalidParameter.")


class OpenAIError(BaseModel):
    message: str = Field(description="What went wrong, for people (the openai client shows it).")
    type: str = Field(description="The code of the service's error table (e.g. budget_exhausted).")
    code: str = Field(description="The same code.")
    param: str | None = Field(None, description="The field at fault, when one is.")


class OpenAIErrorOut(BaseModel):
    """The error body of the OpenAI-compatible routes: OpenAI's shape (``error`` an object), with
    the service's ``detail`` beside it."""

    error: OpenAIError
    detail: str | list[ValidationIssue]


class BudgetIn(_Strict):
    epsilon: float = Field(gt=0, le=1e3, allow_inf_nan=False, description="Total epsilon of the session.")
    delta: float = Field(gt=0, lt=1, allow_inf_nan=False, description="Total delta, in (0, 1).")


class SessionIn(BudgetIn):
    """A session is a principal of the ledger: one budget, spent by its releases."""

    accountant: AccountantName = Field("pld", description="How the session's releases compose.")
    session_id: str | None = Field(
        None, pattern=SESSION_ID_PATTERN, description="Optional id; a random one is made when omitted."
    )


class Privacy(BaseModel):
    epsilon: float
    delta: float

    @classmethod
    def of(cls, privacy: Any) -> Privacy:
        """From the ledger's ``Budget`` or ``Spent`` (its ``epsilon`` and ``delta``)."""
        return cls(epsilon=privacy.epsilon, delta=privacy.delta)


class SessionOut(BaseModel):
    session_id: str
    accountant: str
    budget: Privacy
    spent: Privacy
    remaining: Privacy
    charges: int


class ChargeOut(BaseModel):
    charge_id: int
    event: dict[str, object]
    idempotency_key: str | None
    created_at: float
    within_budget: bool
    key_id: str | None = Field(None, description="Id of the API key that made the charge (not secret).")


class HistoryPage(BaseModel):
    """One page of a session's charges, oldest first."""

    charges: list[ChargeOut]
    next_cursor: str | None = Field(
        None, description="Pass as ?cursor= for the next page; null on the last page. Opaque."
    )


class AuditLine(ChargeOut):
    """One line of ``/v1/audit/export`` (JSON lines): a charge of one of the tenant's sessions."""

    session_id: str


class _Noise(_Strict):
    epsilon: float | None = Field(None, gt=0, le=100, allow_inf_nan=False, description="Per-release epsilon.")
    delta: float | None = Field(None, gt=0, lt=1, allow_inf_nan=False, description="Per-release delta.")
    sigma: float | None = Field(
        None, gt=0, le=1e12, allow_inf_nan=False, description="Noise std; instead of epsilon and delta."
    )
    idempotency_key: IdempotencyKey | None = Field(
        None, description="A retried request with the same key is charged once (and released once)."
    )

    def _check_noise(self, sensitivity_name: str) -> None:
        if self.sigma is not None and (self.epsilon is not None or self.delta is not None):
            raise ValueError(f"give either sigma or epsilon and delta (with {sensitivity_name}), not both")
        if self.sigma is None and (self.epsilon is None or self.delta is None):
            raise ValueError("give epsilon and delta, or sigma")


class ReleaseIn(_Noise):
    """Clip ``vector`` to L2 norm ``sensitivity``, add Gaussian noise, charge the session first."""

    vector: Vector | None = Field(None, description="The vector, as a JSON list of finite numbers.")
    vector_b64: Base64 | None = Field(None, description="The vector as base64 of little-endian float32.")
    sensitivity: float = Field(1.0, gt=0, le=1e6, allow_inf_nan=False, description="L2 clip norm.")

    @model_validator(mode="after")
    def _one_vector(self) -> ReleaseIn:
        if (self.vector is None) == (self.vector_b64 is None):
            raise ValueError("give exactly one of vector and vector_b64")
        self._check_noise("sensitivity")
        return self


class ReleaseOut(BaseModel):
    vector: list[float] | None = None
    vector_b64: str | None = None
    sigma: float
    sensitivity: float
    charge_id: int
    spent: Privacy
    remaining: Privacy


class HiddenStateIn(_Noise):
    """The private inference server's split mode: a hidden state in, the clipped and noised state out."""

    hidden_state: Vector | None = None
    hidden_state_b64: Base64 | None = None
    epsilon: float | None = Field(1.0, gt=0, le=100, allow_inf_nan=False, description="Per-request epsilon.")
    delta: float | None = Field(1e-5, gt=0, lt=1, allow_inf_nan=False, description="Per-request delta.")
    clip_norm: float = Field(1.0, gt=0, le=1e6, allow_inf_nan=False, description="L2 clip norm.")
    neighbouring: Neighbouring = Field(DEFAULT_HIDDEN_STATE_NEIGHBOURING, description=_RELATION_HELP)

    @model_validator(mode="after")
    def _one_state(self) -> HiddenStateIn:
        if (self.hidden_state is None) == (self.hidden_state_b64 is None):
            raise ValueError("give exactly one of hidden_state and hidden_state_b64")
        if (
            self.sigma is not None
            and "epsilon" not in self.model_fields_set
            and "delta" not in self.model_fields_set
        ):
            self.epsilon = self.delta = None  # sigma replaces the default per-request (epsilon, delta)
        self._check_noise("clip_norm")
        return self


class HiddenStateOut(BaseModel):
    noised: list[float] | None = None
    noised_b64: str | None = None
    sigma: float
    clip_norm: float
    neighbouring: Neighbouring = Field(description="The relation the epsilon figures are for.")
    sensitivity: float = Field(description="L2 sensitivity the noise was calibrated and charged for.")
    epsilon_spent: float = Field(description="Composed epsilon of the session so far, at its budget delta.")
    budget_ok: bool = Field(description="Always true: an exhausted budget is refused with 409, never noised.")
    charge_id: int


class LoraDeltaIn(_Strict):
    """Split mode with an untrusted server: rows the CLIENT already clipped and noised, in; a LoRA delta out.

    The server cannot check the client's noise: ``clip_norm``, ``sigma`` and ``neighbouring`` are the
    client's declaration of what it spent, charged to the session so that its budget is enforced.
    """

    adapter: str = Field(min_length=1, max_length=128, description="Name of a LoRA adapter the server holds.")
    noised: Rows | None = Field(None, description="Noised rows (n, d), as a JSON list of lists.")
    noised_b64: Base64 | None = Field(
        None, description="Noised rows as base64 of little-endian float32, row-major; d is the adapter's."
    )
    clip_norm: float = Field(gt=0, le=1e6, allow_inf_nan=False, description="Each row's L2 clip.")
    sigma: float = Field(gt=0, le=1e12, allow_inf_nan=False, description="Std of the noise the client added.")
    neighbouring: Neighbouring = Field(
        DEFAULT_HIDDEN_STATE_NEIGHBOURING,
        description="Relation of the client's privatizer. " + _RELATION_HELP,
    )
    idempotency_key: IdempotencyKey | None = Field(
        None, description="A retried request with the same key is charged once (and answered once)."
    )

    @model_validator(mode="after")
    def _one_rows(self) -> LoraDeltaIn:
        if (self.noised is None) == (self.noised_b64 is None):
            raise ValueError("give exactly one of noised and noised_b64")
        if self.noised is not None and len({len(r) for r in self.noised}) != 1:
            raise ValueError("noised: every row must have the same length")
        return self


class LoraDeltaOut(BaseModel):
    delta: list[list[float]] | None = None
    delta_b64: str | None = Field(None, description="Base64 of LE float32, row-major (rows, d_out).")
    rows: int = Field(description="Rows answered, and charged.")
    d_out: int
    adapter: str
    neighbouring: Neighbouring = Field(description="The relation the charge was computed for.")
    sensitivity: float
    noise_multiplier: float = Field(description="sigma / sensitivity of each row's charged GaussianEvent.")
    charge_id: int
    spent: Privacy
    remaining: Privacy


# ---------------------------------------------------------------- private generation (streaming.py)

MAX_NEW_TOKENS = 256  # per request: each token is one forward pass (bounded work)
MAX_PROMPT_TOKENS = 512
MAX_PROMPT_CHARS = 16_384
LAYER_PATTERN = r"^[A-Za-z0-9_.]{1,200}$"


class GenerationPrivacy(_Strict):
    """How each token's hidden state is clipped and noised (and the charges' idempotency key): the
    privacy fields of every generation request (gaussdp's ``generate`` and the OpenAI-compatible
    routes, where they are extra fields of the body).

    The noise is given as ``sigma``, as ``noise_multiplier`` (``sigma / sensitivity``), or as a
    per-row ``epsilon`` and ``delta`` (calibrated exactly, analytic Gaussian).
    """

    sigma: float | None = Field(None, gt=0, le=1e12, allow_inf_nan=False, description="Noise std.")
    noise_multiplier: float | None = Field(
        None, gt=0, le=1e12, allow_inf_nan=False, description="sigma / sensitivity, instead of sigma."
    )
    epsilon: float | None = Field(None, gt=0, le=100, allow_inf_nan=False, description="Per-row epsilon.")
    delta: float | None = Field(None, gt=0, lt=1, allow_inf_nan=False, description="Per-row delta.")
    clip_norm: float = Field(1.0, gt=0, le=1e6, allow_inf_nan=False, description="L2 clip of each row.")
    layer: Annotated[int, Field(ge=-1024, le=1024)] | Annotated[str, Field(pattern=LAYER_PATTERN)] | None = (
        Field(
            None,
            description="A transformer block: its index (negative from the end) or its path "
            "('transformer.h.0'); default the last block. Modules inside a block are refused.",
        )
    )
    neighbouring: Neighbouring = Field(DEFAULT_HIDDEN_STATE_NEIGHBOURING, description=_RELATION_HELP)
    idempotency_key: IdempotencyKey | None = Field(
        None,
        description="Token i is charged with key '<idempotency_key>/<i>': a retried request is refused "
        "(409 idempotency_key_used) instead of being charged or answered twice.",
    )

    @model_validator(mode="after")
    def _one_noise(self) -> GenerationPrivacy:
        ways = [self.sigma is not None, self.noise_multiplier is not None, self.epsilon is not None]
        if sum(ways) != 1:
            raise ValueError("give exactly one of sigma, noise_multiplier, or epsilon (with delta)")
        if (self.epsilon is None) != (self.delta is None):
            raise ValueError("epsilon and delta go together")
        return self

    def privacy_fields(self) -> dict[str, Any]:
        """These fields alone (to build a :class:`GenerateIn` from a request that holds them)."""
        return {name: getattr(self, name) for name in GenerationPrivacy.model_fields}


class Sampling(_Strict):
    """How the next token is picked from the noised model's logits: greedy (the default, and
    ``temperature`` 0) or sampled. Post-processing of the noised hidden state: no extra charge
    (Dwork & Roth 2014, Proposition 2.1). The sampler's randomness comes from OS entropy unless
    ``seed`` is given (reproducible draws; the answer then says the sampler is not private)."""

    temperature: float | None = Field(
        None, ge=0, le=100, allow_inf_nan=False, description="0 or absent: greedy; > 0: sampled."
    )
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False, description="Nucleus (top-p) mass.")
    top_k: int | None = Field(None, ge=0, le=1 << 20, description="Keep the k most likely tokens (0: all).")
    seed: int | None = Field(
        None,
        ge=0,
        lt=1 << 63,
        description="Reproducible sampling (not private for the sampler); default OS entropy.",
    )

    def sampling_fields(self) -> dict[str, Any]:
        """These fields alone (to build a :class:`GenerateIn` from a request that holds them)."""
        return {name: getattr(self, name) for name in Sampling.model_fields}


class GenerateIn(GenerationPrivacy, Sampling):
    """Generation through a served model whose hidden state at ``layer`` is clipped and noised for
    every token (:class:`gaussdp.inference.HiddenStatePrivatizer` semantics), one charge per token.
    Greedy unless a sampling field is given (sampling is post-processing of the noised state: no
    extra charge).
    """

    model: str = Field(min_length=1, max_length=128, description="Name of a model the server holds.")
    prompt: str | None = Field(
        None, min_length=1, max_length=MAX_PROMPT_CHARS, description="Text (needs the model's tokenizer)."
    )
    prompt_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, max_length=MAX_PROMPT_TOKENS, description="Token ids instead of text."
    )
    max_new_tokens: int = Field(16, ge=1, le=MAX_NEW_TOKENS, description="Tokens to generate (each charged).")
    stop_at_eos: bool = Field(True, description="End after the tokenizer's end-of-sequence token.")

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateIn:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("give exactly one of prompt and prompt_ids")
        return self


class GeneratedToken(BaseModel):
    index: int = Field(description="0 for the first generated token.")
    token_id: int
    text: str | None = Field(description="The token decoded alone (null without a tokenizer).")
    charge_id: int = Field(description="The ledger charge that paid for this token, made before it was sent.")


class GenerateOut(BaseModel):
    stream_id: str = Field(description="Charges of this generation have idempotency keys '<stream_id>/<i>'.")
    model: str
    prompt_tokens: int = Field(description="Rows released (and charged) with the first token.")
    tokens: list[GeneratedToken]
    text: str | None = Field(description="All generated tokens decoded (null without a tokenizer).")
    finish_reason: Literal["length", "eos", "budget_exhausted", "error"]
    error: str | None = Field(
        None,
        description="budget_exhausted when the budget ran out mid-generation; generation_failed when "
        "a token's forward pass failed (detail: whether that token was charged, with its charge_id).",
    )
    detail: str | None = None
    layer: str
    sigma: float
    clip_norm: float
    neighbouring: Neighbouring
    sensitivity: float
    noise_multiplier: float
    sampler_private: bool = Field(
        True, description="False when the sampler was seeded (reproducible draws; the noise is not)."
    )
    spent: Privacy
    remaining: Privacy
