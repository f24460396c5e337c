"""What a DP fine-tuning job will do and cost, fixed before any record is read: config and plan.

:class:`FinetuneConfig` holds the job's settings (validated on construction); :func:`plan_finetune`
turns it and the number of records into a :class:`FinetunePlan`: the Poisson sample rate, the number
of steps, the noise multiplier (calibrated with a real accountant when a target epsilon is given),
the epsilon of the whole run, and the DP event a ledger charges *before* training starts.

Privacy unit and neighbouring relation: one record (one line, or one JSONL object) of the corpus,
added or removed. The number of records is treated as public, as in Opacus and dp_accounting's
DP-SGD examples: it fixes the sample rate.

Steps: ``steps_per_epoch = ceil(n_records / batch_size)``, ``sample_rate = 1 / steps_per_epoch``
(so the expected batch ``sample_rate * n_records`` is at most ``batch_size``), and ``steps = epochs *
steps_per_epoch = epochs / sample_rate``: each epoch is one expected pass over the records. This is
the sample rate :class:`gaussdp.torch.PrivacyEngine` derives from a data loader of that batch size
(``1 / len(loader)``), so the engine charges exactly the plan's events.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any

from gaussdp._validate import check_choice, check_delta, check_epsilon, check_positive, real_number
from gaussdp.accounting import Event, SelfComposedEvent, SubsampledGaussianEvent, event_from_dict
from gaussdp.errors import InvalidParameter

__all__ = [
    "ACCOUNTANTS",
    "MAX_STEPS",
    "FinetuneConfig",
    "FinetunePlan",
    "default_target_modules",
    "epsilon_text",
    "plan_finetune",
]

# Accountants whose epsilon is a proven upper bound for Poisson-subsampled Gaussian steps and whose
# cost is bounded for up to MAX_STEPS identical steps (one self-composition, not a loop over steps).
ACCOUNTANTS = ("pld", "rdp")
# The most optimizer steps one plan may hold: bounds any one job, and the accounting (the PLD
# accountant composes identical steps by repeated squaring, so its cost grows with the tails of the
# privacy loss, i.e. small targets, more than with the steps). Measured on this project's shared
# 2-core machine under load: 0.3-1.7 s of CPU for calibrated plans of 100 000 steps down to
# epsilon 0.05 at delta 1e-9 (tens of ms for typical jobs). A service caps it with
# gaussdp._worklimit.cpu_limit (the Gaussian profile evaluations are its cancellation points).
MAX_STEPS = 100_000
_MAX_RANK = 1024
_MAX_SEQ_LEN = 8192
_MAX_EPOCHS = 10_000
_MAX_BATCH = 1_000_000

# LoRA targets per Hugging Face ``model_type``: the attention projections (queries and values where
# they are separate layers, the fused query-key-value layer where they are not).
_DEFAULT_TARGETS: dict[str, tuple[str, ...]] = {
    "gpt2": ("c_attn",),
    "gpt_bigcode": ("c_attn",),
    "llama": ("q_proj", "v_proj"),
    "mistral": ("q_proj", "v_proj"),
    "mixtral": ("q_proj", "v_proj"),
    "qwen2": ("q_proj", "v_proj"),
    "qwen3": ("q_proj", "v_proj"),
    "gemma": ("q_proj", "v_proj"),
    "gemma2": ("q_proj", "v_proj"),
    "phi": ("q_proj", "v_proj"),
    "gptj": ("q_proj", "v_proj"),
    "opt": ("q_proj", "v_proj"),
    "gpt_neox": ("query_key_value",),
    "bloom": ("query_key_value",),
    "falcon": ("query_key_value",),
}
# Encoder-only architectures: not causal language models, refused rather than fine-tuned as one.
ENCODER_MODEL_TYPES = frozenset(
    {"bert", "roberta", "distilbert", "albert", "electra", "deberta", "deberta-v2", "xlm-roberta"}
)


def default_target_modules(model_type: str) -> tuple[str, ...]:
    """The LoRA target modules used for ``model_type`` when ``target_modules`` is not given.

    Raises:
        InvalidParameter: an encoder-only ``model_type`` (not a causal LM), or one without a known
            default (then ``target_modules`` must be given).

    >>> default_target_modules("gpt2")
    ('c_attn',)
    """
    if model_type in ENCODER_MODEL_TYPES:
        raise InvalidParameter(
            f"model_type={model_type!r} is an encoder (bert-like), not a causal language model"
        )
    try:
        return _DEFAULT_TARGETS[model_type]
    except KeyError:
        raise InvalidParameter(
            f"target_modules has no default for model_type={model_type!r}: give target_modules "
            f"(known defaults: {', '.join(sorted(_DEFAULT_TARGETS))})"
        ) from None


def epsilon_text(x: float, digits: int = 4) -> str:
    """``x`` to ``digits`` significant digits, rounded UP: a printed epsilon stays an upper bound.

    :func:`gaussdp._format.format_upper` (the decimal printed is >= the float; NaN refused).

    >>> epsilon_text(1.23441), epsilon_text(7.9999968)
    ('1.235', '8')
    """
    from gaussdp._format import format_upper

    return format_upper(x, digits)


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {name}={value!r} ({type(value).__name__})")
    if not lo <= int(value) <= hi:
        raise InvalidParameter(f"{name} must be in [{lo}, {hi}], got {name}={value!r}")
    return int(value)


@dataclass(frozen=True)
class FinetuneConfig:
    """Settings of one DP-LoRA fine-tuning job (validated on construction; immutable).

    The guarantee of a job run with this config is (epsilon, delta)-DP of the trained adapter with
    respect to adding or removing one record of the corpus (see :func:`plan_finetune`).

    Attributes:
        lora_rank: LoRA rank ``r``, in [1, 1024].
        lora_alpha: LoRA scale numerator (``scaling = lora_alpha / lora_rank``), > 0.
        lora_dropout: dropout on the LoRA input, in [0, 1).
        target_modules: names of the modules to adapt (peft's ``target_modules``); ``None`` picks a
            default from the model's ``model_type`` (:func:`default_target_modules`).
        epochs: expected passes over the records, in [1, 10000].
        batch_size: expected (logical) batch size of Poisson sampling, >= 1.
        learning_rate: Adam's learning rate, > 0.
        max_seq_len: tokens kept per record (longer records are truncated), in [2, 8192].
        clip_norm: per-record L2 bound on the gradient of the LoRA parameters, > 0.
        target_epsilon: epsilon for the whole run; the noise is calibrated to meet it.
        delta: delta of the guarantee, in (0, 1); required.
        noise_multiplier: noise std / clip_norm, > 0, given instead of ``target_epsilon``.
        accountant: ``"pld"`` (default, tightest) or ``"rdp"``; both give upper bounds.

    Exactly one of ``target_epsilon`` and ``noise_multiplier`` is given.

    Raises:
        TypeError: a field of the wrong type.
        InvalidParameter: a field out of range, not finite, or both/neither of ``target_epsilon``
            and ``noise_multiplier``; the message names the field and its value.
    """

    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None
    epochs: int = 1
    batch_size: int = 16
    learning_rate: float = 1e-3
    max_seq_len: int = 64
    clip_norm: float = 1.0
    target_epsilon: float | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    accountant: str = "pld"

    def __post_init__(self) -> None:
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put("lora_rank", _int("lora_rank", self.lora_rank, 1, _MAX_RANK))
        put("lora_alpha", check_positive("lora_alpha", self.lora_alpha))
        dropout = real_number("lora_dropout", self.lora_dropout)
        if not 0.0 <= dropout < 1.0:
            raise InvalidParameter(f"lora_dropout must be in [0, 1), got lora_dropout={self.lora_dropout!r}")
        put("lora_dropout", dropout)
        if self.target_modules is not None:
            mods = self.target_modules
            if isinstance(mods, str) or not isinstance(mods, tuple | list):
                raise TypeError(
                    f"target_modules must be a tuple of module names or None, got target_modules={mods!r}"
                )
            if not mods:
                raise InvalidParameter("target_modules must name at least one module, got target_modules=()")
            for m in mods:
                if not isinstance(m, str) or not m.strip() or m != m.strip():
                    raise InvalidParameter(
                        f"target_modules must hold non-empty module names, got target_modules={mods!r}"
                    )
            put("target_modules", tuple(mods))
        put("epochs", _int("epochs", self.epochs, 1, _MAX_EPOCHS))
        put("batch_size", _int("batch_size", self.batch_size, 1, _MAX_BATCH))
        lr = check_positive("learning_rate", self.learning_rate)
        if lr > 10.0:
            raise InvalidParameter(f"learning_rate must be <= 10, got learning_rate={self.learning_rate!r}")
        put("learning_rate", lr)
        put("max_seq_len", _int("max_seq_len", self.max_seq_len, 2, _MAX_SEQ_LEN))
        put("clip_norm", check_positive("clip_norm", self.clip_norm))
        if self.delta is None:
            raise InvalidParameter("delta is required: give delta in (0, 1), e.g. 1 / (10 * n_records)")
        put("delta", check_delta(self.delta))
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise InvalidParameter(
                "give exactly one of target_epsilon and noise_multiplier, got "
                f"target_epsilon={self.target_epsilon!r}, noise_multiplier={self.noise_multiplier!r}"
            )
        if self.target_epsilon is not None:
            put("target_epsilon", check_epsilon(self.target_epsilon, "target_epsilon"))
        if self.noise_multiplier is not None:
            z = check_positive("noise_multiplier", self.noise_multiplier)
            if z > 1e6:
                raise InvalidParameter(
                    f"noise_multiplier must be <= 1e6, got noise_multiplier={self.noise_multiplier!r}"
                )
            put("noise_multiplier", z)
        if not isinstance(self.accountant, str):
            raise TypeError(f"accountant must be a string, got accountant={self.accountant!r}")
        put("accountant", check_choice("accountant", self.accountant.lower(), ACCOUNTANTS))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (``target_modules`` as a list); :meth:`from_dict` reads them back."""
        d = asdict(self)
        d["target_modules"] = None if self.target_modules is None else list(self.target_modules)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FinetuneConfig:
        """A config from :meth:`to_dict`'s output (unknown keys refused; validated as on construction)."""
        if not isinstance(d, dict):
            raise TypeError(f"a FinetuneConfig dict must be a dict, got {type(d).__name__}")
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise InvalidParameter(f"unknown FinetuneConfig fields {unknown}")
        kw = dict(d)
        if isinstance(kw.get("target_modules"), list):
            kw["target_modules"] = tuple(kw["target_modules"])
        return cls(**kw)


@dataclass(frozen=True)
class FinetunePlan:
    """The numbers of one DP-LoRA run, fixed before training: what it releases and what it costs.

    Guarantee: training for ``steps`` Poisson-sampled DP-SGD steps at ``sample_rate`` with
    ``noise_multiplier`` and per-record clipping at ``clip_norm`` is ``(epsilon, delta)``-DP with
    respect to adding or removing one record; ``epsilon`` is ``accountant``'s upper bound for
    ``event`` at ``delta``.

    Attributes:
        n_records: records in the corpus (treated as public).
        sample_rate: Poisson inclusion probability of each record per step, ``1 / steps_per_epoch``.
        steps_per_epoch: ``ceil(n_records / batch_size)``.
        epochs: from the config.
        steps: optimizer steps, ``epochs * steps_per_epoch``.
        expected_batch_size: ``sample_rate * n_records`` (<= the config's ``batch_size``).
        noise_multiplier: noise std on the clipped sum / ``clip_norm``.
        clip_norm: per-record gradient bound.
        delta: delta of the guarantee.
        epsilon: the accountant's epsilon for the whole run at ``delta``.
        accountant: the accountant's name.
        target_epsilon: the config's target (``None`` when ``noise_multiplier`` was given).
        event: the DP event of the whole run, ``SelfComposedEvent(SubsampledGaussianEvent(
            noise_multiplier, sample_rate), steps)``: what a ledger charges before training.
        neighbouring: ``"add_remove"`` (one record).
    """

    n_records: int
    sample_rate: float
    steps_per_epoch: int
    epochs: int
    steps: int
    expected_batch_size: float
    noise_multiplier: float
    clip_norm: float
    delta: float
    epsilon: float
    accountant: str
    target_epsilon: float | None
    event: Event = field(repr=False)
    neighbouring: str = "add_remove"

    def __post_init__(self) -> None:
        # types only (a plan read back from a database must hold numbers); check_plan checks that
        # the numbers agree with each other and with the accountant
        for name in ("n_records", "steps_per_epoch", "epochs", "steps"):
            _int(f"plan.{name}", getattr(self, name), 1, 10**12)
        for name in ("sample_rate", "expected_batch_size", "noise_multiplier", "clip_norm", "epsilon"):
            check_positive(f"plan.{name}", getattr(self, name))
        check_delta(self.delta, "plan.delta")
        if self.target_epsilon is not None:
            check_epsilon(self.target_epsilon, "plan.target_epsilon")
        if not isinstance(self.accountant, str) or not isinstance(self.neighbouring, str):
            raise TypeError("plan.accountant and plan.neighbouring must be strings")
        if not isinstance(self.event, Event):
            raise TypeError(f"plan.event must be a gaussdp Event, got {type(self.event).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values, the event as ``event.to_dict()``; :meth:`from_dict` reads them back."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["event"] = self.event.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FinetunePlan:
        """A plan from :meth:`to_dict`'s output, checked: the event must be the one its numbers
        describe and its epsilon the accountant's value for it (a stored plan cannot under-report)."""
        if not isinstance(d, dict):
            raise TypeError(f"a FinetunePlan dict must be a dict, got {type(d).__name__}")
        missing = sorted(set(cls.__dataclass_fields__) - set(d) - {"neighbouring"})
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if missing or unknown:
            raise InvalidParameter(f"bad FinetunePlan dict: missing {missing}, unknown {unknown}")
        kw = dict(d)
        kw["event"] = event_from_dict(d["event"])
        plan = cls(**kw)
        check_plan(plan)
        return plan


def _run_event(noise_multiplier: float, sample_rate: float, steps: int) -> Event:
    return SelfComposedEvent(SubsampledGaussianEvent(noise_multiplier, sample_rate), steps)


def _epsilon(accountant: str, event: Event, delta: float) -> float:
    from gaussdp.accounting import accountant as make_accountant

    return float(make_accountant(accountant).compose(event).epsilon(delta))


def check_plan(
    plan: FinetunePlan, *, config: FinetuneConfig | None = None, n_records: int | None = None
) -> None:
    """Refuse a plan whose numbers disagree with each other, with ``config`` or with ``n_records``.

    Checks the steps and sample rate against ``n_records`` and the batch size, that ``event`` is the
    run's event, and that ``epsilon`` is at least the accountant's value for it (recomputed).

    Raises:
        InvalidParameter: naming what disagrees.
    """
    if not isinstance(plan, FinetunePlan):
        raise TypeError(f"plan must be a FinetunePlan, got {type(plan).__name__}")
    if plan.neighbouring != "add_remove":
        raise InvalidParameter(f"plan.neighbouring must be 'add_remove', got {plan.neighbouring!r}")
    if n_records is not None and n_records != plan.n_records:
        raise InvalidParameter(
            f"plan was made for n_records={plan.n_records} but there are {n_records} records: "
            "make a new plan (the sample rate and the charge depend on it)"
        )
    if (
        plan.steps_per_epoch != max(1, plan.steps_per_epoch)
        or plan.steps != plan.epochs * plan.steps_per_epoch
    ):
        raise InvalidParameter(
            f"plan.steps={plan.steps} is not epochs * steps_per_epoch = "
            f"{plan.epochs} * {plan.steps_per_epoch}"
        )
    if plan.sample_rate != 1.0 / plan.steps_per_epoch:
        raise InvalidParameter(
            f"plan.sample_rate={plan.sample_rate!r} is not 1 / steps_per_epoch = 1 / {plan.steps_per_epoch}"
        )
    if config is not None:
        for name, want in (
            ("epochs", config.epochs),
            ("steps_per_epoch", math.ceil(plan.n_records / config.batch_size)),
            ("clip_norm", config.clip_norm),
            ("delta", config.delta),
            ("accountant", config.accountant),
            ("target_epsilon", config.target_epsilon),
        ):
            if getattr(plan, name) != want:
                raise InvalidParameter(
                    f"plan.{name}={getattr(plan, name)!r} does not match the config's {want!r}: "
                    "make the plan from this config"
                )
        if config.noise_multiplier is not None and plan.noise_multiplier != config.noise_multiplier:
            raise InvalidParameter(
                f"plan.noise_multiplier={plan.noise_multiplier!r} does not match the config's "
                f"{config.noise_multiplier!r}"
            )
    if plan.event != _run_event(plan.noise_multiplier, plan.sample_rate, plan.steps):
        raise InvalidParameter("plan.event is not the run's SelfComposedEvent(SubsampledGaussianEvent)")
    eps = _epsilon(plan.accountant, plan.event, plan.delta)
    if not eps <= plan.epsilon:
        raise InvalidParameter(
            f"plan.epsilon={plan.epsilon!r} is below the accountant's {eps!r} for its event"
        )


def plan_finetune(config: FinetuneConfig, *, n_records: int) -> FinetunePlan:
    """The plan of a DP-LoRA run of ``config`` over ``n_records`` records: steps, noise, epsilon, event.

    Guarantee: the run (:func:`gaussdp.finetune.run_finetune`) is ``(plan.epsilon, config.delta)``-DP
    with respect to adding or removing one record, ``plan.epsilon`` being ``config.accountant``'s
    upper bound for ``plan.event`` (with a ``target_epsilon``, ``plan.epsilon <= target_epsilon``).

    Pure numeric, no torch: at most :data:`MAX_STEPS` steps, one self-composed event, a bounded
    root search when calibrating (tens of ms for typical jobs, under ~2 s of CPU for any accepted
    config; run it inside ``gaussdp._worklimit.cpu_limit`` in a request handler).

    Args:
        config: the job's settings.
        n_records: the number of records in the corpus (public), >= 1.

    Returns:
        A :class:`FinetunePlan`; charge ``plan.event`` to the ledger before training.

    Raises:
        InvalidParameter: ``n_records`` out of range, more than :data:`MAX_STEPS` steps (naming
            ``epochs``), or no noise multiplier up to 1e6 meets ``target_epsilon``.

    References:
        Abadi et al. 2016, "Deep learning with differential privacy" (DP-SGD, Poisson sampling).
        Doroshenko et al. 2022, "Connect the dots" (PLD accounting); Mironov, Talwar & Zhang 2019
        (RDP of the sampled Gaussian mechanism).
    """
    if not isinstance(config, FinetuneConfig):
        raise TypeError(f"config must be a FinetuneConfig, got {type(config).__name__}")
    n = _int("n_records", n_records, 1, 10**9)
    steps_per_epoch = math.ceil(n / config.batch_size)
    steps = config.epochs * steps_per_epoch
    if steps > MAX_STEPS:
        raise InvalidParameter(
            f"epochs={config.epochs} over n_records={n} at batch_size={config.batch_size} make "
            f"{steps} steps, more than the {MAX_STEPS} one job may take: lower epochs or raise batch_size"
        )
    sample_rate = 1.0 / steps_per_epoch
    delta = float(config.delta)  # type: ignore[arg-type]  # FinetuneConfig requires it
    if config.noise_multiplier is not None:
        sigma = config.noise_multiplier
    else:
        from gaussdp.accounting import noise_for_epsilon

        sigma = noise_for_epsilon(
            target_epsilon=float(config.target_epsilon),  # type: ignore[arg-type]
            delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=config.accountant,
        )
    event = _run_event(sigma, sample_rate, steps)
    epsilon = _epsilon(config.accountant, event, delta)
    if not math.isfinite(epsilon):
        raise InvalidParameter(
            f"noise_multiplier={sigma!r} is too small: the run's epsilon at delta={delta!r} is not finite"
        )
    if config.target_epsilon is not None and not epsilon <= config.target_epsilon:
        raise InvalidParameter(  # noise_for_epsilon verifies its answer: this is a safety net
            f"calibration missed target_epsilon={config.target_epsilon}: epsilon={epsilon}"
        )
    return FinetunePlan(
        n_records=n,
        sample_rate=sample_rate,
        steps_per_epoch=steps_per_epoch,
        epochs=config.epochs,
        steps=steps,
        expected_batch_size=sample_rate * n,
        noise_multiplier=sigma,
        clip_norm=config.clip_norm,
        delta=delta,
        epsilon=epsilon,
        accountant=config.accountant,
        target_epsilon=config.target_epsilon,
        event=event,
    )
