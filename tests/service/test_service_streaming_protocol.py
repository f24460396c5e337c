"""The generation WebSocket's protocol edges, in process (TestClient, a tiny GPT-2 without a
tokenizer): a bad message mid-stream, idle and start time-outs, the cap on generations at once."""

from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from starlette.websockets import WebSocketDisconnect  # noqa: E402

import gaussdp.service.streaming as streaming  # noqa: E402

START = {"model": "tiny", "prompt_ids": [1, 2, 3], "noise_multiplier": 8.0, "max_new_tokens": 20}


@pytest.fixture
def app(service):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=64)
    service.app.state.models = {"tiny": transformers.GPT2LMHeadModel(config).eval()}
    return service.app


@contextlib.contextmanager
def _stream(client, service, sid, start):  # type: ignore[no-untyped-def]
    url = f"/v1/sessions/{sid}/generate"
    with client.websocket_connect(url, headers=service.headers(service.key_a)) as ws:
        ws.send_json(start)
        yield ws


def _closed_with(ws) -> int:  # type: ignore[no-untyped-def]
    with pytest.raises(WebSocketDisconnect) as exc:
        ws.receive_json()
    return int(exc.value.code)


def test_protocol_edges(app, service, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        h = service.headers(service.key_a)
        sid = client.post("/v1/sessions", json={"epsilon": 50.0, "delta": 1e-5}, headers=h).json()[
            "session_id"
        ]

        def charges() -> int:
            return len(client.get(f"/v1/sessions/{sid}/history", headers=h).json()["charges"])

        # a message that is neither an ack nor a stop ends the stream; what was sent was charged
        with _stream(client, service, sid, {**START, "window": 1}) as ws:
            assert ws.receive_json()["type"] == "start"
            assert ws.receive_json()["type"] == "token"
            ws.send_json({"ack": 1, "more": True})
            m = ws.receive_json()
            assert m["type"] == "error" and m["error"] == "invalid" and m["tokens_sent"] == 1, m
            assert _closed_with(ws) == 4422
        assert charges() == 1

        # a client that stops acknowledging: the server waits IDLE_TIMEOUT_S, then ends ("idle")
        monkeypatch.setattr(streaming, "IDLE_TIMEOUT_S", 0.3)
        with _stream(client, service, sid, {**START, "window": 2}) as ws:
            msgs = [ws.receive_json() for _ in range(4)]
            assert [m["type"] for m in msgs] == ["start", "token", "token", "end"]
            assert msgs[-1]["finish_reason"] == "idle" and msgs[-1]["tokens_sent"] == 2
            assert _closed_with(ws) == 1000
        assert charges() == 3

        # no start message in time
        monkeypatch.setattr(streaming, "START_TIMEOUT_S", 0.2)
        with client.websocket_connect(f"/v1/sessions/{sid}/generate", headers=h) as ws:
            m = ws.receive_json()
            assert m["error"] == "timeout"
            assert _closed_with(ws) == 4408

        # text prompts need the model's tokenizer
        with _stream(client, service, sid, {**START, "prompt_ids": None, "prompt": "hello"}) as ws:
            m = ws.receive_json()
            assert m["error"] == "invalid" and "prompt_ids" in m["detail"]
            assert _closed_with(ws) == 4422

        # the cap on generations at once, per worker
        monkeypatch.setattr(streaming, "MAX_ACTIVE_GENERATIONS", 0)
        r = client.post(f"/v1/sessions/{sid}/generate", json=START, headers=h)
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        with _stream(client, service, sid, START) as ws:
            assert ws.receive_json()["error"] == "rate_limited" and _closed_with(ws) == 4429
        assert charges() == 3


class _DigitTokenizer:
    """A stand-in tokenizer: ids are words, [EOS] is id 7."""

    eos_token_id = 7

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)


def test_a_generation_ends_after_the_end_of_sequence_token(app, service) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    model = app.state.models["tiny"]
    with torch.no_grad():  # ln_f outputs the constant v whatever its (noised) input: argmax is id 7
        v = torch.ones(16) / 4.0
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(v)
        model.transformer.wte.weight[7] = 10 * v
    app.state.tokenizers = {"tiny": _DigitTokenizer()}
    with TestClient(app) as client:
        h = service.headers(service.key_a)
        sid = client.post("/v1/sessions", json={"epsilon": 50.0, "delta": 1e-5}, headers=h).json()[
            "session_id"
        ]
        r = client.post(f"/v1/sessions/{sid}/generate", json=START, headers=h)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["finish_reason"] == "eos" and [t["token_id"] for t in out["tokens"]] == [7]
        assert out["text"] == "7"
        with _stream(client, service, sid, START) as ws:
            msgs = [ws.receive_json() for _ in range(3)]
            assert [m["type"] for m in msgs] == ["start", "token", "end"] and msgs[-1][
                "finish_reason"
            ] == "eos"
        with _stream(client, service, sid, {**START, "max_new_tokens": 3, "stop_at_eos": False}) as ws:
            msgs = [ws.receive_json() for _ in range(5)]
            assert [m.get("token_id") for m in msgs[1:4]] == [7, 7, 7] and msgs[-1][
                "finish_reason"
            ] == "length"
        assert len(client.get(f"/v1/sessions/{sid}/history", headers=h).json()["charges"]) == 5
