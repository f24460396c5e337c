"""Release a DP-trained LoRA adapter: peft's files, a model card and a machine-readable guarantee.

:func:`save_adapter` writes, into one directory:

* ``adapter_config.json`` and ``adapter_model.safetensors``: peft's own format
  (``PeftModel.from_pretrained(base_model, out_dir)`` loads it; the base model is not included);
* ``README.md``: a model card (:func:`model_card`) that states both guarantees in plain words: the
  per-word metric local DP of the uploaded corpus (as the uploader declared it) and the
  record-level (epsilon, delta) central DP of the adapter;
* ``gaussdp_privacy.json``: the same facts as JSON (:func:`privacy_summary`).

:func:`adapter_zip` packs exactly those four files (deterministic bytes for the same files).
"""

from __future__ import annotations

import io
import json
import math
import numbers
import zipfile
from pathlib import Path
from typing import Any

from gaussdp._format import format_exact
from gaussdp.errors import InvalidParameter
from gaussdp.finetune.plan import epsilon_text
from gaussdp.finetune.train import FinetuneResult

__all__ = [
    "ADAPTER_FILES",
    "adapter_zip",
    "check_local_dp",
    "model_card",
    "privacy_summary",
    "save_adapter",
]

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "README.md", "gaussdp_privacy.json")
SCHEMA = "gaussdp.finetune.privacy/1"
_MAX_LOCAL_DP_JSON = 16_384  # bytes: the declaration is a few numbers and names, not a document


def check_local_dp(local_dp: Any) -> dict[str, Any] | None:
    """The uploader's local-DP declaration, checked: a dict of JSON values with string keys and
    finite numbers, at most 16 KiB of JSON (or ``None``). Returns a plain copy. Check it before
    training: :func:`save_adapter` refuses what this refuses.

    Raises:
        TypeError: not a dict or None.
        InvalidParameter: a non-string key, a non-finite number, a non-JSON value, or too large.
    """
    if local_dp is None:
        return None
    if not isinstance(local_dp, dict):
        raise TypeError(f"local_dp must be a dict or None, got {type(local_dp).__name__}")

    def check(v: Any, where: str) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise InvalidParameter(f"local_dp keys must be strings, got {k!r} in {where}")
                check(x, f"{where}.{k}")
        elif isinstance(v, list | tuple):
            for i, x in enumerate(v):
                check(x, f"{where}[{i}]")
        elif isinstance(v, bool) or v is None or isinstance(v, str):
            return
        elif isinstance(v, numbers.Real):
            if not math.isfinite(float(v)):
                raise InvalidParameter(f"local_dp{where} must be finite, got {v!r}")
        else:
            raise InvalidParameter(f"local_dp{where} must be a JSON value, got {type(v).__name__}")

    check(local_dp, "")
    text = json.dumps(local_dp, sort_keys=True)
    if len(text.encode()) > _MAX_LOCAL_DP_JSON:
        raise InvalidParameter(f"local_dp is larger than {_MAX_LOCAL_DP_JSON} bytes of JSON")
    return json.loads(text)  # a plain copy


def privacy_summary(
    result: FinetuneResult,
    *,
    local_dp: dict[str, Any] | None = None,
    corpus_name: str | None = None,
    attempts: int = 1,
) -> dict[str, Any]:
    """The facts the model card states, as plain JSON values (``gaussdp_privacy.json``)."""
    import gaussdp

    if not isinstance(result, FinetuneResult):
        raise TypeError(f"result must be a FinetuneResult, got {type(result).__name__}")
    if corpus_name is not None and not isinstance(corpus_name, str):
        raise TypeError(f"corpus_name must be a string or None, got {type(corpus_name).__name__}")
    plan, cfg = result.plan, result.config
    return {
        "schema": SCHEMA,
        "gaussdp_version": gaussdp.__version__,
        "private": result.private,
        "corpus_name": corpus_name,
        "base_model": Path(result.base_model).name,
        "model_type": result.model_type,
        "central_dp": {
            "epsilon": result.epsilon,
            "delta": plan.delta,
            "accountant": plan.accountant,
            "neighbouring": "add_remove",
            "privacy_unit": "one record (one line, or one JSONL object) of the training corpus",
            "sample_rate": plan.sample_rate,
            "sampling": "poisson",
            "steps": result.steps_done,
            "steps_applied": result.steps_applied or result.steps_done - result.steps_lost,
            "steps_lost": result.steps_lost,
            "attempts": attempts,
            "planned_steps": plan.steps,
            "planned_epsilon": plan.epsilon,
            "epochs": plan.epochs,
            "n_records": plan.n_records,
            "expected_batch_size": plan.expected_batch_size,
            "noise_multiplier": plan.noise_multiplier,
            "clip_norm": plan.clip_norm,
            "target_epsilon": plan.target_epsilon,
            "event": plan.event.to_dict(),
            "noise_source": result.noise_stream,
        },
        "local_dp": check_local_dp(local_dp),
        "validation": None
        if not result.validation_losses
        else {
            "declared_public": True,
            "records": result.validation_records,
            "loss": "per-record mean next-token cross-entropy, averaged over the records",
            "losses": [[st, loss] for st, loss in result.validation_losses],
        },
        "lora": {
            "rank": cfg.lora_rank,
            "alpha": cfg.lora_alpha,
            "dropout": cfg.lora_dropout,
            "target_modules": list(result.target_modules),
            "trainable_parameters": result.trainable_parameters,
        },
        "training": {
            "learning_rate": cfg.learning_rate,
            "max_seq_len": cfg.max_seq_len,
            "optimizer": "adam",
            "loss": "per-record mean next-token cross-entropy",
        },
    }


def _fmt(x: Any) -> str:
    """A parameter as given (the shortest decimal that reads back as the same float)."""
    if isinstance(x, float):
        return format_exact(x)
    return str(x)


def _md(text: str) -> str:
    """A declared value on one line of Markdown: no line breaks, no markup or HTML."""
    flat = " ".join(str(text).split())[:200]
    for ch in "\\`*_[]<>|#":
        flat = flat.replace(ch, "\\" + ch)
    return flat


def _local_dp_text(local: dict[str, Any] | None) -> list[str]:
    if local is None:
        return [
            "**Local DP of the upload: not declared.** Nothing is known here about how (or whether) "
            "the corpus was perturbed before upload; rely only on the central guarantee above.",
        ]
    mech = _md(local.get("mechanism", "not stated"))
    lines = [
        f"**Local DP of the upload (per word, as declared by the uploader).** Each word of the "
        f"corpus was replaced by a noisy nearest word (`{mech}` mechanism) before it was "
        "uploaded, which is metric local differential privacy: the closer two words are in the "
        "embedding space, the harder they are to tell apart in the upload. The figures below "
        "are the uploader's declaration, not checked here:",
        "",
    ]
    per_word = local.get("epsilon_per_word")
    labels = {
        "nearest_neighbour": "a word vs its typical nearest neighbour",
        "worst_case": "a word vs any word of the vocabulary (worst case)",
    }
    if isinstance(per_word, dict):
        for key, label in labels.items():
            g = per_word.get(key)
            if isinstance(g, dict) and isinstance(g.get("epsilon"), int | float):
                delta = g.get("delta")
                lines.append(
                    f"- **per-word epsilon, {label}: {epsilon_text(float(g['epsilon']))}** (distance "
                    f"{_fmt(g.get('distance'))}, delta {_fmt(delta) if delta is not None else 0})"
                )
    for k, v in local.items():
        if v is None or (k == "epsilon_per_word" and isinstance(per_word, dict)):
            continue  # not declared (never printed as "None"); the per-word guarantee is above
        shown = json.dumps(v, sort_keys=True) if isinstance(v, dict | list) else _fmt(v)
        lines.append(f"- {_md(k)}: {_md(shown)}")
    if not isinstance(per_word, dict):
        lines.append("- per-word epsilon: not stated in the declaration")
    return lines


def model_card(
    result: FinetuneResult,
    *,
    local_dp: dict[str, Any] | None = None,
    corpus_name: str | None = None,
    attempts: int = 1,
) -> str:
    """The adapter's ``README.md``: what it is and both privacy guarantees, in plain words."""
    s = privacy_summary(result, local_dp=local_dp, corpus_name=corpus_name, attempts=attempts)
    c = s["central_dp"]
    corpus = _md(corpus_name) if corpus_name else "an uploaded corpus"
    eps, delta = epsilon_text(c["epsilon"]), format_exact(c["delta"])
    lines = [
        "---",
        "library_name: peft",
        "tags: [lora, differential-privacy, dp-sgd, gaussdp]",
        "---",
        "",
        f"# DP-LoRA adapter for `{_md(s['base_model'])}` ({_md(s['model_type'])})",
        "",
        f"LoRA adapters (rank {s['lora']['rank']}, alpha {_fmt(s['lora']['alpha'])}, on "
        f"{', '.join(_md(m) for m in s['lora']['target_modules'])}; "
        f"{s['lora']['trainable_parameters']} trainable parameters) fine-tuned on {corpus} "
        f"({c['n_records']} records) with DP-SGD by gaussdp {s['gaussdp_version']}. The base model is "
        "not included: load it, then `PeftModel.from_pretrained(base_model, this_directory)`.",
        "",
        "## Privacy",
        "",
    ]
    if not s["private"]:
        lines += [
            "**NOT PRIVATE: this run used a fixed seed for its sampling and noise, so anyone with the "
            "seed can remove the noise. The figures below describe the mechanism, not a guarantee.**",
            "",
        ]
    lines += [
        f"**Central DP of this adapter (per record): epsilon = {eps}, delta = {delta}.** Adding or "
        "removing any one record (one line of the corpus) changes the probability of obtaining "
        f"these adapter weights by at most a factor e^{eps}, except with probability {delta}. This "
        "holds for everything computed from the adapter, including text it generates. The base "
        "model's own training data are not covered.",
        "",
        f"- accountant: {c['accountant']} (an upper bound on epsilon, not an approximation)",
        f"- neighbouring relation: add/remove one record; privacy unit: {c['privacy_unit']}",
        f"- Poisson sampling, sample rate {_fmt(c['sample_rate'])} (expected batch "
        f"{_fmt(c['expected_batch_size'])} of {c['n_records']} records)",
        f"- steps: {c['steps']} of {c['planned_steps']} planned ({c['epochs']} epoch(s)); planned "
        f"epsilon {epsilon_text(c['planned_epsilon'])}",
        f"- resumed after interruptions: {c['attempts'] - 1} time(s); steps lost: {c['steps_lost']} "
        f"(released, so counted above, but their updates are not in the adapter: "
        f"{c['steps_applied']} applied)",
        f"- noise multiplier {_fmt(c['noise_multiplier'])}, per-record clip norm "
        f"{_fmt(c['clip_norm'])} over all LoRA parameters",
        f"- noise source: {_md(c['noise_source'])}",
        "",
    ]
    lines += _local_dp_text(s["local_dp"])
    v = s["validation"]
    if v is not None:
        (s0, l0), (s1, l1) = v["losses"][0], v["losses"][-1]
        lines += [
            "",
            "## Validation",
            "",
            f"**Validation loss: {l0:.4f} at step {s0} -> {l1:.4f} at step {s1}** (mean per-record "
            f"next-token cross-entropy on {v['records']} records that the data scientist declared "
            "public: measured on the adapter without noise and not charged, since it reveals "
            "nothing about the private corpus beyond the adapter itself).",
            "",
            "| step | validation loss |",
            "|---|---|",
            *(f"| {st} | {loss:.4f} |" for st, loss in v["losses"]),
        ]
    lines += [
        "",
        "The two guarantees protect different things: the local one each word of the upload, "
        "against whoever holds the corpus; the central one each record, against whoever holds the "
        "adapter. They are not added together.",
        "",
        "Machine-readable: `gaussdp_privacy.json` in this directory.",
        "",
    ]
    return "\n".join(lines)


def save_adapter(
    result: FinetuneResult,
    out_dir: str | Path,
    *,
    local_dp: dict[str, Any] | None = None,
    corpus_name: str | None = None,
    attempts: int = 1,
) -> Path:
    """Write the adapter (peft format), its model card and ``gaussdp_privacy.json`` to ``out_dir``.

    Args:
        result: :func:`gaussdp.finetune.run_finetune`'s result.
        out_dir: directory (created if missing; files of the same names are replaced).
        local_dp: the uploader's declaration of the corpus's per-word local DP, e.g.
            ``{"mechanism": "gaussian", "sigma": 0.4, "epsilon_per_word": 3.1, "vocabulary":
            "glove-50"}``, JSON values only; ``None`` -> "not declared" in the card.
        corpus_name: shown in the card.
        attempts: how many workers took the job (> 1: it was resumed after interruptions).

    Returns:
        ``out_dir`` as a ``Path``.
    """
    summary = privacy_summary(result, local_dp=local_dp, corpus_name=corpus_name, attempts=attempts)
    card = model_card(result, local_dp=local_dp, corpus_name=corpus_name, attempts=attempts)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result.peft_model.save_pretrained(out, safe_serialization=True)
    (out / "README.md").write_text(card, encoding="utf-8")  # replaces peft's template card
    (out / "gaussdp_privacy.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return out


def adapter_zip(out_dir: str | Path) -> bytes:
    """A zip of :data:`ADAPTER_FILES` from ``out_dir`` (fixed timestamps: same files, same bytes).

    Raises:
        InvalidParameter: ``out_dir`` is not a directory or lacks one of the files.
    """
    d = Path(out_dir)
    if not d.is_dir():
        raise InvalidParameter(f"out_dir {str(d)!r} is not a directory")
    missing = [f for f in ADAPTER_FILES if not (d / f).is_file()]
    if missing:
        raise InvalidParameter(f"out_dir {str(d)!r} lacks {missing}: write it with save_adapter")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name in ADAPTER_FILES:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, (d / name).read_bytes())
    return buf.getvalue()
