"""The OpenAI-compatible routes against ``gaussdp serve`` in a subprocess, spoken to by the official
``openai`` client (issue 31): tokens received == charges in /history, exhaustion as an error."""

from __future__ import annotations

import httpx
import pytest

pytest.importorskip("torch")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow  # the shared server of tests/conftest.py (torch and transformers start-up)

PRIVACY = {"noise_multiplier": 8.0, "ignore_eos": True}  # random weights may well pick [EOS] at once


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


def _client(served, key: str | None = None):  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=served.url + "/v1", api_key=key or served.key, max_retries=0, timeout=60)


def test_openai_client_streams_a_chat_and_every_chunk_was_charged_once(served_lm) -> None:  # type: ignore[no-untyped-def]
    sid = _session(served_lm, epsilon=50.0)
    stream = _client(served_lm).chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "the government said"},
        ],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"session_id": sid, **PRIVACY},
    )
    chunks = list(stream)
    tokens = [c for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert len(tokens) == 8
    assert tokens[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    charges = _charges(served_lm, sid)
    assert len(charges) == len(tokens)  # one charge per token received
    assert [c["charge_id"] for c in charges] == [t.model_extra["gaussdp"]["charge_id"] for t in tokens]
    stream_id = tokens[0].id.removeprefix("chatcmpl-")
    assert [c["idempotency_key"] for c in charges] == [f"{stream_id}/{i}" for i in range(8)]
    # the plain fallback template (the tiny tokenizer has none): the prompt's rows are in the first charge
    assert charges[0]["event"]["count"] > 3
    last = chunks[-2].model_extra["gaussdp"]
    assert last["spent"]["epsilon"] <= 50.0 and last["remaining"]["epsilon"] >= 0


def test_exhaustion_mid_stream_raises_and_charges_equal_tokens_received(served_lm) -> None:  # type: ignore[no-untyped-def]
    sid = _session(served_lm, epsilon=3.0)
    stream = _client(served_lm).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "the government said"}],
        max_tokens=256,
        stream=True,
        extra_body={"session_id": sid, **PRIVACY},
    )
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            received.append(chunk)
    assert info.value.body["code"] == "budget_exhausted", info.value.body
    assert "budget" in info.value.message
    assert 1 < len(received) < 256 and info.value.body["tokens_sent"] == len(received)
    assert len(_charges(served_lm, sid)) == len(received)
    # the session is spent: the next request is refused before its first token, nothing charged
    with pytest.raises(openai.ConflictError) as refused:
        _client(served_lm).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "the government said"}],
            extra_body={"session_id": sid, **PRIVACY},
        )
    assert refused.value.code == "budget_exhausted" and "exhausted" in refused.value.message
    assert len(_charges(served_lm, sid)) == len(received)


def test_whole_answers_of_chat_and_completions(served_lm) -> None:  # type: ignore[no-untyped-def]
    sid = _session(served_lm, epsilon=50.0)
    client = _client(served_lm)
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "the government said"}],
        max_tokens=5,
        extra_body={"session_id": sid, **PRIVACY},
    )
    assert chat.object == "chat.completion" and chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 5 and chat.choices[0].message.role == "assistant"
    done = client.completions.create(
        model="tiny",
        prompt="the government said",
        max_tokens=4,
        temperature=0.8,
        top_p=0.9,
        extra_headers={"X-GaussDP-Session": sid},
        extra_body=PRIVACY,
    )
    assert done.object == "text_completion" and done.usage.completion_tokens == 4
    assert done.usage.prompt_tokens == 3
    extra = done.model_extra["gaussdp"]
    assert extra["sampler_private"] is True and len(extra["charge_ids"]) == 4
    charges = _charges(served_lm, sid)
    assert len(charges) == 5 + 4  # sampling is post-processing: no extra charge
    assert [c["charge_id"] for c in charges[5:]] == extra["charge_ids"]
    seeded = client.completions.create(
        model="tiny",
        prompt=[5, 6, 7],
        max_tokens=1,
        temperature=1.0,
        seed=3,
        extra_body={"session_id": sid, **PRIVACY},
    )
    assert seeded.model_extra["gaussdp"]["sampler_private"] is False


def test_refusals_are_openai_errors_and_charge_nothing(served_lm) -> None:  # type: ignore[no-untyped-def]
    sid = _session(served_lm, epsilon=50.0)
    client = _client(served_lm)
    messages = [{"role": "user", "content": "the government said"}]
    with pytest.raises(openai.AuthenticationError):
        _client(served_lm, key="gdp_not_a_key").chat.completions.create(
            model="tiny", messages=messages, extra_body={"session_id": sid, **PRIVACY}
        )
    with pytest.raises(openai.UnprocessableEntityError, match="session_id"):
        client.chat.completions.create(model="tiny", messages=messages, extra_body=PRIVACY)
    with pytest.raises(openai.UnprocessableEntityError, match="sigma"):  # no default noise
        client.chat.completions.create(model="tiny", messages=messages, extra_body={"session_id": sid})
    with pytest.raises(openai.UnprocessableEntityError, match="frequency_penalty"):  # never ignored
        client.chat.completions.create(
            model="tiny", messages=messages, frequency_penalty=0.5, extra_body={"session_id": sid, **PRIVACY}
        )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="tiny", messages=messages, extra_body={"session_id": "nobody", **PRIVACY}
        )
    with pytest.raises(openai.UnprocessableEntityError, match="no model named"):
        client.chat.completions.create(
            model="gpt-4o", messages=messages, extra_body={"session_id": sid, **PRIVACY}
        )
    assert _charges(served_lm, sid) == []


def test_stop_sequence_cuts_the_text_and_ends_with_stop(served_lm) -> None:  # type: ignore[no-untyped-def]
    sid = _session(served_lm, epsilon=50.0)
    client = _client(served_lm)
    first = client.completions.create(
        model="tiny", prompt="the government said", max_tokens=6, extra_body={"session_id": sid, **PRIVACY}
    )
    words = first.choices[0].text.split()
    assert len(words) >= 2
    # greedy through noise: the same prompt need not give the same words; a stop of the first
    # generated word ends every answer that contains it, before it
    stopped = client.completions.create(
        model="tiny",
        prompt="the government said",
        max_tokens=6,
        stop=[words[0]],
        stream=True,
        extra_body={"session_id": sid, **PRIVACY},
    )
    chunks = list(stopped)
    text = "".join(c.choices[0].text for c in chunks)
    assert words[0] not in text
    sent = [c for c in chunks if c.choices[0].finish_reason is None]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert len(_charges(served_lm, sid)) == 6 + len(sent)


def test_a_client_that_leaves_mid_stream_is_charged_what_it_was_sent_and_frees_its_slot(served_lm) -> None:  # type: ignore[no-untyped-def]
    import json
    import time

    sid = _session(served_lm, epsilon=50.0)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "the government said"}],
        "max_tokens": 64,
        "stream": True,
        "session_id": sid,
        **PRIVACY,
    }
    received = 0
    # more abandoned streams than the tenant's share of generation slots (8): a slot that a
    # departed client kept would refuse the last ones with 429
    for _ in range(10):
        with httpx.stream(
            "POST", served_lm.url + "/v1/chat/completions", json=body, headers=served_lm.headers, timeout=60
        ) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r.iter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["gaussdp"]["charge_id"] > 0
                    received += 1
                    break  # leave after the first token
    time.sleep(1.0)  # a token in flight when the client left is charged, never sent
    charges = len(_charges(served_lm, sid))
    assert received == 10 and received <= charges <= received + 10 * 2, charges
