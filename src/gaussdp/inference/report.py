"""The privacy/utility sweep of ``gaussdp inference-report``, and its PNG (matplotlib, Agg backend).

For a fixed per-token epsilon the noise is ``sigma = sigma_for(epsilon, delta, 2C)`` under the default
relation (replace-one, :mod:`gaussdp._neighbouring`; ``C`` under add_remove), so the SNR bound
``C / (sigma sqrt(d))`` does not depend on the clip norm C at all: C only decides how much of the
hidden state clipping throws away. The sweep shows both effects.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gaussdp._extras import require_extra
from gaussdp._neighbouring import DEFAULT_HIDDEN_STATE_NEIGHBOURING, hidden_state_sensitivity
from gaussdp.calibration import classical_sigma, epsilon_for, sigma_for
from gaussdp.inference.diagnostics import SNRFigures, UtilityReport, analytic_snr, measure_snr, utility_report

__all__ = ["Document000", "document_000", "plot_privacy_utility", "sweep", "tiny_causal_lm"]


@dataclass(frozen=True)
class Document000:
    """The private inference server's setting, with its true figures.

    Attributes:
        analytic: :class:`SNRFigures` in closed form (d=1536, C=1, classical sigma for (1, 1e-5)).
        measured: the same, measured on random 1536-vectors of norm 177.5 (the document's
            post-transformer norm) with fresh noise.
        claimed_snr: the SNR the document reports (unclipped norm / noise norm).
        epsilon_add_remove: exact per-request epsilon of that sigma with sensitivity C (the
            document's Delta_f = 1): below its claimed 1.0, because the classical formula over-noises.
        epsilon_replace: exact per-request epsilon with sensitivity 2C (any two hidden states).
        epsilon_for_snr_1: per-request epsilon (replace-one) at which the SNR bound reaches 1 at d=1536.
    """

    analytic: SNRFigures
    measured: SNRFigures
    claimed_snr: float
    epsilon_add_remove: float
    epsilon_replace: float
    epsilon_for_snr_1: float


def document_000(*, rows: int = 256, seed: int | None = None) -> Document000:
    """Reproduce the private inference server's setting and its true SNR (see :class:`Document000`)."""
    import numpy as np

    dim, clip, delta, norm = 1536, 1.0, 1e-5, 177.5
    sigma = classical_sigma(epsilon=1.0, delta=delta)  # 4.8448, as the document computes it
    analytic = analytic_snr(dim=dim, clip_norm=clip, sigma=sigma, unclipped_norm=norm)
    # Synthetic hidden states with the document's norm, random directions (data, not noise).
    rng = np.random.default_rng(12345)
    h = rng.standard_normal((rows, dim))
    h *= norm / np.linalg.norm(h, axis=1, keepdims=True)
    measured = measure_snr(h, clip_norm=clip, sigma=sigma, seed=seed)
    sigma_snr_1 = clip / (math.sqrt(dim))  # SNR bound C / (sigma sqrt d) = 1
    return Document000(
        analytic=analytic,
        measured=measured,
        claimed_snr=norm / (4.84 * math.sqrt(dim)),
        epsilon_add_remove=epsilon_for(sigma=sigma, delta=delta, sensitivity=clip),
        epsilon_replace=epsilon_for(sigma=sigma, delta=delta, sensitivity=2 * clip),
        epsilon_for_snr_1=epsilon_for(sigma=sigma_snr_1, delta=delta, sensitivity=2 * clip),
    )


def tiny_causal_lm(*, seed: int = 0, vocab_size: int = 100) -> Any:
    """A 2-layer GPT-2 (d=64, vocabulary 100) built from a config: no download, random weights.

    The weights are drawn 10x wider than GPT-2's default (``initializer_range=0.2``) so that the
    next-token distribution is far from uniform and KL / agreement figures move visibly; the numbers
    illustrate the mechanics only. Pass a trained model (``--model DIR``, e.g. from
    ``gaussdp train-tiny-lm DIR``, :mod:`gaussdp.inference.tiny_lm`) for figures that mean something.
    """
    require_extra("hf", feature="the inference report's model")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=vocab_size,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
        initializer_range=0.2,
    )
    return GPT2LMHeadModel(config).eval()


def sweep(
    model: Any,
    prompts: Sequence[Any],
    *,
    epsilons: Sequence[float],
    clip_norms: Sequence[float],
    delta: float,
    layer: Any = None,
    per: str = "token",
    neighbouring: str = DEFAULT_HIDDEN_STATE_NEIGHBOURING,
    seed: int | None = None,
) -> list[UtilityReport]:
    """One :func:`utility_report` per (clip norm, per-token epsilon), calibrated under ``neighbouring``
    (default: replace-one, sensitivity 2C, the default of every hidden-state surface)."""
    out = []
    for c in clip_norms:
        for eps in epsilons:
            sigma = sigma_for(epsilon=eps, delta=delta, sensitivity=hidden_state_sensitivity(c, neighbouring))
            out.append(
                utility_report(
                    model,
                    prompts,
                    clip_norm=c,
                    sigma=sigma,
                    delta=delta,
                    layer=layer,
                    per=per,
                    neighbouring=neighbouring,
                    seed=seed,
                )
            )
    return out


def plot_privacy_utility(
    reports: Sequence[UtilityReport], path: str | Path, *, doc: Document000 | None = None
) -> Path:
    """Draw next-token agreement, KL and SNR against epsilon per token, one line per clip norm."""
    require_extra("plot", feature="the inference report's plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    relation = ", ".join(sorted({r.neighbouring for r in reports})) or DEFAULT_HIDDEN_STATE_NEIGHBOURING
    clips = sorted({r.clip_norm for r in reports})
    for c in clips:
        rs = sorted((r for r in reports if r.clip_norm == c), key=lambda r: r.epsilon_per_token or 0.0)
        eps = [r.epsilon_per_token for r in rs]
        axes[0].plot(eps, [r.agreement for r in rs], marker="o", label=f"C={c:.3g}")
        axes[1].plot(eps, [max(r.kl, 1e-12) for r in rs], marker="o", label=f"C={c:.3g}")
        axes[2].plot(eps, [r.snr for r in rs], marker="o", label=f"measured, C={c:.3g}")
    if reports:
        rs = sorted(reports, key=lambda r: r.epsilon_per_token or 0.0)
        axes[2].plot(
            [r.epsilon_per_token for r in rs],
            [r.snr_analytic for r in rs],
            "k--",
            label="bound C/(sigma sqrt d)",
        )
    axes[0].set_ylabel("next-token agreement with the clean model")
    axes[1].set_ylabel("KL(clean || private), nats")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("SNR = ||clipped h|| / ||noise||")
    axes[2].set_yscale("log")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel(f"epsilon per token ({relation}, exact)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if doc is not None:
        axes[2].axhline(doc.analytic.snr, color="red", lw=1)
        axes[2].set_title(
            "red line: the private inference server (d=1536, C=1, sigma=4.8448),\n"
            f"SNR {doc.analytic.snr:.4f}, "
            f"not the {doc.claimed_snr:.2f} it claims",
            fontsize=9,
            color="red",
        )
    d = reports[0].dim if reports else 0
    fig.suptitle(
        f"Hidden-state privatization: privacy/utility (d={d}, delta={reports[0].delta if reports else ''})"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
