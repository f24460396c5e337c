"""Private generation over a real WebSocket and POST, against ``gaussdp serve`` in a subprocess with a
tiny LM (issue 20): tokens received == ledger charges, disconnects, concurrency, refusals."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("torch")
websockets = pytest.importorskip("websockets")

from websockets.sync.client import connect  # noqa: E402

pytestmark = pytest.mark.slow  # one server for the module (torch and transformers start-up)


def _session(served, epsilon: float = 3.0) -> str:  # type: ignore[no-untyped-def]
    r = httpx.post(
        served.url + "/v1/sessions", json={"epsilon": epsilon, "delta": 1e-5}, headers=served.headers
    )
    assert r.status_code == 201, r.text
    return str(r.json()["session_id"])


def _charges(served, sid: str) -> list[dict]:  # type: ignore[no-untyped-def]
    r = httpx.get(f"{served.url}/v1/sessions/{sid}/history", params={"limit": 1000}, headers=served.headers)
    assert r.status_code == 200, r.text
    return list(r.json()["charges"])


def _open(served, sid: str, **start):  # type: ignore[no-untyped-def]
    ws = connect(f"{served.ws_url}/v1/sessions/{sid}/generate", additional_headers=served.headers).__enter__()
    # random weights may well pick [EOS]: these tests need streams that end by length or budget
    body = {"model": "tiny", "prompt": "the government said", "noise_multiplier": 8.0, "stop_at_eos": False}
    body.update(start)
    ws.send(json.dumps(body))
    first = json.loads(ws.recv(timeout=30))
    assert first["type"] == "start", first
    return ws, first


def test_stream_until_refusal_every_token_received_was_charged_once(served_lm) -> None:  # type: ignore[no-untyped-def]
    sid = _session(served_lm, epsilon=3.0)
    ws, start = _open(served_lm, sid, max_new_tokens=256)
    assert start["prompt_tokens"] == 3 and start["sigma"] == 16.0 and start["neighbouring"] == "replace_one"
    tokens = []
    while True:
        m = json.loads(ws.recv(timeout=30))
        if m["type"] != "token":
            break
        tokens.append(m)
    with pytest.raises(websockets.exceptions.ConnectionClosed):
        ws.recv(timeout=10)
    assert ws.close_code == 4402  # CLOSE_BUDGET_EXHAUSTED
    assert m["type"] == "error" and m["error"] == "budget_exhausted", m
    assert 5 < len(tokens) < 256 and m["tokens_sent"] == len(tokens)
    assert m["spent"]["epsilon"] <= 3.0 and m["remaining"]["epsilon"] >= 0
    charges = _charges(served_lm, sid)
    assert len(charges) == len(tokens)  # one charge per token received, none for the refused one
    assert [c["idempotency_key"] for c in charges] == [
        f"{start['stream_id']}/{i}" for i in range(len(tokens))
    ]
    assert [c["charge_id"] for c in charges] == [t["charge_id"] for t in tokens]
    assert charges[0]["event"]["count"] == 3  # the first token's charge covers the prompt's rows
    assert all(c["event"] == {"noise_multiplier": 8.0, "type": "gaussian"} for c in charges[1:])
    session = httpx.get(f"{served_lm.url}/v1/sessions/{sid}", headers=served_lm.headers).json()
    assert session["spent"]["epsilon"] == pytest.approx(m["spent"]["epsilon"])
    ws.close()


def test_disconnect_mid_stream_leaves_charges_equal_to_tokens_sent(served_lm) -> None:  # type: ignore[no-untyped-def]
    # window=1: token i is computed (and charged) only after the client acknowledged token i-1
    sid = _session(served_lm, epsilon=50.0)
    ws, _ = _open(served_lm, sid, max_new_tokens=50, window=1)
    received = 0
    for _ in range(4):
        if received:
            ws.send(json.dumps({"ack": received}))
        assert json.loads(ws.recv(timeout=30))["type"] == "token"
        received += 1
    time.sleep(0.5)  # the server is idle, waiting for an ack: nothing more is charged
    assert len(_charges(served_lm, sid)) == received
    ws.close()  # leaves without a stop message
    time.sleep(1.0)
    assert len(_charges(served_lm, sid)) == received == 4

    # free-running (the default window): a stop message ends the stream after the token in flight;
    # the end message counts every token sent, and the ledger has exactly those
    sid = _session(served_lm, epsilon=50.0)
    ws, _ = _open(served_lm, sid, max_new_tokens=200)
    got = [json.loads(ws.recv(timeout=30)) for _ in range(2)]
    ws.send(json.dumps({"stop": True}))
    while got[-1]["type"] == "token":
        got.append(json.loads(ws.recv(timeout=30)))
    end = got[-1]
    assert end["type"] == "end" and end["finish_reason"] == "stopped", end
    tokens = [m for m in got if m["type"] == "token"]
    assert end["tokens_sent"] == len(tokens) == len(_charges(served_lm, sid)) < 200
    ws.close()


def test_a_concurrent_stream_of_another_session_is_unaffected(served_lm) -> None:  # type: ignore[no-untyped-def]
    sids = [_session(served_lm, epsilon=50.0) for _ in range(2)]
    results: dict[str, dict] = {}

    multipliers = dict(zip(sids, (8.0, 16.0), strict=True))  # each stream its own noise level

    def stream(sid: str) -> None:
        nm = multipliers[sid]
        ws, start = _open(served_lm, sid, max_new_tokens=30, stop_at_eos=False, noise_multiplier=nm)
        t0 = time.monotonic()
        tokens = []
        while (m := json.loads(ws.recv(timeout=30)))["type"] == "token":
            tokens.append(m)
        results[sid] = {"start": start, "tokens": tokens, "end": m, "t": (t0, time.monotonic())}
        ws.close()

    threads = [threading.Thread(target=stream, args=(s,)) for s in sids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    (a0, a1), (b0, b1) = (results[s]["t"] for s in sids)
    assert a0 < b1 and b0 < a1  # the two streams ran at the same time
    for sid in sids:
        r = results[sid]
        assert r["end"]["type"] == "end" and r["end"]["finish_reason"] == "length", r["end"]
        assert len(r["tokens"]) == 30 == r["end"]["tokens_sent"]
        charges = _charges(served_lm, sid)
        assert [c["idempotency_key"] for c in charges] == [
            f"{r['start']['stream_id']}/{i}" for i in range(30)
        ]
        # every forward pass of this stream was noised (and charged) by its own privatizer only
        assert r["start"]["sigma"] == 2 * multipliers[sid]
        first, rest = charges[0]["event"], charges[1:]
        assert first["event"]["noise_multiplier"] == multipliers[sid]  # the prompt's rows
        assert {c["event"]["noise_multiplier"] for c in rest} == {multipliers[sid]}


def test_post_generate_answers_the_tokens_so_far_on_exhaustion(served_lm) -> None:  # type: ignore[no-untyped-def]
    sid = _session(served_lm, epsilon=3.0)
    url = f"{served_lm.url}/v1/sessions/{sid}/generate"
    body = {"model": "tiny", "prompt": "the minister", "max_new_tokens": 256, "noise_multiplier": 8.0}
    body["stop_at_eos"] = False
    r = httpx.post(url, json=body, headers=served_lm.headers, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["finish_reason"] == "budget_exhausted" and out["error"] == "budget_exhausted"
    assert 0 < len(out["tokens"]) == len(_charges(served_lm, sid)) < 256
    assert out["text"] and out["spent"]["epsilon"] <= 3.0
    assert out["layer"] == "transformer.h.1"  # the last block by default
    r = httpx.post(
        url, json={**body, "layer": 0}, headers=served_lm.headers
    )  # nothing left for a first token
    assert r.status_code == 409 and r.json()["error"] == "budget_exhausted", r.text
    assert len(_charges(served_lm, sid)) == len(out["tokens"])
    schema = httpx.get(served_lm.url + "/openapi.json").json()
    assert "post" in schema["paths"]["/v1/sessions/{session_id}/generate"]


def test_stream_refusals_name_the_problem_and_charge_nothing(served_lm) -> None:  # type: ignore[no-untyped-def]
    sid = _session(served_lm, epsilon=50.0)
    url = f"{served_lm.ws_url}/v1/sessions/{sid}/generate"
    start = {
        "model": "tiny",
        "prompt": "the",
        "noise_multiplier": 8.0,
        "max_new_tokens": 3,
        "stop_at_eos": False,
    }
    # no key: the upgrade is refused with 401 (the WebSocket never opens, nothing sent is read)
    with pytest.raises(websockets.exceptions.InvalidStatus) as denied:
        connect(url).__enter__()
    assert denied.value.response.status_code == 401
    assert json.loads(denied.value.response.body)["error"] == "unauthorized"
    cases = [
        (served_lm.headers, {**start, "model": "nope"}, "invalid", 4422),
        (served_lm.headers, {**start, "max_new_tokens": 10_000}, "invalid", 4422),
        (served_lm.headers, {**start, "sigma": 1.0}, "invalid", 4422),  # two noise levels
        (served_lm.headers, {**start, "api_key": served_lm.key}, "invalid", 4422),  # not a field
        (served_lm.headers, {**start, "layer": "transformer.nope"}, "invalid", 4422),
        # inside a block: the residual stream goes around it (the clean state would leak)
        (served_lm.headers, {**start, "layer": "transformer.h.1.attn"}, "invalid", 4422),
        (served_lm.headers, {**start, "layer": "lm_head"}, "invalid", 4422),
    ]
    for headers, body, code, close in cases:
        with connect(url, additional_headers=headers) as ws:
            ws.send(json.dumps(body))
            m = json.loads(ws.recv(timeout=30))
            assert m["type"] == "error" and m["error"] == code, (body, m)
            with pytest.raises(websockets.exceptions.ConnectionClosed):
                ws.recv(timeout=10)
            assert ws.close_code == close, (body, ws.close_code)
    with connect(
        f"{served_lm.ws_url}/v1/sessions/missing/generate", additional_headers=served_lm.headers
    ) as ws:
        ws.send(json.dumps(start))
        assert json.loads(ws.recv(timeout=30))["error"] == "not_found"
    assert _charges(served_lm, sid) == []
    # a browser cannot set headers: the key comes in the subprotocols, never in a message
    with connect(url, subprotocols=["gaussdp.v1", f"gaussdp.key.{served_lm.key}"]) as ws:
        assert ws.subprotocol == "gaussdp.v1"
        ws.send(json.dumps(start))
        kinds = [json.loads(ws.recv(timeout=30))["type"] for _ in range(5)]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert len(_charges(served_lm, sid)) == kinds.count("token")
