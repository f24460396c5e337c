"""``gaussdp serve --model`` with Qwen2-shaped checkpoints saved in bfloat16 (as Qwen2 ships) and float16,
in a subprocess (issue 28): tokens stream, tokens == charges; a fault injected in the privatizer gives
the client an error that says what was charged, and the ledger holds exactly those charges."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
websockets = pytest.importorskip("websockets")

from websockets.sync.client import connect  # noqa: E402

pytestmark = pytest.mark.slow  # one server for the module (torch and transformers start-up)

# Run in the server process before the CLI: the privatizer of a stream whose noise multiplier is
# one of these fails on its n-th forward pass, after that pass's charge ("after": in the noise) or
# before it ("before": in the range check that precedes the charge), with a RuntimeError (a fault)
# or an UnsafeInput (what NaN in a hidden state raises). Streams at other multipliers are
# untouched. The dtype of every state the hook sees is printed to the server's log.
FAULTS = """
from gaussdp.errors import UnsafeInput
from gaussdp.inference.privatizer import HiddenStatePrivatizer as P

_PLANS = {
    7.25: ("after", 3, RuntimeError),
    7.5: ("after", 1, RuntimeError),
    7.75: ("before", 1, RuntimeError),
    7.875: ("before", 2, UnsafeInput),
}
_release, _check_range, _privatize = P._release, P._check_range, P.privatize


def _fault(self, where):
    plan = _PLANS.get(self.noise_multiplier)
    if plan is not None and plan[0] == where:
        self.test_fault_passes = getattr(self, "test_fault_passes", 0) + 1
        if self.test_fault_passes == plan[1]:
            raise plan[2]("injected fault")


def _faulty_release(self, clipped):
    _fault(self, "after")
    return _release(self, clipped)


def _faulty_check_range(self, dtype):
    _fault(self, "before")
    return _check_range(self, dtype)


def _logged_privatize(self, hidden, **kwargs):
    print(f"privatize dtype={hidden.dtype}", flush=True)
    return _privatize(self, hidden, **kwargs)


P._release, P._check_range, P.privatize = _faulty_release, _faulty_check_range, _logged_privatize
"""
VOCAB = 128


@dataclass
class Served:
    url: str
    key: str
    log: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1)


def save_qwen2(path: Path, dtype: torch.dtype) -> Path:
    """A small Qwen2-shaped causal LM (random weights) saved with ``save_pretrained`` in ``dtype``."""
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
    )  # fmt: skip
    transformers.Qwen2ForCausalLM(config).to(dtype).save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, serve_gaussdp) -> Iterator[Served]:  # type: ignore[no-untyped-def]
    from gaussdp.budget import Ledger
    from gaussdp.service.keys import create_api_key

    root = tmp_path_factory.mktemp("served_qwen2")
    bf16 = save_qwen2(root / "qwen2-bf16", torch.bfloat16)
    fp16 = save_qwen2(root / "qwen2-fp16", torch.float16)
    db = f"sqlite:///{root / 'ledger.db'}"
    with Ledger(db) as ledger:
        key = create_api_key(ledger.store, "acme")
    args = ["--db", db, "--model", f"bf16={bf16}", "--model", f"fp16={fp16}"]
    with serve_gaussdp(root, args, prelude=FAULTS) as url:
        yield Served(url, key, root / "serve.log")


def _session(served: Served) -> str:
    r = httpx.post(served.url + "/v1/sessions", json={"epsilon": 50.0, "delta": 1e-5}, headers=served.headers)
    assert r.status_code == 201, r.text
    return str(r.json()["session_id"])


def _charges(served: Served, sid: str) -> list[dict]:  # type: ignore[type-arg]
    r = httpx.get(f"{served.url}/v1/sessions/{sid}/history", params={"limit": 1000}, headers=served.headers)
    assert r.status_code == 200, r.text
    return list(r.json()["charges"])


def _stream(served: Served, sid: str, **start):  # type: ignore[no-untyped-def]
    """Every message of one WebSocket stream, and the close code and reason."""
    body = {"prompt_ids": [5, 17, 42, 8], "max_new_tokens": 8, "noise_multiplier": 8.0, "stop_at_eos": False}
    body.update(start)
    url = f"{served.ws_url}/v1/sessions/{sid}/generate"
    with connect(url, additional_headers=served.headers) as ws:
        ws.send(json.dumps(body))
        messages = [json.loads(ws.recv(timeout=60))]
        while messages[-1]["type"] in ("start", "token"):
            messages.append(json.loads(ws.recv(timeout=60)))
        with pytest.raises(websockets.exceptions.ConnectionClosed):
            ws.recv(timeout=10)
        return messages, ws.close_code, ws.close_reason


@pytest.mark.parametrize("model", ["bf16", "fp16"])
def test_a_half_precision_qwen2_streams_and_every_token_is_charged_once(served, model) -> None:  # type: ignore[no-untyped-def]
    sid = _session(served)
    messages, code, _ = _stream(served, sid, model=model)
    start, *tokens, end = messages
    assert start["type"] == "start" and start["layer"] == "model.layers.1" and start["prompt_tokens"] == 4
    assert end["type"] == "end" and end["finish_reason"] == "length", end
    assert code == 1000
    assert len(tokens) == 8 == end["tokens_sent"] and all(0 <= t["token_id"] < VOCAB for t in tokens)
    charges = _charges(served, sid)
    assert [c["charge_id"] for c in charges] == [t["charge_id"] for t in tokens]
    assert [c["idempotency_key"] for c in charges] == [f"{start['stream_id']}/{i}" for i in range(8)]
    # the prompt's 4 rows with the first token, then one row per token: the key/value cache is used
    assert charges[0]["event"]["count"] == 4
    assert all(c["event"] == {"type": "gaussian", "noise_multiplier": 8.0} for c in charges[1:])
    # the same through POST
    r = httpx.post(
        f"{served.url}/v1/sessions/{sid}/generate",
        json={"model": model, "prompt_ids": [1, 2, 3], "max_new_tokens": 5, "noise_multiplier": 8.0},
        headers=served.headers,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out["tokens"]) == 5 and out["finish_reason"] == "length"
    assert len(_charges(served, sid)) == 8 + 5
    log = served.log.read_text()
    assert f"privatize dtype=torch.{'bfloat16' if model == 'bf16' else 'float16'}" in log
    assert "past_key_values" not in log  # transformers' deprecation warning, once per stream before


def test_a_fault_after_a_charge_ends_the_stream_and_names_the_charge(served) -> None:  # type: ignore[no-untyped-def]
    sid = _session(served)
    # the third forward pass fails after its charge: tokens 0 and 1 sent, token 2 charged, not sent
    messages, code, reason = _stream(served, sid, model="bf16", noise_multiplier=7.25)
    start, *tokens, error = messages
    assert len(tokens) == 2 and error["type"] == "error" and error["error"] == "generation_failed", error
    assert error["tokens_sent"] == 2 and error["tokens_charged"] == 3
    charges = _charges(served, sid)
    assert len(charges) == 3  # exactly the charges made: no second charge of token 2, no others
    (lost,) = error["charged_not_sent"]
    assert lost == {
        "index": 2,
        "charge_id": charges[2]["charge_id"],
        "idempotency_key": f"{start['stream_id']}/2",
    }
    assert [c["charge_id"] for c in charges[:2]] == [t["charge_id"] for t in tokens]
    assert f"charge_id {charges[2]['charge_id']}" in error["detail"] and "RuntimeError" in error["detail"]
    assert "injected fault" not in error["detail"]  # the cause's text stays in the server's log
    assert code == 1011 and reason == "generation_failed: charged 3, sent 2"
    assert "injected fault" in served.log.read_text()

    # the Python client raises it, with what was charged
    from gaussdp.client import GaussDPClient, ServiceError

    sid = _session(served)
    with GaussDPClient(served.url, served.key) as client:
        stream = client.stream_generate(sid, model="bf16", prompt_ids=[1, 2], noise_multiplier=7.25)
        with stream, pytest.raises(ServiceError) as raised:
            for _ in stream:
                pass
    assert raised.value.status == 500 and raised.value.error == "generation_failed"
    assert len(stream.tokens) == 2 and raised.value.body["tokens_charged"] == 3
    assert len(_charges(served, sid)) == 3

    # a fault before the charge: nothing charged for that token, and the error says so
    sid = _session(served)
    messages, code, reason = _stream(served, sid, model="fp16", noise_multiplier=7.75)
    (_, error) = messages
    assert error["error"] == "generation_failed" and error["tokens_charged"] == 0, error
    assert error["charged_not_sent"] == [] and "nothing was charged" in error["detail"]
    assert code == 1011 and reason == "generation_failed: charged 0, sent 0"
    assert _charges(served, sid) == []


def test_post_generate_reports_a_fault_after_the_charge(served) -> None:  # type: ignore[no-untyped-def]
    sid = _session(served)
    url = f"{served.url}/v1/sessions/{sid}/generate"
    body = {"model": "bf16", "prompt_ids": [1, 2, 3], "max_new_tokens": 6, "stop_at_eos": False}
    # at the first token: 500, naming the charge that stands
    r = httpx.post(url, json={**body, "noise_multiplier": 7.5}, headers=served.headers, timeout=60)
    assert r.status_code == 500, r.text
    (charge,) = _charges(served, sid)
    assert r.json()["error"] == "generation_failed"
    assert f"charge_id {charge['charge_id']}" in r.json()["detail"] and "stands" in r.json()["detail"]
    # after two tokens: 200 with those tokens, and the failed third token's charge named
    r = httpx.post(url, json={**body, "noise_multiplier": 7.25}, headers=served.headers, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["finish_reason"] == "error" and out["error"] == "generation_failed"
    assert len(out["tokens"]) == 2
    charges = _charges(served, sid)[1:]
    assert len(charges) == 3
    assert [c["charge_id"] for c in charges[:2]] == [t["charge_id"] for t in out["tokens"]]
    assert "token 2's forward pass failed" in out["detail"]
    assert f"charge_id {charges[2]['charge_id']}" in out["detail"]
    # refused before the second token's charge: the first token (charged) is answered, not dropped
    r = httpx.post(url, json={**body, "noise_multiplier": 7.875}, headers=served.headers, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["finish_reason"] == "error" and out["error"] == "invalid" and len(out["tokens"]) == 1
    assert len(_charges(served, sid)) == 1 + 3 + 1
