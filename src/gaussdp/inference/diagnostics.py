"""Measure what hidden-state noise does: norms, signal-to-noise ratio, and the effect on the output.

The signal that survives clipping has norm at most ``C`` whatever the hidden state's norm was; the
noise ``N(0, sigma^2 I_d)`` has norm about ``sigma sqrt(d)``. So the signal-to-noise ratio of a
privatized hidden state is at most ``C / (sigma sqrt(d))``. The private inference server clips to ``C = 1``
and adds ``sigma = 4.84`` in ``d = 1536`` dimensions: noise norm about 190, SNR about 0.005, not the ~0.94 it
reports by dividing the *unclipped* norm (~177.5) by the noise norm. :func:`analytic_snr` gives these
figures; :func:`measure_snr` measures them on real vectors; :func:`utility_report` measures the
effect on a model's next-token predictions against the clean model.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy import special

from gaussdp._neighbouring import DEFAULT_HIDDEN_STATE_NEIGHBOURING
from gaussdp._validate import check_positive
from gaussdp.errors import InvalidParameter, NotPrivateWarning

__all__ = [
    "OutputEffect",
    "SNRFigures",
    "UtilityReport",
    "analytic_snr",
    "measure_snr",
    "output_effect",
    "utility_report",
]


@dataclass(frozen=True)
class SNRFigures:
    """Norms and signal-to-noise ratio of one privatized vector (analytic or measured).

    Attributes:
        dim: vector length d.
        clip_norm: the clip C.
        sigma: noise standard deviation per coordinate.
        signal_norm: norm of the signal after clipping (analytic: C, its maximum; measured: mean).
        noise_norm_rms: ``sigma * sqrt(d)``, the root-mean-square noise norm (the private inference server's
            figure).
        noise_norm_mean: ``E||N(0, sigma^2 I_d)||`` exactly (analytic) or measured mean.
        snr: ``signal_norm / noise_norm_mean``.
        unclipped_norm: the hidden state's norm before clipping, when known (mean if measured).
        naive_snr: ``unclipped_norm / noise_norm_rms``, the ratio the private inference server reports (not
            the signal that is released: the released signal has norm <= C).
    """

    dim: int
    clip_norm: float
    sigma: float
    signal_norm: float
    noise_norm_rms: float
    noise_norm_mean: float
    snr: float
    unclipped_norm: float | None = None
    naive_snr: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _expected_chi_norm(dim: int, sigma: float) -> float:
    # E||z|| for z ~ N(0, sigma^2 I_d) is sigma * sqrt(2) * Gamma((d+1)/2) / Gamma(d/2) (chi mean).
    return sigma * math.sqrt(2.0) * math.exp(special.gammaln((dim + 1) / 2) - special.gammaln(dim / 2))


def analytic_snr(
    *, dim: int, clip_norm: float, sigma: float, unclipped_norm: float | None = None
) -> SNRFigures:
    """The SNR of a hidden state clipped to ``clip_norm`` and noised with ``sigma``, in closed form.

    >>> f = analytic_snr(dim=1536, clip_norm=1.0, sigma=4.8448, unclipped_norm=177.5)
    >>> round(f.noise_norm_rms, 1), round(f.snr, 5), round(f.naive_snr, 3)
    (189.9, 0.00527, 0.935)
    """
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim < 1:
        raise InvalidParameter(f"dim must be an integer >= 1, got dim={dim!r}")
    c = check_positive("clip_norm", clip_norm)
    s = check_positive("sigma", sigma)
    rms = s * math.sqrt(dim)
    mean = _expected_chi_norm(int(dim), s)
    naive = None
    if unclipped_norm is not None:
        naive = check_positive("unclipped_norm", unclipped_norm) / rms
    return SNRFigures(
        dim=int(dim),
        clip_norm=c,
        sigma=s,
        signal_norm=c,
        noise_norm_rms=rms,
        noise_norm_mean=mean,
        snr=c / mean,
        unclipped_norm=None if unclipped_norm is None else float(unclipped_norm),
        naive_snr=naive,
    )


def measure_snr(hidden: Any, *, clip_norm: float, sigma: float, seed: int | None = None) -> SNRFigures:
    """Clip the rows of ``hidden`` (n, d), draw the noise, and measure mean norms and SNR.

    This is an experiment, not a release: nothing is charged and the noised vectors are dropped.
    ``seed`` makes it reproducible (and warns NotPrivateWarning, as every seeded draw does).
    """
    from gaussdp.clipping import clip_rows
    from gaussdp.noise import gaussian_like, noise_source

    s = check_positive("sigma", sigma)
    if type(hidden).__module__.split(".")[0] == "torch":
        hidden = hidden.detach().reshape(-1, hidden.shape[-1]).cpu().double().numpy()
    arr = np.asarray(hidden, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    clipped, norms = clip_rows(arr, clip_norm)
    source = noise_source(seed=seed) if seed is not None else noise_source("fast")
    noise = np.asarray(gaussian_like(clipped, s, source), dtype=np.float64)
    signal = float(np.linalg.norm(clipped, axis=1).mean())
    noise_mean = float(np.linalg.norm(noise, axis=1).mean())
    unclipped = float(norms.mean())
    rms = s * math.sqrt(arr.shape[1])
    return SNRFigures(
        dim=int(arr.shape[1]),
        clip_norm=float(clip_norm),
        sigma=s,
        signal_norm=signal,
        noise_norm_rms=rms,
        noise_norm_mean=noise_mean,
        snr=signal / noise_mean,
        unclipped_norm=unclipped,
        naive_snr=unclipped / rms,
    )


@dataclass(frozen=True)
class OutputEffect:
    """How a privatized model's next-token predictions differ from the clean model's.

    Attributes:
        agreement: share of positions whose most likely next token is the same.
        kl: mean KL(clean || private) of the next-token distributions, in nats.
        ppl_clean, ppl_private: perplexity of the prompts' own next tokens (teacher forcing).
        positions: number of positions compared.
    """

    agreement: float
    kl: float
    ppl_clean: float
    ppl_private: float
    positions: int


def _logits(output: Any) -> Any:
    import torch

    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find logits in a model output of type {type(output).__name__}")


def output_effect(clean_logits: Any, private_logits: Any, input_ids: Any = None) -> OutputEffect:
    """Compare two ``(batch, seq, vocab)`` logit tensors position by position.

    Perplexity is computed when ``input_ids`` is given (the next token at each position is the
    target); otherwise it is NaN.
    """
    import torch
    import torch.nn.functional as F

    if clean_logits.shape != private_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(clean_logits.shape)} vs {tuple(private_logits.shape)}")
    lc = F.log_softmax(clean_logits.detach().double(), dim=-1)
    lp = F.log_softmax(private_logits.detach().double(), dim=-1)
    agreement = (lc.argmax(-1) == lp.argmax(-1)).double().mean().item()
    kl = (lc.exp() * (lc - lp)).sum(-1).mean().item()
    ppl_c = ppl_p = float("nan")
    if input_ids is not None and lc.shape[-2] > 1:
        target = torch.as_tensor(input_ids)[..., 1:].reshape(-1)
        nll_c = F.nll_loss(lc[..., :-1, :].reshape(-1, lc.shape[-1]), target)
        nll_p = F.nll_loss(lp[..., :-1, :].reshape(-1, lp.shape[-1]), target)
        ppl_c, ppl_p = math.exp(nll_c.item()), math.exp(nll_p.item())
    return OutputEffect(
        agreement=float(agreement),
        kl=float(kl),
        ppl_clean=ppl_c,
        ppl_private=ppl_p,
        positions=int(lc.shape[:-1].numel()),
    )


@dataclass(frozen=True)
class UtilityReport:
    """One point of the privacy/utility curve, averaged over a set of prompts.

    ``epsilon_per_token`` is the exact epsilon of one released row at ``delta`` (None without
    delta) under ``neighbouring``; the epsilon of a prompt of T tokens is the composition of T of them.
    """

    clip_norm: float
    sigma: float
    epsilon_per_token: float | None
    delta: float | None
    dim: int
    mean_hidden_norm: float
    fraction_clipped: float
    mean_noise_norm: float
    snr: float
    snr_analytic: float
    agreement: float
    kl: float
    ppl_clean: float
    ppl_private: float
    neighbouring: str = DEFAULT_HIDDEN_STATE_NEIGHBOURING

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def utility_report(
    model: Any,
    prompts: Iterable[Any],
    *,
    clip_norm: float,
    sigma: float,
    delta: float | None = None,
    layer: Any = None,
    per: str = "token",
    neighbouring: str = DEFAULT_HIDDEN_STATE_NEIGHBOURING,
    seed: int | None = None,
) -> UtilityReport:
    """Run each prompt through the clean model and through a privatized copy of the pass; compare.

    Args:
        model: a PyTorch model whose output is logits or has ``.logits``.
        prompts: token-id sequences (lists or ``(1, T)`` / ``(T,)`` tensors).
        clip_norm, sigma, layer, per, neighbouring: as in :class:`HiddenStatePrivatizer`.
        delta: only to report the per-token epsilon.
        seed: reproducible noise (not private; the warning is silenced here because this is a
            measurement whose noised outputs are dropped, never a release).

    Returns:
        A :class:`UtilityReport` averaged over prompts (weighted by positions).
    """
    import torch

    from gaussdp.calibration import epsilon_for
    from gaussdp.inference.privatizer import HiddenStatePrivatizer

    ids_list = [_as_ids(p) for p in prompts]
    if not ids_list:
        raise InvalidParameter("prompts is empty")
    was_training = model.training
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        priv = HiddenStatePrivatizer(
            model,
            layer,
            clip_norm=clip_norm,
            sigma=sigma,
            delta=delta,
            per=per,  # type: ignore[arg-type]
            neighbouring=neighbouring,  # type: ignore[arg-type]
            noise="fast",
            seed=seed,
            session_id="utility-report",
        )
    effects: list[OutputEffect] = []
    norms: list[float] = []
    clipped: list[float] = []
    noise_norms: list[float] = []
    snrs: list[float] = []
    weights: list[int] = []
    dim = 0
    try:
        for ids in ids_list:
            with torch.no_grad():
                clean = _logits(model(ids))  # the privatizer is not attached: the clean model
                with priv:
                    private = _logits(model(ids))
            stats = priv.last_release
            if stats is None:
                raise RuntimeError("the privatizer's hook did not run: its layer is not used by the model")
            dim = stats.dim
            effects.append(output_effect(clean, private, ids))
            norms.append(stats.mean_norm)
            clipped.append(stats.fraction_clipped)
            noise_norms.append(stats.mean_noise_norm)
            snrs.append(stats.snr)
            weights.append(stats.rows)
    finally:
        priv.remove()
        model.train(was_training)
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    pos = np.asarray([e.positions for e in effects], dtype=np.float64)
    pw = pos / pos.sum()

    def avg(values: Sequence[float], weights_: np.ndarray = w) -> float:
        return float(np.dot(np.asarray(values, dtype=np.float64), weights_))

    nll_c = avg([math.log(e.ppl_clean) for e in effects], pw)
    nll_p = avg([math.log(e.ppl_private) for e in effects], pw)
    return UtilityReport(
        clip_norm=float(clip_norm),
        sigma=float(sigma),
        epsilon_per_token=None
        if delta is None
        else epsilon_for(sigma=sigma, delta=delta, sensitivity=priv.sensitivity),
        delta=delta,
        dim=dim,
        mean_hidden_norm=avg(norms),
        fraction_clipped=avg(clipped),
        mean_noise_norm=avg(noise_norms),
        snr=avg(snrs),
        snr_analytic=analytic_snr(dim=dim, clip_norm=clip_norm, sigma=sigma).snr,
        agreement=avg([e.agreement for e in effects], pw),
        kl=avg([e.kl for e in effects], pw),
        ppl_clean=math.exp(nll_c),
        ppl_private=math.exp(nll_p),
        neighbouring=priv.neighbouring,
    )


def _as_ids(prompt: Any) -> Any:
    import torch

    ids = torch.as_tensor(prompt, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None, :]
    if ids.dim() != 2 or ids.shape[1] < 2:
        raise InvalidParameter(f"each prompt needs at least 2 token ids, got shape {tuple(ids.shape)}")
    return ids
