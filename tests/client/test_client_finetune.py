"""The client's fine-tuning calls against a mock transport: what is sent, and what is refused."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("gaussdp.client")

from gaussdp.client import GaussDPClient, InvalidRequest  # noqa: E402

JOB = {
    "id": "job_1", "state": "running", "corpus_id": "corpus_1", "model": "tiny", "session_id": "s",
    "step": 1, "steps": 3, "epsilon": 2.5, "delta": 1e-5, "epsilon_so_far": 1.0, "error": None,
    "noise_multiplier": 1.1, "sample_rate": 0.1, "charge_id": 7,
}  # fmt: skip
CORPUS = {
    "id": "corpus_1", "name": "notes", "format": "lines", "bytes": 0, "records": 2, "sha256": "ab",
    "local_dp": {"mechanism": "gaussian", "sigma": 0.5, "epsilon": None, "vocabulary": "0" * 16},
    "created_at": 1.0,
}  # fmt: skip


def _client(handler) -> GaussDPClient:  # type: ignore[no-untyped-def]
    return GaussDPClient("http://svc", "gdp_key", transport=httpx.MockTransport(handler), retries=0)


def test_upload_streams_a_file_with_its_length_and_declares_the_local_dp(tmp_path: Path) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        return httpx.Response(201, json=dict(CORPUS, bytes=len(request.content)))

    path = tmp_path / "perturbed.txt"
    path.write_bytes(b"the minister said\nthe storm fell\n" * 5000)
    with _client(handler) as c:
        corpus = c.upload_corpus(path, name="notes", mechanism="gaussian", sigma=0.5)
        again = c.upload_corpus(b"a b\n", name="notes")
    assert corpus.bytes == path.stat().st_size and again.bytes == 4
    first = seen[0]
    assert first.headers["content-length"] == str(path.stat().st_size)
    assert first.headers["authorization"] == "Bearer gdp_key"
    assert dict(first.url.params) == {
        "name": "notes",
        "format": "lines",
        "mechanism": "gaussian",
        "sigma": "0.5",
    }
    assert first.content == path.read_bytes()


def test_a_refused_upload_raises_and_is_not_retried(tmp_path: Path) -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(413, json={"detail": "request body too large"})

    with GaussDPClient("http://svc", "k", transport=httpx.MockTransport(handler), retries=3) as c:
        with pytest.raises(InvalidRequest):
            c.upload_corpus(b"x\n" * 10)
    assert len(calls) == 1


def test_watch_follows_server_sent_events_to_the_end() -> None:
    events = "".join(
        f"event: {'end' if state == 'succeeded' else 'progress'}\n"
        f"data: {json.dumps(dict(JOB, state=state, step=i))}\n\n"
        for i, state in enumerate(["queued", "running", "succeeded"])
    )

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/finetune-jobs/job_1/events"
        return httpx.Response(
            200, text=": keep-alive\n\n" + events, headers={"content-type": "text/event-stream"}
        )

    seen = []
    with _client(handler) as c:
        job = c.watch_finetune_job("job_1", on_progress=lambda j: seen.append((j.state, j.step)))
    assert job.state == "succeeded" and job.done
    assert seen == [("queued", 0), ("running", 1), ("succeeded", 2)]


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return buf.getvalue()


def test_download_unzips_the_adapter_and_refuses_other_paths(tmp_path: Path) -> None:
    good = _zip({"adapter_config.json": b"{}", "adapter_model.safetensors": b"x", "README.md": b"card"})
    bad = _zip({"adapter_config.json": b"{}", "../escape.txt": b"x"})
    answers = iter([good, bad])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=next(answers), headers={"content-type": "application/zip"})

    with _client(handler) as c:
        out = c.download_adapter("job_1", tmp_path / "adapter")
        assert sorted(p.name for p in out.iterdir()) == [
            "README.md",
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        with pytest.raises(ValueError, match="unexpected file"):
            c.download_adapter("job_1", tmp_path / "other")
    assert not (tmp_path / "escape.txt").exists()
