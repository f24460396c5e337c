"""The text perturbation web page: the perturbation runs in the browser; only perturbed text arrives.

Routes (a FastAPI ``APIRouter``; ``gaussdp.service.app.create_app`` includes :data:`router`):

* ``GET /text``: the page (``static/text.html`` + ``static/text.js``, plain JavaScript).
* ``GET /text/static/text.js``: the script.
* ``GET /text/vocab``: the public vocabulary, fetched once by the page: words, ``dim``, the
  ``V x dim`` float32 matrix as little-endian base64, and (if it has one) the fastText n-gram bucket
  table as float16 (:mod:`gaussdp.text.subwords`) so unknown words get the same vector as in Python.
* ``GET /text/static/text_core.js``, ``/text/static/text_worker.js``: tokenising, subword vectors,
  noise (``crypto.getRandomValues``) and exact search, shared by the page and its Web Worker.
* ``GET /text/guarantee?mechanism=gaussian&sigma=&delta=`` or ``?mechanism=laplace&epsilon=``: the
  per-word guarantee for public parameters, and what it covers for unknown words.
* ``POST /text/submit``: ``{"text", "mechanism", "sigma"}``, the *perturbed* text. The server
  refuses (422) a text with any token that is not a vocabulary word: perturbed text only contains
  vocabulary words, so this catches a client that would send raw text by mistake.

Which vocabulary: :func:`make_router` takes one; the module-level :data:`router` loads, on first
use, the file named by ``gaussdp serve --text-vocab PATH`` (which sets the environment variable
``GAUSSDP_TEXT_VOCAB``, also read when set directly) or else the demo vocabulary
shipped with gaussdp.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, Field

from gaussdp.errors import PrivacyError
from gaussdp.text.mechanisms import GaussianWordMechanism, LaplaceWordMechanism
from gaussdp.text.tokenize import MAX_INPUT_BYTES, lines_of_words
from gaussdp.text.vocabulary import Vocabulary, vocabulary_id

__all__ = ["Submission", "make_router", "router", "vocabulary_id", "vocabulary_name"]

UNKNOWN_WORDS_SUBWORDS = (
    "Words outside the vocabulary get a public vector computed from their character n-grams "
    "(fastText buckets shipped with the vocabulary; the same computation in this page and in "
    "Python), clipped into the clip box and the ball of the largest word norm. The map is public and "
    "does not depend on anyone's data, so the per-word guarantee holds between any two words, known "
    "or not, at the distance between their vectors; the worst case above covers them too."
)
UNKNOWN_WORDS_ZERO = (
    "Words outside the vocabulary start from the zero vector (the centre of the clip box); the worst "
    "case above covers them, but at low noise they all release the same few words."
)


class Submission(BaseModel):
    """What the page sends: perturbed text only, plus the public mechanism parameters."""

    text: str = Field(..., description="At most 20 MB (20,000,000 bytes) of UTF-8 (413 over it).")
    mechanism: str = "gaussian"
    sigma: float | None = Field(None, gt=0)
    epsilon: float | None = Field(None, gt=0)


def vocabulary_name(vocab: Vocabulary) -> str:
    """A public name for the vocabulary: ``meta["name"]`` or the first 16 hex of its content hash."""
    name = vocab.meta.get("name")
    if isinstance(name, str) and name:
        return name
    h = hashlib.sha256()
    h.update("\n".join(vocab.words).encode("utf-8"))
    h.update(vocab.vectors.astype("<f4").tobytes())
    return "sha256-" + h.hexdigest()[:16]


def _static(name: str) -> str:
    return (resources.files("gaussdp.text") / "static" / name).read_text(encoding="utf-8")


def _default_vocabulary() -> Vocabulary:
    path = os.environ.get("GAUSSDP_TEXT_VOCAB")
    if path:
        return Vocabulary.load(path)
    from gaussdp.text.corpus import shipped_vocabulary

    return shipped_vocabulary()


_SCRIPT: dict[int | str, dict[str, Any]] = {
    200: {"description": "JavaScript.", "content": {"text/javascript": {"schema": {"type": "string"}}}}
}


def make_router(
    vocabulary: Vocabulary | Callable[[], Vocabulary] | None = None,
    *,
    on_submit: Callable[[Submission], None] | None = None,
    submit_dependencies: Sequence[Any] = (),
    submit_responses: dict[int | str, dict[str, Any]] | None = None,
) -> APIRouter:
    """A router serving the page for ``vocabulary`` (an instance, a loader, or None for the default).

    ``on_submit`` receives each accepted :class:`Submission` (e.g. to store it); by default
    submissions are only counted and hashed in the response. ``submit_dependencies`` guard
    ``POST /text/submit`` (e.g. an API key): the page, its scripts, the vocabulary and the
    guarantee are public (a browser opening the page cannot send a key), and the page sends the
    key the user types with every call that needs one; ``submit_responses`` documents what the
    dependencies may answer.
    """
    api = APIRouter(tags=["text"])
    cache: dict[str, Any] = {}

    def vocab() -> Vocabulary:
        if "vocab" not in cache:
            if isinstance(vocabulary, Vocabulary):
                cache["vocab"] = vocabulary
            elif vocabulary is None:
                cache["vocab"] = _default_vocabulary()
            else:
                cache["vocab"] = vocabulary()
        return cache["vocab"]

    @api.get("/text", response_class=HTMLResponse, summary="Page that perturbs text in the browser")
    def page() -> HTMLResponse:
        return HTMLResponse(_static("text.html"))

    @api.get("/text/static/text.js", summary="The page's script", response_class=Response, responses=_SCRIPT)
    def script() -> Response:
        return Response(_static("text.js"), media_type="text/javascript")

    @api.get("/text/vocab", summary="The public vocabulary (float32 base64)")
    def get_vocab() -> dict[str, Any]:
        if "payload" not in cache:
            v = vocab()
            payload: dict[str, Any] = {
                "name": vocabulary_name(v),
                "id": vocabulary_id(v),  # what an upload to /v1/corpora declares
                "words": v.words,
                "dim": v.dim,
                "clip": v.clip,
                "max_norm": v.max_norm,
                "dtype": "float32-le",
                "vectors": base64.b64encode(v.vectors.astype("<f4").tobytes()).decode("ascii"),
                "subwords": None,
            }
            if v.subwords is not None:
                sw = v.subwords
                payload["subwords"] = {
                    "min_n": sw.min_n,
                    "max_n": sw.max_n,
                    "buckets": sw.buckets,
                    "clip": sw.clip,
                    "max_norm": sw.max_norm,
                    "dtype": "float16-le",
                    "table": base64.b64encode(sw.table.astype("<f2").tobytes()).decode("ascii"),
                }
            cache["payload"] = payload
        return cache["payload"]

    @api.get("/text/guarantee", summary="Per-word guarantee of the Gaussian or Laplace mechanism")
    def guarantee(
        sigma: float | None = Query(None, gt=0, le=1e6),
        delta: float = Query(1e-5, gt=0, lt=1),
        mechanism: str = Query("gaussian", pattern="^(gaussian|laplace)$"),
        epsilon: float | None = Query(None, gt=0, le=1e6),
    ) -> dict[str, Any]:
        v = vocab()
        try:
            if mechanism == "gaussian":
                if sigma is None:
                    raise HTTPException(status_code=422, detail="the gaussian mechanism needs sigma")
                report = GaussianWordMechanism(v, sigma=sigma, delta=delta).report()
            else:
                if epsilon is None:
                    raise HTTPException(status_code=422, detail="the laplace mechanism needs epsilon")
                report = LaplaceWordMechanism(v, epsilon=epsilon).report()
        except PrivacyError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None
        report["unknown_words"] = UNKNOWN_WORDS_SUBWORDS if v.subwords is not None else UNKNOWN_WORDS_ZERO
        return report

    @api.get(
        "/text/static/text_core.js",
        summary="The perturbation code shared by page and worker",
        response_class=Response,
        responses=_SCRIPT,
    )
    def core_script() -> Response:
        return Response(_static("text_core.js"), media_type="text/javascript")

    @api.get(
        "/text/static/text_worker.js",
        summary="The Web Worker that perturbs long texts",
        response_class=Response,
        responses=_SCRIPT,
    )
    def worker_script() -> Response:
        return Response(_static("text_worker.js"), media_type="text/javascript")

    @api.post(
        "/text/submit",
        summary="Receive perturbed text (vocabulary words only)",
        dependencies=list(submit_dependencies),
        responses=submit_responses,
    )
    def submit(body: Submission) -> dict[str, Any]:
        if body.mechanism not in ("gaussian", "laplace"):
            raise HTTPException(status_code=422, detail=f"unsupported mechanism {body.mechanism!r}")
        needed = "sigma" if body.mechanism == "gaussian" else "epsilon"
        if getattr(body, needed) is None:
            raise HTTPException(status_code=422, detail=f"the {body.mechanism} mechanism needs {needed}")
        size = len(body.text.encode("utf-8"))
        if size > MAX_INPUT_BYTES:
            raise HTTPException(
                status_code=413,
                detail=f"text is {size} bytes: the text limit is {MAX_INPUT_BYTES} bytes (20 MB) of "
                "UTF-8; split the text",
            )
        v = vocab()
        tokens = [w for line in lines_of_words(body.text) for w in line]
        foreign = sum(1 for w in tokens if w not in v)
        if foreign:
            # Never echo the offending words back: they may be raw text.
            raise HTTPException(
                status_code=422,
                detail=f"{foreign} token(s) are not vocabulary words: this is not perturbed text",
            )
        if on_submit is not None:
            on_submit(body)
        return {
            "accepted": True,
            "words": len(tokens),
            "sha256": hashlib.sha256(body.text.encode("utf-8")).hexdigest(),
        }

    return api


router = make_router()
