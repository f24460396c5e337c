"""A typed Python client of the gaussdp service (``gaussdp serve``): extra ``client`` (httpx, websockets).

>>> from gaussdp.client import GaussDPClient                       # doctest: +SKIP
>>> c = GaussDPClient("http://127.0.0.1:8000", "gdp_...")
>>> s = c.create_session(epsilon=4.0, delta=1e-5)
>>> c.generate(s.session_id, model="tiny", prompt="the minister", noise_multiplier=8.0).text

One method per route (sessions, history, ``release``, ``hidden_state``, ``lora_delta``,
``generate``, ``stream_generate``, CKKS, and fine-tuning: ``upload_corpus``,
``start_finetune_job``, ``watch_finetune_job``, ``download_adapter``) plus ``split_lora_delta``
(split inference with the model on the client), all HTTP calls through
:meth:`GaussDPClient.request` (retries with one idempotency key per call). Errors are
:class:`ServiceError` subclasses; :class:`BudgetExhausted` is also a
:class:`gaussdp.errors.BudgetExhausted`.
"""

from __future__ import annotations

from gaussdp._extras import require_extra

require_extra("client", feature="gaussdp.client")

from gaussdp.client._client import GaussDPClient
from gaussdp.client._errors import (
    BudgetExhausted,
    ConnectionFailed,
    Forbidden,
    IdempotencyKeyUsed,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    ResponseLost,
    ServiceError,
    ServiceUnavailable,
    Unauthorized,
)
from gaussdp.client._stream import TokenStream
from gaussdp.client._types import (
    Charge,
    Corpus,
    FinetuneJob,
    Generation,
    HiddenState,
    LoraDelta,
    Privacy,
    Release,
    Session,
    Token,
)

__all__ = [
    "BudgetExhausted",
    "Charge",
    "ConnectionFailed",
    "Corpus",
    "FinetuneJob",
    "Forbidden",
    "GaussDPClient",
    "Generation",
    "HiddenState",
    "IdempotencyKeyUsed",
    "InvalidRequest",
    "LimitExceeded",
    "LoraDelta",
    "NotFound",
    "Privacy",
    "Release",
    "ResponseLost",
    "ServiceError",
    "ServiceUnavailable",
    "Session",
    "Token",
    "TokenStream",
    "Unauthorized",
]
