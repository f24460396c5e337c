"""The OpenAI routes' text assembly: stop sequences cut the text (held back while they may begin),
chat templates from the tokenizer with a plain fallback; fast, no server."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from hypothesis import given
from hypothesis import strategies as st

from gaussdp.service.openai_api import ChatMessage, TextStream, render_chat

VOCAB = ["a", "b", "ab", " ", "END", "x"]


def _decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids)


def _run(ids: list[int], stops: list[str]) -> tuple[str, list[str], bool]:
    text = TextStream(_decode, stops)
    pieces = [text.push(i) for i in ids]
    return "".join(pieces) + text.flush(), pieces, text.stopped


@given(
    st.lists(st.integers(0, len(VOCAB) - 1), max_size=30),
    st.lists(st.sampled_from(["ab", "END", "b a", "x"]), max_size=3),
)
def test_the_text_is_the_decoded_whole_cut_before_the_first_stop(ids: list[int], stops: list[str]) -> None:
    out, _, stopped = _run(ids, stops)
    whole = _decode(ids)
    cuts = [whole.find(s) for s in stops if s in whole]
    if cuts:
        assert stopped and out == whole[: min(cuts)]
    else:
        assert not stopped and out == whole


def test_text_that_may_begin_a_stop_waits_for_the_next_token() -> None:
    out, pieces, stopped = _run([0, 1, 3, 0], ["b a"])  # "a", "b", " ", "a": "b a" is cut
    assert pieces == ["a", "", "", ""] and out == "a" and stopped
    out, pieces, stopped = _run([0, 1, 3, 5], ["b a"])  # "b", " " then "x": not a stop after all
    assert pieces == ["a", "", "", "b x"] and out == "ab x" and not stopped


class _Templated:
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"

    def apply_chat_template(self, convo, tokenize, add_generation_prompt):  # type: ignore[no-untyped-def]
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<{m['role']}>{m['content']}" for m in convo) + "<assistant>"


def test_chat_prompts_use_the_tokenizer_s_template_or_a_plain_fallback() -> None:
    messages = [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(
            role="user", content=[{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]
        ),
    ]
    assert render_chat(_Templated(), messages) == "<system>be brief<user>hi there<assistant>"
    assert render_chat(object(), messages) == "system: be brief\nuser: hi there\nassistant:"
