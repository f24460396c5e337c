"""The OpenAI-compatible routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``.

Any OpenAI client works unchanged (``openai.OpenAI(base_url=URL + "/v1", api_key=KEY)``): the API
key is the Bearer token (scope ``release``), the answers and the stream are OpenAI's shapes. What
OpenAI's API has no words for comes as extra fields of the body (the openai client's
``extra_body``), validated as strictly as gaussdp's own ``generate`` route
(:class:`~gaussdp.service.models.GenerationPrivacy`):

- ``session_id`` (or the header ``X-GaussDP-Session``): the session whose budget pays; required.
- the noise: exactly one of ``sigma``, ``noise_multiplier``, or ``epsilon`` with ``delta`` (per
  row); and ``clip_norm``, ``layer``, ``neighbouring``, ``idempotency_key``. There is no default
  noise: a request without one is refused (422).
- sampling: OpenAI's ``temperature``, ``top_p``, ``stop``, ``seed`` and vLLM's ``top_k`` and
  ``ignore_eos``. Absent
  ``temperature`` means greedy (gaussdp's default, not OpenAI's 1). Sampling is post-processing of
  the noised hidden state: it costs nothing more (Dwork & Roth 2014, Proposition 2.1). A ``seed``
  makes the sampler reproducible, and the answer says ``"sampler_private": false``.

Every token is computed by the same :class:`~gaussdp.service.generation.Generations` as the
``generate`` routes (the app's generation slots, the fair model locks) and charged to the session
before it is sent, one charge per token (idempotency key ``"<stream_id>/<index>"``, visible in
``/history``); the answer's ``gaussdp`` object names each token's ``charge_id`` and the session's
``spent`` and ``remaining``. ``max_tokens`` (or ``max_completion_tokens``) defaults to 16.

With ``"stream": true`` the answer is Server-Sent Events as OpenAI sends them: one ``data: {chunk}``
event per token (``chat.completion.chunk`` or ``text_completion``; its ``gaussdp`` field carries the
token's ``index``, ``token_id`` and ``charge_id``, so that one event is one charge even when a stop
sequence holds its text back), a last chunk with ``finish_reason``, a usage chunk when
``stream_options.include_usage``, then ``data: [DONE]``.

Refusals: before the first token, the error table's HTTP answer (:mod:`gaussdp.service.errors`;
budget exhaustion is 409 ``budget_exhausted``, which the openai client raises as
``openai.ConflictError``; nothing was charged). After it, without streaming: 200 with the tokens
so far, ``finish_reason`` ``"budget_exhausted"`` (or ``"error"``) and the code in
``gaussdp.error``; while streaming: one event ``data: {"error": {"message", "type", "code",
"tokens_sent", ...}}`` (the openai client raises ``openai.APIError`` from it) and the stream ends
without ``[DONE]``. A client that leaves mid-stream has been charged for the tokens it was sent,
plus at most the one in flight (as on the WebSocket route). A generation lasts at most
``--max-stream-s`` (then it ends as if by length) and holds one of its tenant's generation slots
until it ends or its client leaves (429 ``too_many_generations`` past the tenant's share).
"""

# No "from __future__ import annotations": FastAPI resolves the route's annotations at runtime.

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from gaussdp.errors import InvalidParameter
from gaussdp.service.auth import Caller
from gaussdp.service.deps import Service
from gaussdp.service.errors import code_of, detail_of
from gaussdp.service.errors import responses as error_responses
from gaussdp.service.generation import STEP_REFUSALS, Generation, GenerationFailed
from gaussdp.service.models import (
    MAX_NEW_TOKENS,
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    SESSION_ID_PATTERN,
    GenerateIn,
    GenerationPrivacy,
    Sampling,
)
from gaussdp.service.streaming import StreamLimits

__all__ = ["DEFAULT_MAX_TOKENS", "ChatIn", "CompletionIn", "TextStream", "openai_router", "render_chat"]

logger = logging.getLogger("gaussdp.service")

DEFAULT_MAX_TOKENS = 16
# a chat's prompt is at most MAX_PROMPT_TOKENS tokens: these bounds keep its largest body (and one
# just past them) well under the service's default body limit
MAX_MESSAGES = 32
MAX_MESSAGE_CHARS = 4096
MAX_PARTS = 4
MAX_STOP = 4  # OpenAI's limit on stop sequences
SESSION_HEADER = "X-GaussDP-Session"

# a later token's refusal (nothing charged for it) or failed pass ends the generation
_STEP_REFUSALS = (*STEP_REFUSALS, GenerationFailed)


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str = Field(max_length=MAX_MESSAGE_CHARS // MAX_PARTS)


class ChatMessage(BaseModel):
    """One message of a chat; content is text (a string or text parts)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: (
        Annotated[str, Field(max_length=MAX_MESSAGE_CHARS)]
        | Annotated[list[_TextPart], Field(min_length=1, max_length=MAX_PARTS)]
    )
    name: str | None = Field(None, max_length=64)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _OpenAIIn(GenerationPrivacy, Sampling):
    """OpenAI's fields that gaussdp serves, plus the session (the privacy and sampling fields come
    from :class:`GenerationPrivacy` and :class:`Sampling`). Unknown fields are refused (422),
    never ignored."""

    model: str = Field(min_length=1, max_length=128, description="Name of a model the server holds.")
    max_tokens: int | None = Field(
        None, ge=1, le=MAX_NEW_TOKENS, description="Tokens to generate (default 16)."
    )
    stream: bool = Field(False, description="Server-Sent Events, one per token.")
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="One choice per request.")
    stop: (
        Annotated[str, Field(min_length=1, max_length=256)]
        | Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=MAX_STOP)]
        | None
    ) = Field(None, description=f"Up to {MAX_STOP} stop sequences (text; not included in the answer).")
    user: str | None = Field(None, max_length=256, description="Accepted and ignored.")
    ignore_eos: bool = Field(False, description="Go on past the end-of-sequence token (as vLLM's).")
    session_id: str | None = Field(
        None,
        pattern=SESSION_ID_PATTERN,
        description=f"The session that pays (or the {SESSION_HEADER} header).",
    )

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP or any(not s for s in stops):
            raise InvalidParameter(f"stop: at most {MAX_STOP} non-empty sequences, got {len(stops)}")
        return stops

    def tokens_wanted(self) -> int:
        return self.max_tokens or DEFAULT_MAX_TOKENS


class ChatIn(_OpenAIIn):
    """``POST /v1/chat/completions``: OpenAI's chat request, with gaussdp's extra fields."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS, description="As max_tokens.")

    def tokens_wanted(self) -> int:
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS


class CompletionIn(_OpenAIIn):
    """``POST /v1/completions``: OpenAI's completion request (one prompt: text or token ids)."""

    prompt: (
        Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
        | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)]
        | Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]],
            Field(min_length=1, max_length=1),
        ]
    )


def render_chat(tokenizer: Any, messages: list[ChatMessage]) -> str:
    """The prompt text of a chat: the tokenizer's chat template (with the assistant's turn opened),
    or, for a tokenizer without one, ``"role: content"`` lines and ``"assistant:"``."""
    convo = [{"role": m.role, "content": m.text()} for m in messages]
    if sum(len(m["content"]) for m in convo) > MAX_PROMPT_CHARS:
        raise InvalidParameter(f"messages: more than {MAX_PROMPT_CHARS} characters in all")
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template(convo, tokenize=False, add_generation_prompt=True))
    return "".join(f"{m['role']}: {m['content']}\n" for m in convo) + "assistant:"


class TextStream:
    """The text of a generation as it grows, token by token, cut at the first stop sequence.

    Each token's text is the growth of the decoded whole (a tokenizer may join tokens with spaces,
    or need the next byte of a character); text that may be the start of a stop sequence is held
    back until it is known not to be one.
    """

    def __init__(self, decode: Any, stops: list[str]) -> None:
        self._decode = decode
        self._stops = stops
        self._ids: list[int] = []
        self._text = ""  # decoded so far (stable part)
        self._sent = 0  # characters of _text already given out
        self.stopped = False

    def push(self, token_id: int) -> str:
        """The text to send after ``token_id`` ("" when held back or after a stop)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        text = self._decode(self._ids) or ""
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return ""
        self._text = text
        for stop in self._stops:
            at = self._text.find(stop, max(0, self._sent - len(stop)))
            if at >= 0:
                self.stopped = True
                out = self._text[self._sent : max(at, self._sent)]
                self._sent = len(self._text)
                return out
        hold = max(
            (k for s in self._stops for k in range(1, len(s)) if self._text.endswith(s[:k])), default=0
        )
        end = max(self._sent, len(self._text) - hold)
        out, self._sent = self._text[self._sent : end], end
        return out

    def flush(self) -> str:
        """What was held back, once the generation ended without reaching a stop sequence."""
        if self.stopped:
            return ""
        out, self._sent = self._text[self._sent :], len(self._text)
        return out


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def openai_router(svc: Service) -> APIRouter:
    """``/v1/completions`` and ``/v1/chat/completions`` of :func:`gaussdp.service.app.create_app`,
    over ``svc``'s gate, ledger and :attr:`~gaussdp.service.deps.Service.generations`."""
    gens = svc.generations
    max_stream_s = (svc.stream_limits or StreamLimits()).max_stream_s
    releaser = Annotated[Caller, Depends(svc.releaser)]
    router = APIRouter(tags=["openai"])
    responses: dict[int | str, dict[str, Any]] = {
        200: {
            "description": "The completion (JSON), or with `stream: true` its Server-Sent Events, one "
            "per charged token, then `data: [DONE]`.",
            "content": {"application/json": {}, "text/event-stream": {"schema": {"type": "string"}}},
        },
        **error_responses(400, 401, 403, 404, 409, 413, 422, 429, 500, 503, openai=True),
    }

    def prepare(
        request: Request, body: _OpenAIIn, session: str | None, who: Caller
    ) -> tuple[Generation, str]:
        """Ownership, the prompt's tokens and the generation (nothing computed or charged yet)."""
        sid = body.session_id or session
        if sid is None:
            raise InvalidParameter(
                f"session_id: give it as an extra field of the body or the {SESSION_HEADER} header"
            )
        if body.session_id is not None and session is not None and body.session_id != session:
            raise InvalidParameter(
                f"session_id: the body and the {SESSION_HEADER} header name different sessions"
            )
        p = svc.owned(who.tenant, sid)
        if body.model not in (getattr(request.app.state, "models", None) or {}):
            raise InvalidParameter(f"model: no model named {body.model!r} on this server")
        fields: dict[str, Any] = {**body.privacy_fields(), **body.sampling_fields()}
        fields.update(model=body.model, max_new_tokens=body.tokens_wanted(), stop_at_eos=not body.ignore_eos)
        if isinstance(body, ChatIn):
            tokenizer = (getattr(request.app.state, "tokenizers", None) or {}).get(body.model)
            if tokenizer is None:
                raise InvalidParameter(
                    f"model: {body.model!r} has no tokenizer on this server; chat needs one"
                )
            fields["prompt_ids"] = list(
                tokenizer(render_chat(tokenizer, body.messages), add_special_tokens=False)["input_ids"]
            )
        elif isinstance(body, CompletionIn):
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            fields["prompt" if isinstance(prompt, str) else "prompt_ids"] = prompt
        try:
            gin = GenerateIn.model_validate(fields)
        except ValidationError as exc:
            issues = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'prompt'}: {e['msg']}" for e in exc.errors()
            )
            raise InvalidParameter(issues) from None
        return gens.start(request.app, gin, p, who), p

    async def complete(request: Request, body: _OpenAIIn, session: str | None, who: Caller) -> Any:
        chat = isinstance(body, ChatIn)
        stops = body.stops()
        created = int(time.time())
        slot = _Slot(gens, who.tenant)
        try:
            gen, p = await run_in_threadpool(prepare, request, body, session, who)
            first = await run_in_threadpool(gens.step, gen, who, 0)  # refused here: nothing charged
            if body.stream:
                events = _events(gen, first, who, p, body, created, stops, slot)
                # the slot is also released when the stream never starts (the client left first)
                response = StreamingResponse(
                    events, media_type="text/event-stream", background=BackgroundTask(slot.release)
                )
                slot.handed_over = True
                return response
            return await run_in_threadpool(_whole, gen, first, who, p, body, created, stops, chat)
        finally:
            if not slot.handed_over:
                slot.release()

    def _whole(
        gen: Generation,
        first: Any,
        who: Caller,
        p: str,
        body: _OpenAIIn,
        created: int,
        stops: list[str],
        chat: bool,
    ) -> dict[str, Any]:
        text = TextStream(gen.decode, stops)
        deadline = time.monotonic() + max_stream_s  # --max-stream-s, as for the WebSocket stream
        tokens, finish, error, detail = [first], "length", None, None
        out = [text.push(first.token_id)]
        i = 1
        while (
            not text.stopped
            and not (gen.eos is not None and tokens[-1].token_id == gen.eos)
            and i < body.tokens_wanted()
            and time.monotonic() < deadline
        ):
            try:
                tok = gens.step(gen, who, i)
            except _STEP_REFUSALS as exc:  # the tokens so far were charged: answered, with the refusal
                error, detail = code_of(exc), detail_of(exc)
                finish = "budget_exhausted" if error == "budget_exhausted" else "error"
                break
            tokens.append(tok)
            out.append(text.push(tok.token_id))
            i += 1
        if text.stopped or (gen.eos is not None and tokens[-1].token_id == gen.eos):
            finish = "stop"
        out.append(text.flush())
        content = "".join(out)
        figures = gens.figures(p, gen.last_receipt)
        extra = {
            "stream_id": gen.stream_id,
            "charge_ids": [t.charge_id for t in tokens],
            "token_ids": [t.token_id for t in tokens],
            "error": error,
            "detail": detail,
            **gen.describe(),
            **{k: v.model_dump() for k, v in figures.items()},
        }
        usage = {
            "prompt_tokens": gen.prompt_tokens,
            "completion_tokens": len(tokens),
            "total_tokens": gen.prompt_tokens + len(tokens),
        }
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": content}}
            kind, prefix = "chat.completion", "chatcmpl-"
        else:
            choice = {"index": 0, "text": content}
            kind, prefix = "text_completion", "cmpl-"
        choice.update(logprobs=None, finish_reason=finish)
        return {
            "id": prefix + gen.stream_id,
            "object": kind,
            "created": created,
            "model": body.model,
            "choices": [choice],
            "usage": usage,
            "gaussdp": extra,
        }

    async def _events(
        gen: Generation,
        first: Any,
        who: Caller,
        p: str,
        body: _OpenAIIn,
        created: int,
        stops: list[str],
        slot: "_Slot",
    ) -> AsyncIterator[str]:
        chat = isinstance(body, ChatIn)
        text = TextStream(gen.decode, stops)
        base = {
            "id": ("chatcmpl-" if chat else "cmpl-") + gen.stream_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": body.model,
        }

        def chunk(piece: str | None, finish: str | None, **gaussdp: Any) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {} if piece is None else {"content": piece}
                if gaussdp.get("index") == 0:
                    delta["role"] = "assistant"
                choice: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": piece or ""}
            choice.update(logprobs=None, finish_reason=finish)
            return {**base, "choices": [choice], "gaussdp": gaussdp}

        sent = 0
        deadline = time.monotonic() + max_stream_s  # --max-stream-s, as for the WebSocket stream
        try:
            tok = first
            finish = "length"
            while True:
                piece = text.push(tok.token_id)
                yield _sse(
                    chunk(piece, None, index=tok.index, token_id=tok.token_id, charge_id=tok.charge_id)
                )
                sent += 1
                if text.stopped or (gen.eos is not None and tok.token_id == gen.eos):
                    finish = "stop"
                    break
                if sent >= body.tokens_wanted() or time.monotonic() >= deadline:
                    break
                try:
                    tok = await run_in_threadpool(gens.step, gen, who, sent)
                except _STEP_REFUSALS as exc:
                    code = code_of(exc)
                    svc.refused(code)
                    error: dict[str, Any] = {
                        "message": detail_of(exc),
                        "type": code,
                        "code": code,
                        "param": None,
                    }
                    error["tokens_sent"] = sent
                    if code == "budget_exhausted":
                        figures = await run_in_threadpool(gens.figures, p)
                        error.update({k: v.model_dump() for k, v in figures.items()})
                    yield _sse({"error": error})
                    return
            rest = text.flush()
            figures = await run_in_threadpool(gens.figures, p)
            last = chunk(rest if rest else None, finish, **{k: v.model_dump() for k, v in figures.items()})
            yield _sse(last)
            if body.stream_options is not None and body.stream_options.include_usage:
                usage = {
                    "prompt_tokens": gen.prompt_tokens,
                    "completion_tokens": sent,
                    "total_tokens": gen.prompt_tokens + sent,
                }
                yield _sse({**base, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            slot.release()

    session_header = Annotated[
        str | None,
        Header(
            alias=SESSION_HEADER,
            pattern=SESSION_ID_PATTERN,
            description="The session that pays (instead of the body's session_id).",
        ),
    ]

    @router.post("/v1/chat/completions", responses=responses)
    async def chat_completions(
        body: ChatIn, who: releaser, request: Request, session: session_header = None
    ) -> Any:
        """OpenAI's chat completion, each token's hidden state clipped, noised and charged to the
        session before the token is sent (see :mod:`gaussdp.service.openai_api`)."""
        return await complete(request, body, session, who)

    @router.post("/v1/completions", responses=responses)
    async def completions(
        body: CompletionIn, who: releaser, request: Request, session: session_header = None
    ) -> Any:
        """OpenAI's (legacy) completion, each token charged before it is sent (see
        :mod:`gaussdp.service.openai_api`)."""
        return await complete(request, body, session, who)

    return router


class _Slot:
    """A tenant's generation slot, released once (by the stream's end or the response's end)."""

    def __init__(self, gens: Any, tenant: str) -> None:
        gens.slots.acquire(tenant)
        self._gens, self._tenant = gens, tenant
        self.handed_over = False
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._gens.slots.release(self._tenant)
