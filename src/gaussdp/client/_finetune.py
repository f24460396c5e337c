"""The fine-tuning calls of :class:`gaussdp.client.GaussDPClient`: corpora, DP-LoRA jobs, adapters.

A data owner uploads a corpus that was perturbed word by word on their side (``gaussdp
perturb-text`` or the ``/text`` page: raw text never reaches the server) and declares the local-DP
mechanism used; a data scientist starts a job on it, paid by a session's budget *before* it is
queued, follows its progress and downloads the private adapter (peft's own format, with a model card
stating both guarantees).
"""

from __future__ import annotations

import io
import json
import os
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from gaussdp.client._errors import error_for
from gaussdp.client._types import Corpus, FinetuneJob

__all__ = ["FinetuneCalls"]

_CHUNK = 1 << 16
_ADAPTER_FILES = frozenset(
    {"adapter_config.json", "adapter_model.safetensors", "README.md", "gaussdp_privacy.json"}
)


def _decoded(r: httpx.Response) -> Any:
    try:
        return r.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return r.text


class FinetuneCalls:
    """Mixed into :class:`GaussDPClient` (uses its ``request`` and its httpx client)."""

    _http: httpx.Client
    timeout: float

    if TYPE_CHECKING:  # GaussDPClient.request

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
        ) -> Any: ...

    # ------------------------------------------------------------------ corpora and models

    def upload_corpus(
        self,
        corpus: str | os.PathLike[str] | bytes,
        *,
        name: str = "corpus",
        format: str = "lines",
        mechanism: str | None = None,
        sigma: float | None = None,
        epsilon: float | None = None,
        vocabulary: str | None = None,
    ) -> Corpus:
        """Upload a perturbed corpus (a file path, streamed from disk, or bytes); at most 20 MB.

        ``mechanism`` (``"gaussian"`` with ``sigma``, or ``"laplace"`` with ``epsilon``) declares
        the word-level local DP it was perturbed with; the server then checks that it holds only
        vocabulary words, and the adapter's model card states that guarantee. Not retried (a second
        upload would be a second corpus).
        """
        params: dict[str, Any] = {"name": name, "format": format}
        for key, value in (("mechanism", mechanism), ("sigma", sigma), ("epsilon", epsilon)):
            if value is not None:
                params[key] = value
        if vocabulary is not None:
            params["vocabulary"] = vocabulary
        content_type = "text/plain; charset=utf-8"
        if isinstance(corpus, bytes):
            answer = self.request(
                "POST", "/v1/corpora", params=params, content=corpus, content_type=content_type, retry=False
            )
            return Corpus.of(answer)
        with open(corpus, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            chunks = iter(lambda: handle.read(_CHUNK), b"")  # streamed: never read whole
            answer = self.request(
                "POST",
                "/v1/corpora",
                params=params,
                content=chunks,
                content_type=content_type,
                content_length=size,
            )
        return Corpus.of(answer)

    def list_corpora(self) -> list[Corpus]:
        return [Corpus.of(c) for c in self.request("GET", "/v1/corpora")]

    def get_corpus(self, corpus_id: str) -> Corpus:
        return Corpus.of(self.request("GET", f"/v1/corpora/{corpus_id}"))

    def delete_corpus(self, corpus_id: str) -> None:
        r = self._http.delete(f"/v1/corpora/{corpus_id}")
        if not r.is_success:
            raise error_for(r.status_code, _decoded(r))

    def list_models(self) -> list[str]:
        """The base models the operator registered (``gaussdp serve --model NAME=PATH``)."""
        return [str(m["name"]) for m in self.request("GET", "/v1/models")]

    # ------------------------------------------------------------------ jobs

    def start_finetune_job(
        self,
        session_id: str,
        corpus_id: str,
        model: str,
        *,
        target_epsilon: float | None = None,
        noise_multiplier: float | None = None,
        delta: float | None = None,
        epochs: int = 1,
        batch_size: int = 8,
        learning_rate: float = 1e-3,
        max_seq_len: int = 64,
        clip_norm: float = 1.0,
        lora_rank: int = 8,
        lora_alpha: float = 16.0,
        target_modules: list[str] | None = None,
        validation_corpus_id: str | None = None,
        validation_public: bool = False,
    ) -> FinetuneJob:
        """Plan a DP-LoRA job (``target_epsilon`` or ``noise_multiplier``; one record = one line),
        charge its whole run to ``session_id`` and queue it. Refused (``BudgetExhausted``, nothing
        charged or queued) when the session cannot pay. Not retried: the job id is the server's.

        ``validation_corpus_id`` (with ``validation_public=True``, your declaration that it is
        public data): the adapter's loss on it is shown on the job and its card, not charged."""
        lora: dict[str, Any] = {"rank": int(lora_rank), "alpha": float(lora_alpha)}
        if target_modules is not None:
            lora["target_modules"] = list(target_modules)
        body: dict[str, Any] = {
            "corpus_id": corpus_id,
            "model": model,
            "session_id": session_id,
            "lora": lora,
            "epochs": int(epochs),
            "batch_size": int(batch_size),
            "learning_rate": float(learning_rate),
            "max_seq_len": int(max_seq_len),
            "clip_norm": float(clip_norm),
        }
        if validation_corpus_id is not None:
            body["validation_corpus_id"] = validation_corpus_id
            body["validation_public"] = bool(validation_public)
        for key, value in (
            ("target_epsilon", target_epsilon),
            ("noise_multiplier", noise_multiplier),
            ("delta", delta),
        ):
            if value is not None:
                body[key] = float(value)
        return FinetuneJob.of(self.request("POST", "/v1/finetune-jobs", json_body=body, retry=False))

    def finetune_job(self, job_id: str) -> FinetuneJob:
        return FinetuneJob.of(self.request("GET", f"/v1/finetune-jobs/{job_id}"))

    def list_finetune_jobs(self) -> list[FinetuneJob]:
        return [FinetuneJob.of(j) for j in self.request("GET", "/v1/finetune-jobs")]

    def cancel_finetune_job(self, job_id: str) -> FinetuneJob:
        """Cancel (a running job stops at its next step); the job keeps its charge."""
        return FinetuneJob.of(self.request("POST", f"/v1/finetune-jobs/{job_id}/cancel", retry=True))

    def watch_finetune_job(
        self,
        job_id: str,
        *,
        timeout_s: float = 3600.0,
        on_progress: Callable[[FinetuneJob], None] | None = None,
    ) -> FinetuneJob:
        """Follow the job's server-sent events until it ends; returns its final state.

        ``on_progress`` gets the job on every change (step, epsilon so far). Reconnects when the
        stream ends early (the server closes it after an hour), until ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with self._http.stream(
                    "GET",
                    f"/v1/finetune-jobs/{job_id}/events",
                    timeout=httpx.Timeout(self.timeout, read=60.0),
                ) as r:
                    if not r.is_success:
                        r.read()
                        raise error_for(r.status_code, _decoded(r))
                    for job, final in _sse_jobs(r.iter_lines()):
                        if on_progress is not None:
                            on_progress(job)
                        if final:
                            return job
            except httpx.TransportError:
                time.sleep(0.5)
            job = self.finetune_job(job_id)
            if job.done:
                return job
        raise TimeoutError(f"fine-tuning job {job_id} did not end within timeout_s={timeout_s}")

    def download_adapter(self, job_id: str, out_dir: str | os.PathLike[str]) -> Path:
        """Download a succeeded job's adapter and unzip it into ``out_dir`` (peft's own format:
        ``PeftModel.from_pretrained(base, out_dir)``; ``README.md`` is the model card)."""
        r = self._http.get(f"/v1/finetune-jobs/{job_id}/adapter")
        if not r.is_success:
            raise error_for(r.status_code, _decoded(r))
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
            for member in zf.namelist():
                # Only the adapter's own flat file names: a zip can name '../' paths.
                if member not in _ADAPTER_FILES:
                    raise ValueError(f"unexpected file {member!r} in the adapter zip of job {job_id}")
                (out / member).write_bytes(zf.read(member))
        return out


def _sse_jobs(lines: Iterator[str]) -> Iterator[tuple[FinetuneJob, bool]]:
    """``(job, final)`` for each server-sent event (``event: progress|end`` + ``data: {json}``)."""
    event, data = "message", ""
    for line in lines:
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif line == "" and data:
            yield FinetuneJob.of(json.loads(data)), event == "end"
            event, data = "message", ""
