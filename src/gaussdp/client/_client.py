"""The synchronous client: one method per route, all through :meth:`GaussDPClient.request`."""

from __future__ import annotations

import base64
import functools
import json
import secrets
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import numpy as np

from gaussdp.client._errors import ConnectionFailed, ServiceError, ServiceUnavailable, error_for
from gaussdp.client._finetune import FinetuneCalls
from gaussdp.client._stream import TokenStream
from gaussdp.client._types import (
    Charge,
    Generation,
    HiddenState,
    LoraDelta,
    Privacy,
    Release,
    Session,
    Token,
)
from gaussdp.errors import UnsafeInput

__all__ = ["GaussDPClient"]

_MAX_WAIT_S = 5.0  # longest pause between two attempts, whatever Retry-After says


def _new_key() -> str:
    """An idempotency key made once per logical call (and reused by its retries)."""
    return "c-" + secrets.token_urlsafe(18)


def _finite(name: str, x: Any, dtype: Any) -> np.ndarray:
    """``x`` as an array, refused here (nothing sent) when empty or holding NaN or Inf."""
    arr = np.asarray(_numpy(x), dtype=dtype)
    if arr.size == 0 or not np.isfinite(arr).all():
        raise UnsafeInput(
            f"{name} must be a non-empty array of finite numbers (NaN, Inf or empty); nothing sent"
        )
    return arr


def _b64(x: Any) -> str:
    arr = np.ascontiguousarray(np.asarray(_numpy(x), dtype="<f4"))
    return base64.b64encode(arr.tobytes()).decode()


def _from_b64(s: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(s), dtype="<f4").astype(np.float32)


def _numpy(x: Any) -> Any:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x


def _noise(epsilon: float | None, delta: float | None, sigma: float | None) -> dict[str, float]:
    return {
        k: float(v) for k, v in (("epsilon", epsilon), ("delta", delta), ("sigma", sigma)) if v is not None
    }


class GaussDPClient(FinetuneCalls):
    """A typed client of the gaussdp service (``gaussdp serve``), over httpx and WebSocket.

    >>> with GaussDPClient("http://127.0.0.1:8000", api_key) as c:      # doctest: +SKIP
    ...     s = c.create_session(epsilon=4.0, delta=1e-5)
    ...     for token in c.stream_generate(s.session_id, model="tiny", prompt="the", noise_multiplier=8):
    ...         print(token.text)

    Retries: a call is attempted up to ``1 + retries`` times when the connection fails or drops, or
    the service answers 429, 503 or 409 ``ledger_contention`` (waiting ``Retry-After``, at most 5 s).
    Only calls that are safe to repeat are retried: reads, and writes whose body carries an
    idempotency key. Every charging call gets a key made once per call (or the caller's) and sent
    unchanged on each retry, so a retried release is charged once and released once: if the first
    attempt's answer was lost after the charge, the retry raises :class:`ResponseLost` (the service
    never releases a second noisy answer under one charge) and the history shows one charge.
    ``create_session`` picks the session id on the client, so that a retry opens the same session.

    Args:
        base_url: the service's address, e.g. ``"http://127.0.0.1:8000"``.
        api_key: a key from ``gaussdp keys create TENANT`` (sent as a Bearer token).
        timeout: seconds for each HTTP call and each WebSocket message.
        retries: extra attempts of a call that may be retried (>= 0).
        backoff_s: first pause between attempts (doubled each time) without ``Retry-After``.
        transport: an httpx transport (tests: in-process or fault-injecting).
    """

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        timeout: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise ValueError(f"retries must be an integer >= 0, got retries={retries!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0, got timeout={timeout!r}")
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.timeout = float(timeout)
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=timeout,
            transport=transport,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> GaussDPClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: dict[str, Any] | None = None,
        params: dict[str, Any] | None = None,
        retry: bool | None = None,
        content: bytes | Iterator[bytes] | None = None,
        content_type: str = "application/octet-stream",
        content_length: int | None = None,
    ) -> Any:
        """One call to the service, with retries; returns the decoded JSON answer.

        Args:
            retry: whether the call may be repeated (default: for GET, and for a body with an
                ``idempotency_key``). Any new route goes through here (e.g. CKKS routes).
            content: a raw body instead of ``json_body`` (sent as ``content_type``): bytes, or an
                iterator of chunks streamed with ``content_length`` (never retried: it is consumed).

        Raises:
            ServiceError: a subclass per refusal (:class:`BudgetExhausted`, :class:`NotFound`,
                :class:`InvalidRequest`, :class:`ResponseLost`, ...), or :class:`ConnectionFailed`.
        """
        if retry is None:
            retry = method.upper() == "GET" or bool(json_body and json_body.get("idempotency_key"))
        if content is not None and not isinstance(content, bytes):
            retry = False
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            last = attempt == attempts - 1
            try:
                if content is not None:
                    headers = {"Content-Type": content_type}
                    if content_length is not None:
                        headers["Content-Length"] = str(content_length)
                    r = self._http.request(method, path, content=content, params=params, headers=headers)
                else:
                    r = self._http.request(method, path, json=json_body, params=params)
            except httpx.TransportError as exc:
                if last:
                    raise ConnectionFailed(
                        f"{method} {path}: {type(exc).__name__}: {exc} (after {attempt + 1} attempts)"
                    ) from exc
                self._pause(attempt, None)
                continue
            if r.is_success:
                return r.json()
            body = _decode(r)
            err = error_for(r.status_code, body, retried=attempt > 0)
            if isinstance(err, ServiceUnavailable) and not last:
                self._pause(attempt, r.headers.get("Retry-After"))
                continue
            raise err
        raise AssertionError("unreachable")  # pragma: no cover

    def _pause(self, attempt: int, retry_after: str | None) -> None:
        try:
            wait = float(retry_after) if retry_after is not None else self.backoff_s * 2**attempt
        except ValueError:
            wait = self.backoff_s * 2**attempt
        time.sleep(min(max(wait, 0.0), _MAX_WAIT_S))

    # ------------------------------------------------------------------ sessions

    def create_session(
        self, *, epsilon: float, delta: float, accountant: str = "pld", session_id: str | None = None
    ) -> Session:
        """Open a session with a total ``(epsilon, delta)`` budget (the id is chosen here if not given,
        so that a retried call opens the same session)."""
        body = {
            "epsilon": float(epsilon),
            "delta": float(delta),
            "accountant": accountant,
            "session_id": session_id or secrets.token_urlsafe(12),
        }
        return Session.of(self.request("POST", "/v1/sessions", json_body=body, retry=True))

    def get_session(self, session_id: str) -> Session:
        return Session.of(self.request("GET", f"/v1/sessions/{session_id}"))

    def list_sessions(self) -> list[str]:
        return [str(s) for s in self.request("GET", "/v1/sessions")]

    def history(self, session_id: str, *, limit: int | None = None) -> list[Charge]:
        """The session's charges, oldest first (every page, or the first ``limit``)."""
        out: list[Charge] = []
        cursor = None
        while limit is None or len(out) < limit:
            params: dict[str, Any] = {"limit": 1000 if limit is None else min(1000, limit - len(out))}
            if cursor is not None:
                params["cursor"] = cursor
            page = self.request("GET", f"/v1/sessions/{session_id}/history", params=params)
            out += [Charge.of(c) for c in page["charges"]]
            cursor = page.get("next_cursor")
            if cursor is None:
                break
        return out

    # ------------------------------------------------------------------ releases

    def release(
        self,
        session_id: str,
        vector: Any,
        *,
        epsilon: float | None = None,
        delta: float | None = None,
        sigma: float | None = None,
        sensitivity: float = 1.0,
        idempotency_key: str | None = None,
    ) -> Release:
        """Clip ``vector`` to L2 norm ``sensitivity`` and noise it (``epsilon`` and ``delta``, or
        ``sigma``), charged to the session first. Sent and answered as JSON numbers (float64)."""
        x = _finite("vector", vector, np.float64).reshape(-1)
        body = {
            "vector": x.tolist(),
            "sensitivity": float(sensitivity),
            "idempotency_key": idempotency_key or _new_key(),
            **_noise(epsilon, delta, sigma),
        }
        d = self.request("POST", f"/v1/sessions/{session_id}/release", json_body=body)
        return Release(
            np.asarray(d["vector"], dtype=np.float64),
            float(d["sigma"]),
            float(d["sensitivity"]),
            int(d["charge_id"]),
            Privacy.of(d["spent"]),
            Privacy.of(d["remaining"]),
        )

    def hidden_state(
        self,
        session_id: str,
        hidden_state: Any,
        *,
        epsilon: float | None = None,
        delta: float | None = None,
        sigma: float | None = None,
        clip_norm: float = 1.0,
        neighbouring: str = "replace_one",
        idempotency_key: str | None = None,
    ) -> HiddenState:
        """A TRUSTED server clips and noises ``hidden_state`` (``/hidden-state``; the service's
        defaults epsilon=1, delta=1e-5 unless ``sigma`` or both are given)."""
        body: dict[str, Any] = {
            "hidden_state_b64": _b64(_finite("hidden_state", hidden_state, np.float32).reshape(-1)),
            "clip_norm": float(clip_norm),
            "neighbouring": neighbouring,
            "idempotency_key": idempotency_key or _new_key(),
            **_noise(epsilon, delta, sigma),
        }
        d = self.request("POST", f"/v1/sessions/{session_id}/hidden-state", json_body=body)
        return HiddenState(
            _from_b64(d["noised_b64"]),
            float(d["sigma"]),
            float(d["clip_norm"]),
            str(d["neighbouring"]),
            float(d["sensitivity"]),
            float(d["epsilon_spent"]),
            int(d["charge_id"]),
        )

    def lora_delta(
        self,
        session_id: str,
        noised: Any,
        *,
        adapter: str,
        clip_norm: float,
        sigma: float,
        neighbouring: str = "replace_one",
        idempotency_key: str | None = None,
    ) -> LoraDelta:
        """The server's LoRA delta of rows this client already clipped and noised (``/lora-delta``);
        the session is charged what ``clip_norm``, ``sigma`` and ``neighbouring`` declare."""
        rows = _finite("noised", noised, np.float32)
        rows = rows.reshape(-1, rows.shape[-1])
        body = {
            "adapter": adapter,
            "noised_b64": _b64(rows),
            "clip_norm": float(clip_norm),
            "sigma": float(sigma),
            "neighbouring": neighbouring,
            "idempotency_key": idempotency_key or _new_key(),
        }
        d = self.request("POST", f"/v1/sessions/{session_id}/lora-delta", json_body=body)
        return LoraDelta.of(_from_b64(d["delta_b64"]).reshape(int(d["rows"]), int(d["d_out"])), d)

    def upload_ckks_context(self, session_id: str, keys: Any) -> str:
        """Send ``keys.public_context()`` (a :class:`gaussdp.inference.ckks.CKKSClient`: parameters
        and rotation keys, never the secret key) for the session's CKKS calls; returns its
        ``context_id``. Costs no privacy; safe to repeat."""
        d = self.request(
            "POST", f"/v1/sessions/{session_id}/ckks-context", content=keys.public_context(), retry=True
        )
        return str(d["context_id"])

    def ckks_lora_delta(
        self,
        session_id: str,
        noised: Any,
        *,
        keys: Any,
        adapter: str,
        clip_norm: float,
        sigma: float,
        neighbouring: str = "replace_one",
        idempotency_key: str | None = None,
    ) -> LoraDelta:
        """:meth:`lora_delta` under CKKS: the server computes the delta on ciphertext it cannot decrypt.

        ``keys`` (a :class:`gaussdp.inference.ckks.CKKSClient`, extra ``he``) encrypts the rows this
        client already clipped and noised (at most 4 a call: the service's bound on the CPU of one
        request) and decrypts the answer; the session is charged what ``clip_norm``, ``sigma`` and
        ``neighbouring`` declare, before the server computes. The public context is uploaded
        when the server does not hold it (404 ``ckks_context_unknown``: first call, another worker
        process, or evicted), then the call is repeated with the same idempotency key (nothing
        was charged by the 404).

        Returns:
            A :class:`LoraDelta` whose ``delta`` is the decrypted ``(rows, d_out)`` (float64).
        """
        from gaussdp.client._errors import NotFound

        rows = _finite("noised", noised, np.float64)
        rows = rows.reshape(-1, rows.shape[-1])
        if rows.shape[0] > 4:
            raise UnsafeInput(f"noised has {rows.shape[0]} rows: at most 4 per CKKS call; nothing sent")
        body = {
            "context_id": keys.context_id,
            "adapter": adapter,
            "ciphertext_b64": base64.b64encode(keys.encrypt(rows)).decode(),
            "rows": int(rows.shape[0]),
            "clip_norm": float(clip_norm),
            "sigma": float(sigma),
            "neighbouring": neighbouring,
            "idempotency_key": idempotency_key or _new_key(),
        }
        path = f"/v1/sessions/{session_id}/ckks-lora-delta"
        for attempt in range(1 + self.retries):
            try:
                d = self.request("POST", path, json_body=body)
                break
            except NotFound as exc:
                if exc.error != "ckks_context_unknown" or attempt == self.retries:
                    raise
                self.upload_ckks_context(session_id, keys)
        delta = keys.decrypt_delta(base64.b64decode(d["ciphertext_b64"]), rows=int(d["rows"]))
        return LoraDelta.of(delta, d)

    def split_lora_delta(
        self,
        session_id: str,
        model: Any,
        input_ids: Any,
        privatizer: Any,
        *,
        adapter: str,
        layer: Any = None,
        positions: str = "last",
        rescale: bool = True,
        idempotency_key: str | None = None,
        ckks: Any = None,
        **model_kwargs: Any,
    ) -> tuple[Any, LoraDelta]:
        """Split inference against this service, the server untrusted.

        Locally :func:`gaussdp.inference.client_forward` (clip, charge ``privatizer``'s own
        accounting, noise: only the noised rows leave), then ``/lora-delta`` with the privatizer's
        ``sigma``, ``clip_norm`` and ``neighbouring`` (charged to the session), then locally
        :func:`gaussdp.inference.client_finish`. Needs the ``torch`` extra. With ``ckks=`` (a
        :class:`gaussdp.inference.ckks.CKKSClient`) the rows travel encrypted and the server
        computes on ciphertext (:meth:`ckks_lora_delta`).

        Returns:
            ``(output, delta)``: the model's output (e.g. with ``.logits``) and the server's answer.
        """
        from gaussdp.inference import client_finish, client_forward

        noised = client_forward(model, input_ids, layer, privatizer, positions=positions, **model_kwargs)  # type: ignore[arg-type]
        call: Any = self.lora_delta if ckks is None else functools.partial(self.ckks_lora_delta, keys=ckks)
        answer = call(
            session_id,
            noised,
            adapter=adapter,
            clip_norm=privatizer.clip_norm,
            sigma=privatizer.sigma,
            neighbouring=privatizer.neighbouring,
            idempotency_key=idempotency_key,
        )
        out = client_finish(
            model,
            input_ids,
            layer if layer is not None else privatizer.module,
            answer.delta.reshape(*noised.shape[:-1], answer.delta.shape[-1]),
            positions=positions,  # type: ignore[arg-type]
            clip_norm=privatizer.clip_norm,
            rescale=rescale,
            per=privatizer.per,
            **model_kwargs,
        )
        return out, answer

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        session_id: str,
        *,
        model: str,
        prompt: str | None = None,
        prompt_ids: Sequence[int] | None = None,
        max_new_tokens: int = 16,
        idempotency_key: str | None = None,
        **privacy: Any,
    ) -> Generation:
        """The whole generation in one call (``POST /generate``), each token charged before the answer.

        ``privacy``: ``sigma=``, ``noise_multiplier=`` or ``epsilon=`` and ``delta=`` (per row), and
        optionally ``clip_norm=``, ``layer=``, ``neighbouring=``, ``stop_at_eos=``, and the sampling
        fields ``temperature=``, ``top_p=``, ``top_k=``, ``seed=`` (post-processing of the noised
        state: no extra charge; greedy without them). The OpenAI-compatible routes take any OpenAI
        client (see docs/guides/inference.md, "OpenAI-compatible API"). When the budget
        runs out mid-way the answer holds the tokens so far (``finish_reason="budget_exhausted"``);
        at the first token :class:`BudgetExhausted` is raised.
        """
        body = _generate_body(model, prompt, prompt_ids, max_new_tokens, privacy)
        body["idempotency_key"] = idempotency_key or _new_key()
        d = self.request("POST", f"/v1/sessions/{session_id}/generate", json_body=body)
        keep = ("model", "prompt_tokens", "layer", "sigma", "clip_norm", "neighbouring", "sensitivity")
        return Generation(
            str(d["stream_id"]),
            [Token.of(t) for t in d["tokens"]],
            d.get("text"),
            str(d["finish_reason"]),
            d.get("error"),
            d.get("detail"),
            Privacy.of(d["spent"]),
            Privacy.of(d["remaining"]),
            {k: d[k] for k in (*keep, "noise_multiplier") if k in d},
        )

    def stream_generate(
        self,
        session_id: str,
        *,
        model: str,
        prompt: str | None = None,
        prompt_ids: Sequence[int] | None = None,
        max_new_tokens: int = 16,
        window: int = 1,
        **privacy: Any,
    ) -> TokenStream:
        """Stream a generation over the WebSocket route: an iterator of :class:`Token` (use it in a
        ``with`` block, or call ``close()``: stopping early then leaves the session charged for
        exactly the tokens received).

        Args:
            window: tokens the server may compute ahead of the consumer (1: each token is computed
                and charged when asked for; larger: faster, up to ``window`` tokens charged beyond
                those consumed, still all received by :class:`TokenStream`).
            privacy: as for :meth:`generate`.

        Raises:
            BudgetExhausted: (while iterating) the budget ran out; the tokens before were charged.
            Unauthorized, Forbidden: the upgrade was refused for the key (HTTP 401, 403).
            ServiceUnavailable: the upgrade was refused with 429 (rate limit, the tenant's share of
                generation slots) on every attempt (retried after ``Retry-After``).
            ServiceError: the start was refused (unknown model, invalid arguments, session).
        """
        from websockets.exceptions import InvalidHandshake, InvalidStatus
        from websockets.sync.client import connect

        body = _generate_body(model, prompt, prompt_ids, max_new_tokens, privacy)
        body["window"] = int(window)
        url = self.base_url.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        url += f"/v1/sessions/{session_id}/generate"
        headers = {"Authorization": f"Bearer {self._api_key}"}
        for attempt in range(1 + self.retries):  # only the connection is retried: nothing is charged yet
            try:
                # entered by hand: the TokenStream owns the connection and closes it
                ws = connect(
                    url, additional_headers=headers, open_timeout=self.timeout, close_timeout=2
                ).__enter__()
                break
            except InvalidStatus as exc:  # the upgrade refused (key, scope, rate, generation slots)
                response = exc.response
                refusal: Any
                try:
                    refusal = json.loads(response.body or b"")
                except ValueError:
                    refusal = (response.body or b"").decode(errors="replace")
                err = error_for(response.status_code, refusal)
                if not isinstance(err, ServiceUnavailable) or attempt == self.retries:
                    raise err from None
                self._pause(attempt, response.headers.get("Retry-After"))
            except (OSError, InvalidHandshake, TimeoutError) as exc:
                if attempt == self.retries:
                    raise ConnectionFailed(f"WebSocket {url}: {exc}") from exc
                self._pause(attempt, None)
        stream = TokenStream(ws, {}, self.timeout)
        ws.send(json.dumps(body))
        first = stream._receive()
        if first.get("type") != "start":
            stream._finish(first)  # raises the refusal
            raise ServiceError(f"the stream ended before it started: {first!r}")
        stream.info = first
        return stream


def _generate_body(
    model: str,
    prompt: str | None,
    prompt_ids: Sequence[int] | None,
    max_new_tokens: int,
    privacy: dict[str, Any],
) -> dict[str, Any]:
    allowed = {
        "sigma",
        "noise_multiplier",
        "epsilon",
        "delta",
        "clip_norm",
        "layer",
        "neighbouring",
        "stop_at_eos",
    }
    unknown = set(privacy) - allowed
    if unknown:
        raise TypeError(f"unexpected keyword arguments {sorted(unknown)}; allowed: {sorted(allowed)}")
    body: dict[str, Any] = {"model": model, "max_new_tokens": int(max_new_tokens)}
    if prompt is not None:
        body["prompt"] = prompt
    if prompt_ids is not None:
        body["prompt_ids"] = [int(i) for i in prompt_ids]
    body.update({k: v for k, v in privacy.items() if v is not None})
    return body


def _decode(r: httpx.Response) -> Any:
    try:
        return r.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return r.text
