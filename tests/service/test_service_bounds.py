"""Client bytes bounded before they are parsed (gaussdp.service.bounds): the JSON depth scan agrees with
the parser on every text (whatever the chunking), refuses deep bodies on every route before parsing,
and the ASGI server runs with bounded WebSocket messages and no compression."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
from hypothesis import given, settings
from hypothesis import strategies as st

from gaussdp.service.bounds import (
    MAX_JSON_DEPTH,
    WS_MAX_MESSAGE_BYTES,
    _DepthScanner,
    json_depth_within,
    loads_bounded,
    uvicorn_options,
)
from gaussdp.service.errors import Refusal

# strings full of what could fool a scanner: brackets, quotes and backslashes
tricky = st.text(alphabet='[]{}"\\ab,:\u00e9\u2028', max_size=8)
values = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | tricky,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(tricky, inner, max_size=4),
    max_leaves=40,
)


def _depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=400, deadline=None)
@given(values, st.booleans(), st.lists(st.integers(0, 400), max_size=6), st.integers(0, 3))
def test_the_scan_agrees_with_the_parser(value, ascii_only, cuts, slack) -> None:  # type: ignore[no-untyped-def]
    text = json.dumps(value, ensure_ascii=ascii_only)
    depth = _depth(value)
    for limit in {max(0, depth - 1), depth, depth + slack}:
        assert json_depth_within(text, limit) == (depth <= limit), (text, limit)
        data, scanner, ok, prev = text.encode(), _DepthScanner(limit), True, 0
        for cut in [*sorted({min(len(data), c) for c in cuts}), len(data)]:  # chunked as it streams in
            ok = scanner.feed(data[prev:cut], final=cut == len(data)) and ok
            prev = cut
        assert ok == (depth <= limit), (text, limit, cuts)


def test_deep_or_large_messages_are_refused_before_parsing() -> None:
    with pytest.raises(Refusal) as exc:
        loads_bounded("[" * 100_000, max_bytes=1 << 20, what="m")
    assert exc.value.code == "json_too_deep"
    with pytest.raises(Refusal) as exc:
        loads_bounded(" " * 2000, max_bytes=1024, what="m")
    assert exc.value.code == "too_large"
    with pytest.raises(Refusal) as exc:
        loads_bounded("{", max_bytes=1024, what="m")
    assert exc.value.code == "invalid"
    assert loads_bounded('{"ack": 3}', max_bytes=1024, what="m") == {"ack": 3}
    # a string of brackets is not structure
    assert loads_bounded(json.dumps({"t": "[" * 100}), max_bytes=1024, what="m") == {"t": "[" * 100}


def test_deep_json_bodies_are_refused_on_every_route(client, service) -> None:  # type: ignore[no-untyped-def]
    deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    h = {**service.headers(service.key_a), "Content-Type": "application/json"}
    for method, path in [
        ("POST", "/v1/sessions"),
        ("POST", "/v1/sessions/s1/release"),
        ("POST", "/v1/sessions/s1/generate"),
        ("POST", "/text/submit"),
    ]:
        r = client.request(method, path, content=deep, headers=h)
        assert r.status_code == 422 and r.json()["error"] == "json_too_deep", (path, r.text)
    # no Content-Type is parsed as JSON by FastAPI: scanned too; a recursion-deep one as well
    r = client.post("/v1/sessions", content="[" * 50_000, headers=service.headers(service.key_a))
    assert r.status_code == 422 and r.json()["error"] == "json_too_deep"
    r = client.post(
        "/v1/sessions", json={"epsilon": 1.0, "delta": 1e-5}, headers=service.headers(service.key_a)
    )
    assert r.status_code == 201  # a shallow body is untouched


def test_the_server_s_websocket_bounds() -> None:
    options = uvicorn_options()
    assert options["ws_max_size"] == WS_MAX_MESSAGE_BYTES == 128 * 1024
    assert options["ws_per_message_deflate"] is False and options["ws_max_queue"] <= 4
    assert options["ws"] == "websockets-sansio"
    # the longest start message fits: a prompt of 16,384 characters escaped as \uXXXX
    from gaussdp.service.models import MAX_PROMPT_CHARS

    start = json.dumps({"model": "m" * 128, "prompt": "\u4e00" * MAX_PROMPT_CHARS, "max_new_tokens": 256})
    assert len(start) < WS_MAX_MESSAGE_BYTES


def test_raw_bodies_are_not_scanned_as_json(service, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A corpus is text, whatever Content-Type a client sends: brackets in it are words."""
    pytest.importorskip("gaussdp.finetune")
    from fastapi.testclient import TestClient

    from gaussdp.service.app import create_app

    app = create_app(ledger=service.ledger, data_dir=str(tmp_path / "data"), model_paths={})
    with TestClient(app) as client:
        text = ("[" * 40 + " a line of text\n").encode()
        for headers in ({}, {"Content-Type": "application/json"}):
            r = client.post(
                "/v1/corpora", content=text, headers={**service.headers(service.key_a), **headers}
            )
            assert r.status_code == 201, r.text
