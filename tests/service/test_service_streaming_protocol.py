"""The generation WebSocket's protocol edges, in process (TestClient, a tiny GPT-2 without a
tokenizer): bad messages at the start and mid-stream, idle, start and duration limits, keys from the
upgrade request only, revocation, fair shares between tenants."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from starlette.websockets import WebSocketDisconnect  # noqa: E402

import gaussdp.service.streaming as streaming  # noqa: E402

START = {"model": "tiny", "prompt_ids": [1, 2, 3], "noise_multiplier": 8.0, "max_new_tokens": 20}


def _tiny() -> object:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture
def app(service):  # type: ignore[no-untyped-def]
    service.app.state.models = {"tiny": _tiny()}
    return service.app


def _limited_app(service, **limits):  # type: ignore[no-untyped-def]
    """An app over the service's ledger with its own stream limits."""
    from gaussdp.service.app import create_app

    app = create_app(ledger=service.ledger, max_body_bytes=64 * 1024, **limits)
    app.state.models = {"tiny": _tiny()}
    return app


@contextlib.contextmanager
def _stream(client, service, sid, start, key=None):  # type: ignore[no-untyped-def]
    url = f"/v1/sessions/{sid}/generate"
    with client.websocket_connect(url, headers=service.headers(key or service.key_a)) as ws:
        ws.send_json(start)
        yield ws


def _denied(client, url, **kw):  # type: ignore[no-untyped-def]
    """The HTTP answer to an upgrade the server refused (the WebSocket never opened)."""
    from starlette.testclient import WebSocketDenialResponse

    with pytest.raises(WebSocketDenialResponse) as exc, client.websocket_connect(url, **kw):
        pass
    return exc.value


def _closed_with(ws) -> int:  # type: ignore[no-untyped-def]
    with pytest.raises(WebSocketDisconnect) as exc:
        ws.receive_json()
    return int(exc.value.code)


def _session(client, service, epsilon: float = 50.0, key=None) -> str:  # type: ignore[no-untyped-def]
    h = service.headers(key or service.key_a)
    r = client.post("/v1/sessions", json={"epsilon": epsilon, "delta": 1e-5}, headers=h)
    assert r.status_code == 201, r.text
    return str(r.json()["session_id"])


def _charges(client, service, sid, key=None) -> int:  # type: ignore[no-untyped-def]
    h = service.headers(key or service.key_a)
    return len(client.get(f"/v1/sessions/{sid}/history", headers=h).json()["charges"])


def test_protocol_edges(service, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    with TestClient(_limited_app(service, stream_idle_s=0.3, max_streams=0)) as client:
        sid = _session(client, service)
        # the cap on generations at once, per worker: refused before the start message is read
        r = client.post(f"/v1/sessions/{sid}/generate", json=START, headers=service.headers(service.key_a))
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert r.json()["error"] == "too_many_generations"
        # the upgrade itself is refused: the WebSocket never opens
        denied = _denied(client, f"/v1/sessions/{sid}/generate", headers=service.headers(service.key_a))
        assert denied.status_code == 429 and denied.headers["Retry-After"] == "1"
        assert json.loads(denied.content)["error"] == "too_many_generations"
        assert _charges(client, service, sid) == 0

    with TestClient(_limited_app(service, stream_idle_s=0.3)) as client:
        sid = _session(client, service)

        # a message that is neither an ack nor a stop ends the stream; what was sent was charged
        with _stream(client, service, sid, {**START, "window": 1}) as ws:
            assert ws.receive_json()["type"] == "start"
            assert ws.receive_json()["type"] == "token"
            ws.send_json({"ack": 1, "more": True})
            m = ws.receive_json()
            assert m["type"] == "error" and m["error"] == "invalid" and m["tokens_sent"] == 1, m
            assert _closed_with(ws) == 4422
        assert _charges(client, service, sid) == 1

        # a client that stops acknowledging: the server waits stream_idle_s, then ends ("idle")
        with _stream(client, service, sid, {**START, "window": 2}) as ws:
            msgs = [ws.receive_json() for _ in range(4)]
            assert [m["type"] for m in msgs] == ["start", "token", "token", "end"]
            assert msgs[-1]["finish_reason"] == "idle" and msgs[-1]["tokens_sent"] == 2
            assert _closed_with(ws) == 1000
        assert _charges(client, service, sid) == 3

        # acks that do not let the next token go do not extend the idle time
        with _stream(client, service, sid, {**START, "window": 1}) as ws:
            assert [ws.receive_json()["type"] for _ in range(2)] == ["start", "token"]
            t0 = time.monotonic()
            for _ in range(6):
                ws.send_json({"ack": 0})
                time.sleep(0.1)
            m = ws.receive_json()
            assert m["type"] == "end" and m["finish_reason"] == "idle" and m["tokens_sent"] == 1, m
            assert time.monotonic() - t0 < 1.5
        assert _charges(client, service, sid) == 4

        # no start message in time
        monkeypatch.setattr(streaming, "START_TIMEOUT_S", 0.2)
        with client.websocket_connect(
            f"/v1/sessions/{sid}/generate", headers=service.headers(service.key_a)
        ) as ws:
            m = ws.receive_json()
            assert m["error"] == "timeout"
            assert _closed_with(ws) == 4408

        # text prompts need the model's tokenizer
        with _stream(client, service, sid, {**START, "prompt_ids": None, "prompt": "hello"}) as ws:
            m = ws.receive_json()
            assert m["error"] == "invalid" and "prompt_ids" in m["detail"]
            assert _closed_with(ws) == 4422
        assert _charges(client, service, sid) == 4


def test_a_stream_ends_at_its_time_limit_whatever_the_acks(service) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    with TestClient(_limited_app(service, max_stream_s=0.5)) as client:
        sid = _session(client, service)
        with _stream(client, service, sid, {**START, "window": 1, "max_new_tokens": 50}) as ws:
            got = [ws.receive_json()]
            while got[-1]["type"] in ("start", "token"):
                time.sleep(0.05)
                ws.send_json({"ack": sum(m["type"] == "token" for m in got)})
                got.append(ws.receive_json())
            end = got[-1]
            assert end["type"] == "end" and end["finish_reason"] == "time_limit", end
            assert end["tokens_sent"] == sum(m["type"] == "token" for m in got) < 50
            assert _closed_with(ws) == 1000
        assert _charges(client, service, sid) == end["tokens_sent"]


def test_bad_frames_end_the_stream_with_their_error_and_no_traceback(service, caplog) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from gaussdp.service.bounds import WS_MAX_MESSAGE_BYTES

    deep = "[" * 50_000  # Python's json would recurse past its limit (RecursionError)
    small_deep = "[" * 100 + "]" * 100
    with TestClient(_limited_app(service)) as client:
        sid = _session(client, service)
        h = service.headers(service.key_a)
        url = f"/v1/sessions/{sid}/generate"
        # the start message: too deep (never parsed), too large, binary, not an object
        for frame, code, close in [
            (deep, "json_too_deep", 4422),
            ('{"model": "tiny", "x": ' + deep + "}", "json_too_deep", 4422),
            (" " * (WS_MAX_MESSAGE_BYTES + 1), "too_large", 4413),
            (b"\x00binary", "invalid", 4422),
            ("[1, 2]", "invalid", 4422),
            ("not json", "invalid", 4422),
        ]:
            with client.websocket_connect(url, headers=h) as ws:
                ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_text(frame)
                m = ws.receive_json()
                assert m["type"] == "error" and m["error"] == code, (frame[:20], m)
                assert _closed_with(ws) == close
        # mid-stream: the receive loop hands every bad frame to the stream, which ends at once
        for frame, code, close in [
            (small_deep, "json_too_deep", 4422),
            ('{"ack": ' + " " * 2000 + "1}", "too_large", 4413),
            (b"\x01", "invalid", 4422),
            ("{", "invalid", 4422),
        ]:
            with _stream(client, service, sid, {**START, "window": 1}) as ws:
                assert [ws.receive_json()["type"] for _ in range(2)] == ["start", "token"]
                t0 = time.monotonic()
                ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_text(frame)
                m = ws.receive_json()
                assert m["type"] == "error" and m["error"] == code and m["tokens_sent"] == 1, m
                assert _closed_with(ws) == close
                assert time.monotonic() - t0 < 5  # not the idle time-out of a dead receive loop
        # too many messages: acks beyond 2 * max_new_tokens + 16
        with _stream(client, service, sid, {**START, "window": 1, "max_new_tokens": 1}) as ws:
            assert [ws.receive_json()["type"] for _ in range(2)] == ["start", "token"]
            for _ in range(2 * 1 + 16 + 1):
                ws.send_json({"ack": 0})
            m = ws.receive_json()
            assert m["type"] in ("end", "error"), m
        assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
        assert _charges(client, service, sid) == 5


def test_keys_come_from_the_upgrade_request_only(service) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    with TestClient(_limited_app(service)) as client:
        sid = _session(client, service)
        url = f"/v1/sessions/{sid}/generate"
        # no key: the upgrade is refused (401): the WebSocket never opens, no message is read
        denied = _denied(client, url)
        assert denied.status_code == 401 and json.loads(denied.content)["error"] == "unauthorized"
        assert denied.headers["WWW-Authenticate"] == "Bearer"
        denied = _denied(client, url, headers={"Authorization": "Bearer gdp_nope"})
        assert denied.status_code == 401
        # a browser's key: the subprotocol gaussdp.key.<key>, answered with gaussdp.v1
        with client.websocket_connect(url, subprotocols=["gaussdp.v1", f"gaussdp.key.{service.key_a}"]) as ws:
            assert ws.accepted_subprotocol == "gaussdp.v1"
            ws.send_json({**START, "max_new_tokens": 2})
            assert [ws.receive_json()["type"] for _ in range(4)] == ["start", "token", "token", "end"]
        # both ways at once: refused
        denied = _denied(
            client, url, headers=service.headers(service.key_a), subprotocols=[f"gaussdp.key.{service.key_a}"]
        )
        assert denied.status_code == 422 and json.loads(denied.content)["error"] == "invalid"
        # a key in the start message is not a field: refused as invalid
        with _stream(client, service, sid, {**START, "api_key": service.key_a}) as ws:
            assert ws.receive_json()["error"] == "invalid" and _closed_with(ws) == 4422
        assert _charges(client, service, sid) == 2


def test_revoking_the_key_ends_its_open_streams(service) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from gaussdp.service.keys import create_api_key, key_id_of

    key = create_api_key(service.ledger.store, "tenant-a")
    with TestClient(_limited_app(service)) as client:
        sid = _session(client, service, key=key)
        # waiting for an ack: the stream sees the revocation within 1 s and charges nothing more
        with _stream(client, service, sid, {**START, "window": 1, "max_new_tokens": 20}, key=key) as ws:
            assert [ws.receive_json()["type"] for _ in range(2)] == ["start", "token"]
            service.ledger.store.revoke_api_key(key_id_of(key))
            t0 = time.monotonic()
            m = ws.receive_json()
            assert m["type"] == "error" and m["error"] == "unauthorized" and m["tokens_sent"] == 1, m
            assert _closed_with(ws) == 4401
            assert time.monotonic() - t0 < 1.0
        assert _charges(client, service, sid) == 1  # charges == tokens sent (key_a: the same tenant)


def test_fair_shares_per_tenant(service) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    with TestClient(_limited_app(service, max_streams=3, max_streams_per_tenant=2)) as client:
        sid_b = _session(client, service, key=service.key_b)
        sid_a = _session(client, service)
        hostile = [
            _stream(
                client, service, sid_b, {**START, "window": 1, "noise_multiplier": 1e9}, key=service.key_b
            )
            for _ in range(2)
        ]
        opened = [cm.__enter__() for cm in hostile]
        try:
            for ws in opened:
                assert ws.receive_json()["type"] == "start"
            # B holds its whole share (at no privacy cost): its third stream is refused ...
            denied = _denied(client, f"/v1/sessions/{sid_b}/generate", headers=service.headers(service.key_b))
            assert denied.status_code == 429 and json.loads(denied.content)["error"] == "too_many_generations"
            # ... and A's stream starts at once
            with _stream(client, service, sid_a, {**START, "max_new_tokens": 2}) as ws:
                assert [ws.receive_json()["type"] for _ in range(4)] == ["start", "token", "token", "end"]
        finally:
            for cm in hostile:
                cm.__exit__(None, None, None)


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
