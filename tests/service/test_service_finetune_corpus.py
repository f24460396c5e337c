"""The upload's streaming corpus check counts records exactly as gaussdp.finetune.read_corpus reads
them (the job is planned from that count; the worker re-plans from the file), whatever the chunking."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
finetune = pytest.importorskip("gaussdp.finetune")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gaussdp.service.corpus_check import CorpusChecker  # noqa: E402

WORDS = frozenset({"the", "and", "in", "with", "at", "couldn't"})
# words end with a space: joined pieces never make a new (non-vocabulary) word
pieces = st.sampled_from(
    ["the ", "and ", "in ", "with ", "at ", " ", "\n", "\r\n", "\u00a0", "\t", "\u2003", "é "]
)


def _check(data: bytes, fmt: str, vocab: frozenset[str] | None, cuts: list[int]) -> int:
    c = CorpusChecker(fmt, vocab, WORDS)
    prev = 0
    for cut in [*sorted({min(len(data), x) for x in cuts}), len(data)]:
        if cut > prev:
            c.feed(data[prev:cut])
            prev = cut
    c.finish()
    return c.records


@settings(max_examples=200, deadline=None)
@given(st.lists(pieces, min_size=1, max_size=60), st.lists(st.integers(0, 400), max_size=8), st.booleans())
def test_line_records_match_read_corpus(parts: list[str], cuts: list[int], checked: bool) -> None:
    data = "".join(parts).encode()
    try:
        expected = len(finetune.read_corpus(data, format="lines"))
    except Exception:
        expected = 0  # no record at all
    vocab = (WORDS | {"é"}) if checked else None
    if expected == 0:
        with pytest.raises(Exception, match="no record"):
            _check(data, "lines", vocab, cuts)
    else:
        assert _check(data, "lines", vocab, cuts) == expected


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from(["the and", "", "  ", "in\u00a0with"]), min_size=1, max_size=20),
    st.lists(st.integers(0, 300), max_size=5),
)
def test_jsonl_records_match_read_corpus(texts: list[str], cuts: list[int]) -> None:
    data = "\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts)).encode()
    expected = sum(1 for t in texts if t.strip())
    if expected:
        assert len(finetune.read_corpus(data, format="jsonl")) == expected
        assert _check(data, "jsonl", WORDS, cuts) == expected
    else:
        with pytest.raises(Exception, match="no record"):
            _check(data, "jsonl", WORDS, cuts)


def test_a_non_vocabulary_word_is_refused_naming_its_line_never_echoing_it() -> None:
    from fastapi import HTTPException

    with pytest.raises(HTTPException) as info:
        _check(b"the and\n\nin Secretword\n", "lines", WORDS, [5])
    assert info.value.status_code == 422 and "line 3" in info.value.detail
    assert "secretword" not in info.value.detail.lower()
    with pytest.raises(HTTPException, match="line 2 is not valid UTF-8"):
        _check(b"the\n\xff\n", "lines", None, [])


def test_jsonl_lines_are_bounded_in_depth_and_the_check_in_cpu() -> None:
    from gaussdp._worklimit import cpu_limit
    from gaussdp.errors import WorkLimitExceeded
    from gaussdp.service.errors import Refusal

    deep = b'{"text": "the"}\n' + b"[" * 100_000 + b"\n"  # Python's json would recurse past its limit
    with pytest.raises(Refusal) as info:
        _check(deep, "jsonl", None, [])
    assert info.value.code == "json_too_deep" and "line 2" in info.value.detail
    shallow_but_not_text = b'{"text": "the"}\n' + b"[" * 20 + b"]" * 20 + b"\n"
    with pytest.raises(Refusal, match="line 2: a JSON object"):
        _check(shallow_but_not_text, "jsonl", None, [])
    # every slow loop looks at the request's CPU limit (here: a block of 30,000 lines to tokenize)
    slow = "".join(f'{{"text": "the and Word{i}"}}\n' for i in range(30_000)).encode()
    with cpu_limit(1e-4), pytest.raises(WorkLimitExceeded):
        CorpusChecker("jsonl", WORDS | {f"word{i}" for i in range(30_000)}, WORDS).feed(slow)
