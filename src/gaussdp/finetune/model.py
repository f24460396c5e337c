"""The base model of a fine-tuning job: checked, loaded, tokenised, wrapped with LoRA adapters.

Nothing is downloaded: a base model is a local directory holding a Hugging Face config, weights and
tokenizer. :func:`check_model` refuses (naming the argument) what training would refuse, before a
job is charged; :func:`wrap_lora` puts the adapters on the targets the config names (or the
architecture's defaults, :func:`gaussdp.finetune.plan.default_target_modules`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gaussdp.errors import InvalidParameter
from gaussdp.finetune.plan import ENCODER_MODEL_TYPES, FinetuneConfig, default_target_modules

__all__ = [
    "check_model",
    "load_base_model",
    "per_record_loss",
    "tokenize_records",
    "trim_padding",
    "wrap_lora",
]


def _model_config(model_path: str | Path) -> tuple[Path, Any]:
    """The directory and its Hugging Face config, after the checks that need no weights."""
    from transformers import AutoConfig

    p = Path(model_path)
    if not p.is_dir():
        raise InvalidParameter(f"model_path {str(p)!r} is not a local directory (nothing is downloaded)")
    try:
        cfg = AutoConfig.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise InvalidParameter(f"model_path {str(p)!r} holds no Hugging Face model config: {exc}") from None
    if cfg.model_type in ENCODER_MODEL_TYPES:
        raise InvalidParameter(
            f"model_path {str(p)!r} is a {cfg.model_type!r} model: an encoder, not a causal language model"
        )
    if not any((p / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise InvalidParameter(f"model_path {str(p)!r} holds no tokenizer (save it with the model)")
    return p, cfg


def check_model(model_path: str | Path, config: FinetuneConfig) -> tuple[str, tuple[str, ...]]:
    """What :func:`run_finetune` would refuse about ``model_path`` with ``config``, checked cheaply.

    Call it before charging the ledger, so that a job that cannot run costs no budget. Reads only
    the model's config and builds the architecture on the ``meta`` device (no weights, no memory):
    checks the directory, that it is a causal LM with a tokenizer, that ``max_seq_len`` fits its
    positions, and which modules get LoRA adapters.

    Returns:
        ``(model_type, target_modules)``.

    Raises:
        InvalidParameter: naming ``model_path``, ``max_seq_len`` or ``target_modules``.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if not isinstance(config, FinetuneConfig):
        raise TypeError(f"config must be a FinetuneConfig, got {type(config).__name__}")
    p, cfg = _model_config(model_path)
    positions = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if isinstance(positions, int) and config.max_seq_len > positions:
        raise InvalidParameter(
            f"max_seq_len={config.max_seq_len} is more than the {positions} positions of the model "
            f"at model_path {str(p)!r}"
        )
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(cfg)
    except (OSError, ValueError) as exc:
        raise InvalidParameter(f"model_path {str(p)!r} is not a causal LM architecture: {exc}") from None
    targets, _ = _resolve_targets(skeleton, config)
    return str(cfg.model_type), targets


def load_base_model(model_path: str | Path) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a local Hugging Face causal LM directory (never downloads).

    Raises:
        InvalidParameter: naming ``model_path``: not a directory, not loadable as a causal LM, an
            encoder-only architecture, or no tokenizer in it.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p, _ = _model_config(model_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise InvalidParameter(f"model_path {str(p)!r} could not be loaded as a causal LM: {exc}") from None
    return model, tokenizer


def tokenize_records(tokenizer: Any, records: Sequence[str], max_seq_len: int) -> tuple[Any, Any]:
    """``(input_ids, attention_mask)``, shape ``(n, L)`` with ``L <= max_seq_len``, right-padded.

    Each record is tokenized on its own (no special tokens), truncated to ``max_seq_len - 1`` tokens
    and followed by the end-of-sequence token where the tokenizer has one, so the model learns where
    a record ends; a record never shares a row with another.
    """
    import torch

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    keep = max_seq_len - 1 if eos is not None else max_seq_len
    enc = tokenizer(list(records), add_special_tokens=False, truncation=True, max_length=keep)["input_ids"]
    rows = [list(ids[:keep]) + ([eos] if eos is not None else []) for ids in enc]
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), int(pad), dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, : len(r)] = 1
    return ids, mask


def trim_padding(batch: list[Any]) -> tuple[Any, Any]:
    """Collate: stack ``(ids, mask)`` pairs and drop the columns that are padding in every row."""
    import torch

    ids = torch.stack([b[0] for b in batch])
    mask = torch.stack([b[1] for b in batch])
    width = int(mask.sum(1).max()) if len(batch) else 0
    width = max(width, 1)
    return ids[:, :width], mask[:, :width]


def per_record_loss(model: Any, ids: Any, mask: Any) -> Any:
    """Each record's mean next-token cross-entropy over its own tokens, shape ``(batch,)``."""
    import torch

    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    target = ids[:, 1:]
    tok = torch.nn.functional.cross_entropy(logits.transpose(1, 2).float(), target, reduction="none")
    m = mask[:, 1:].to(tok.dtype)
    return (tok * m).sum(1) / m.sum(1).clamp(min=1.0)


def _is_conv1d(module: Any) -> bool:
    return type(module).__name__ == "Conv1D"  # transformers' GPT-2 layer: weight stored (in, out)


def _resolve_targets(model: Any, config: FinetuneConfig) -> tuple[tuple[str, ...], bool]:
    """The target module names (config's, or the default for the model type) and whether they are
    GPT-2 ``Conv1D`` layers (peft's ``fan_in_fan_out``)."""
    model_type = str(getattr(model.config, "model_type", ""))
    targets = config.target_modules or default_target_modules(model_type)
    found = [m for n, m in model.named_modules() if any(n == t or n.endswith("." + t) for t in targets)]
    if not found:
        raise InvalidParameter(
            f"target_modules={list(targets)!r} matches no module of this {model_type!r} model"
        )
    conv1d = [_is_conv1d(m) for m in found]
    if any(conv1d) and not all(conv1d):
        raise InvalidParameter(
            f"target_modules={list(targets)!r} mixes GPT-2 Conv1D and other layers: adapt one kind"
        )
    return tuple(targets), all(conv1d)


def wrap_lora(model: Any, config: FinetuneConfig) -> tuple[Any, tuple[str, ...]]:
    """``(peft_model, target_modules)``: LoRA adapters on the targets; only they are trainable."""
    from peft import LoraConfig, get_peft_model

    targets, fan_in_fan_out = _resolve_targets(model, config)
    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,  # type: ignore[arg-type]  # peft annotates int, takes float
        lora_dropout=config.lora_dropout,
        target_modules=list(targets),
        fan_in_fan_out=fan_in_fan_out,
        bias="none",
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="peft")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        try:
            peft_model = get_peft_model(model, lora)
        except ValueError as exc:
            raise InvalidParameter(f"target_modules={list(targets)!r}: {exc}") from None
    for name, p in peft_model.named_parameters():
        p.requires_grad_("lora_" in name)  # the base stays frozen: only the adapters are released
    return peft_model, tuple(targets)
