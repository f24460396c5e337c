"""gaussdp.client against ``gaussdp serve`` in a subprocess (issue 20): sessions, releases, split
mode matching the in-process result, streaming, and retries that never charge twice."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("websockets")

from gaussdp.client import (  # noqa: E402
    BudgetExhausted,
    GaussDPClient,
    InvalidRequest,
    NotFound,
    ResponseLost,
    Unauthorized,
)
from gaussdp.errors import NotPrivateWarning, UnsafeInput  # noqa: E402

pytestmark = pytest.mark.slow  # one server for the session (torch and transformers start-up)


class DropFirstResponse(httpx.BaseTransport):
    """Forwards every request; the first response to a path ending in ``suffix`` is read by the
    server's side and then lost (the connection drops), as after a charge on a flaky network."""

    def __init__(self, suffix: str) -> None:
        self._inner = httpx.HTTPTransport()
        self._suffix = suffix
        self.dropped = 0
        self.requests: list[str] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        self.requests.append(request.url.path)
        if not self.dropped and request.url.path.endswith(self._suffix):
            response.read()
            response.close()
            self.dropped += 1
            raise httpx.ReadError("connection dropped (injected)", request=request)
        return response

    def close(self) -> None:
        self._inner.close()


def test_sessions_releases_and_errors(served_lm) -> None:  # type: ignore[no-untyped-def]
    with GaussDPClient(served_lm.url, served_lm.key) as c:
        s = c.create_session(epsilon=4.0, delta=1e-5)
        assert s.session_id in c.list_sessions() and c.get_session(s.session_id).charges == 0
        r = c.release(s.session_id, [3.0, 4.0], sigma=5.0, sensitivity=1.0)
        assert r.vector.shape == (2,) and r.sigma == 5.0 and r.spent.epsilon > 0
        h = c.hidden_state(s.session_id, np.ones(8, dtype=np.float32), sigma=8.0)
        assert h.noised.shape == (8,) and h.sensitivity == 2.0
        assert [ch.charge_id for ch in c.history(s.session_id)] == [r.charge_id, h.charge_id]
        with pytest.raises(BudgetExhausted) as exc:
            c.release(s.session_id, [1.0], epsilon=5.0, delta=1e-6)
        assert exc.value.status == 409 and exc.value.error == "budget_exhausted"
        with pytest.raises(NotFound):
            c.get_session("nope")
        with pytest.raises(UnsafeInput, match="vector"):  # refused before anything is sent
            c.release(s.session_id, [float("inf")], sigma=1.0)
        with pytest.raises(InvalidRequest, match="sensitivity"):
            c.release(s.session_id, [1.0], sigma=1.0, sensitivity=-1.0)
    with GaussDPClient(served_lm.url, "gdp_0000000000000000_" + "x" * 43) as bad, pytest.raises(Unauthorized):
        bad.list_sessions()


@pytest.mark.parametrize("route", ["release", "lora-delta", "generate"])
def test_a_retry_after_a_dropped_response_is_charged_once(served_lm, route) -> None:  # type: ignore[no-untyped-def]
    transport = DropFirstResponse("/" + route)
    with GaussDPClient(served_lm.url, served_lm.key, transport=transport, backoff_s=0.01) as c:
        sid = c.create_session(epsilon=20.0, delta=1e-5).session_id
        with pytest.raises(ResponseLost) as exc:
            if route == "release":
                c.release(sid, [1.0, 2.0], sigma=10.0)
            elif route == "lora-delta":
                c.lora_delta(sid, np.zeros((1, 32)), adapter="ad", clip_norm=1.0, sigma=20.0)
            else:
                c.generate(sid, model="tiny", prompt_ids=[3, 4], max_new_tokens=1, noise_multiplier=8.0)
        assert "charged" in str(exc.value) and exc.value.error == "idempotency_key_used"
        assert transport.dropped == 1 and transport.requests.count(f"/v1/sessions/{sid}/{route}") == 2
        charges = c.history(sid)
        assert len(charges) == 1 and charges[0].idempotency_key.startswith("c-")  # one key, sent twice


def test_split_mode_through_the_service_matches_the_in_process_result(served_lm) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gaussdp.inference import HiddenStatePrivatizer, client_finish, client_forward, server_lora_delta
    from gaussdp.service.loading import load_lora_adapter

    model = AutoModelForCausalLM.from_pretrained(served_lm.model_dir).eval()
    ids = AutoTokenizer.from_pretrained(served_lm.model_dir)(
        "the minister said", return_tensors="pt"
    ).input_ids
    layer = "transformer.h.0"

    def privatizer():  # type: ignore[no-untyped-def]
        with pytest.warns(NotPrivateWarning):  # a named seed: the same noise twice, marked not private
            return HiddenStatePrivatizer(model, layer, clip_norm=1.0, sigma=5.0, seed=7)

    with GaussDPClient(served_lm.url, served_lm.key) as c:
        sid = c.create_session(epsilon=20.0, delta=1e-5).session_id
        out, answer = c.split_lora_delta(sid, model, ids, privatizer(), adapter="ad", layer=layer)
        charges = c.history(sid)
    a, b, scaling = load_lora_adapter(served_lm.adapter_dir)
    local = privatizer()
    noised = client_forward(model, ids, layer, local)
    delta = server_lora_delta(noised, a, b, scaling)
    ref = client_finish(model, ids, layer, delta, clip_norm=1.0)
    np.testing.assert_array_equal(answer.delta, delta.numpy())
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
    assert not torch.equal(out.logits, model(ids).logits)  # the delta (and the noise) did change them
    # the server charged the session what the client declared: one row, sigma / (2 C)
    assert len(charges) == 1 and charges[0].event == {"noise_multiplier": 2.5, "type": "gaussian"}
    assert answer.neighbouring == "replace_one" and answer.noise_multiplier == 2.5


def test_split_mode_under_ckks_matches_the_plain_split(served_lm) -> None:  # type: ignore[no-untyped-def]
    """``split_lora_delta(ckks=...)``: the same noised rows travel encrypted, the server computes
    on ciphertext, and the decrypted delta (and the logits) match the plain split mode's."""
    pytest.importorskip("tenseal")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gaussdp.inference import HiddenStatePrivatizer
    from gaussdp.inference.ckks import CKKSClient

    model = AutoModelForCausalLM.from_pretrained(served_lm.model_dir).eval()
    ids = AutoTokenizer.from_pretrained(served_lm.model_dir)(
        "the minister said", return_tensors="pt"
    ).input_ids
    layer = "transformer.h.0"

    def privatizer():  # type: ignore[no-untyped-def]
        with pytest.warns(NotPrivateWarning):  # a named seed: the same noise twice, marked not private
            return HiddenStatePrivatizer(model, layer, clip_norm=1.0, sigma=5.0, seed=7)

    keys = CKKSClient(rank=4)  # the served adapter's rank: only the rotation keys it needs
    with GaussDPClient(served_lm.url, served_lm.key) as c:
        sid = c.create_session(epsilon=20.0, delta=1e-5).session_id
        out_plain, plain = c.split_lora_delta(sid, model, ids, privatizer(), adapter="ad", layer=layer)
        out_ckks, enc = c.split_lora_delta(
            sid, model, ids, privatizer(), adapter="ad", layer=layer, ckks=keys
        )
        charges = c.history(sid)
    assert enc.delta.shape == plain.delta.shape
    assert np.linalg.norm(enc.delta - plain.delta) / np.linalg.norm(plain.delta) <= 1e-4
    torch.testing.assert_close(out_ckks.logits, out_plain.logits, rtol=1e-4, atol=1e-4)
    # charged once each, the same declared event
    assert len(charges) == 2 and charges[0].event == charges[1].event
    assert enc.charge_id == charges[1].charge_id


def test_stream_generate_charges_exactly_the_tokens_consumed(served_lm) -> None:  # type: ignore[no-untyped-def]
    with GaussDPClient(served_lm.url, served_lm.key) as c:
        sid = c.create_session(epsilon=50.0, delta=1e-5).session_id
        opts = {"model": "tiny", "prompt": "the", "noise_multiplier": 8.0, "stop_at_eos": False}
        with c.stream_generate(sid, max_new_tokens=40, **opts) as s:
            got = [t for _, t in zip(range(5), s, strict=False)]  # stop after 5 of 40
        assert len(got) == 5 == len(s.tokens) and s.end is not None and s.end["finish_reason"] == "stopped"
        assert [ch.charge_id for ch in c.history(sid)] == [t.charge_id for t in got]

        sid = c.create_session(epsilon=3.0, delta=1e-5).session_id
        stream = c.stream_generate(
            sid,
            model="tiny",
            prompt="the",
            max_new_tokens=256,
            noise_multiplier=8.0,
            stop_at_eos=False,
            window=8,
        )
        tokens = []
        with pytest.raises(BudgetExhausted) as exc:
            for t in stream:
                tokens.append(t)
        assert exc.value.tokens_sent == len(tokens) == len(c.history(sid)) > 0
        assert exc.value.spent is not None and exc.value.spent["epsilon"] <= 3.0
        with pytest.raises(InvalidRequest):
            c.stream_generate(sid, model="nope", prompt="the", noise_multiplier=8.0)
    # a refused upgrade (the key) is the service's refusal, not a connection failure, and not retried
    with GaussDPClient(served_lm.url, "gdp_0000000000000000_" + "x" * 43) as bad:
        with pytest.raises(Unauthorized) as denied:
            bad.stream_generate(sid, model="tiny", prompt="the", noise_multiplier=8.0)
        assert denied.value.status == 401 and denied.value.error == "unauthorized"
    with GaussDPClient(served_lm.url, served_lm.key) as c:
        g = c.generate(
            c.create_session(epsilon=50.0, delta=1e-5).session_id,
            model="tiny", prompt="the", max_new_tokens=3, noise_multiplier=8.0, stop_at_eos=False,
        )  # fmt: skip
        assert len(g.tokens) == 3 and g.finish_reason == "length" and g.text
