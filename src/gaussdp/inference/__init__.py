"""Private inference: noise a model's hidden states at one layer, charged per session (extra ``torch``).

* :class:`HiddenStatePrivatizer`: a forward hook that clips each token's (or sequence's) hidden
  state, charges the session's ledger, adds calibrated Gaussian noise, and removes itself cleanly.
* :func:`stream_generate`: streaming generation, charged per request and per new token; greedy,
  or sampled by a :class:`Sampler` (post-processing of the noised state: no extra charge).
* Split mode (the private inference server): :func:`client_forward` / :func:`server_lora_delta` /
  :func:`client_finish`, with a :class:`LoRABackend` for the server's delta computation
  (:class:`PlainLoRABackend`; :class:`CKKSLoRABackend` with TenSEAL, optional).
* CKKS split mode across the wire (:mod:`gaussdp.inference.ckks`, extra ``he``): the client's
  :class:`CKKSClient` keeps the secret key; the server's :func:`ckks_lora_delta` computes the whole
  delta on ciphertext (packed, baby-step/giant-step), from a :class:`CKKSPublicContext`.
* Diagnostics: :func:`analytic_snr`, :func:`measure_snr`, :func:`output_effect`,
  :func:`utility_report`.

The neighbouring relation and what the guarantee covers are stated in
:mod:`gaussdp.inference.privatizer`.
"""

from __future__ import annotations

from gaussdp._extras import require_extra

require_extra("torch", feature="gaussdp.inference")

from gaussdp.inference._layers import find_last_block, resolve_layer
from gaussdp.inference.backends import CKKSLoRABackend, LoRABackend, PlainLoRABackend
from gaussdp.inference.ckks import CKKSClient, CKKSLoRAPlan, CKKSPublicContext, ckks_lora_delta
from gaussdp.inference.diagnostics import (
    OutputEffect,
    SNRFigures,
    UtilityReport,
    analytic_snr,
    measure_snr,
    output_effect,
    utility_report,
)
from gaussdp.inference.generation import stream_generate
from gaussdp.inference.privatizer import HiddenStatePrivatizer, ReleaseStats
from gaussdp.inference.sampling import Sampler
from gaussdp.inference.split import (
    client_finish,
    client_forward,
    server_lora_delta,
)

__all__ = [
    "CKKSClient",
    "CKKSLoRABackend",
    "CKKSLoRAPlan",
    "CKKSPublicContext",
    "HiddenStatePrivatizer",
    "LoRABackend",
    "OutputEffect",
    "PlainLoRABackend",
    "ReleaseStats",
    "SNRFigures",
    "Sampler",
    "UtilityReport",
    "analytic_snr",
    "ckks_lora_delta",
    "client_finish",
    "client_forward",
    "find_last_block",
    "measure_snr",
    "output_effect",
    "resolve_layer",
    "server_lora_delta",
    "stream_generate",
    "utility_report",
]
