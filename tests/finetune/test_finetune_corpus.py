"""read_corpus: lines and JSONL, empty lines skipped, errors with line numbers, no partial result."""

from __future__ import annotations

import pytest

from gaussdp.errors import InvalidParameter
from gaussdp.finetune import read_corpus


def test_lines_file_skips_empty_lines_and_strips(tmp_path):
    p = tmp_path / "c.txt"
    p.write_bytes(b"\xef\xbb\xbfthe first record\r\n\n   \n second record \n")
    assert read_corpus(p) == ["the first record", "second record"]


def test_jsonl_by_suffix_and_by_sniffing(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text('{"text": "a b"}\n\n{"text": "c", "id": 3}\n{"text": ""}\n', encoding="utf-8")
    assert read_corpus(p) == ["a b", "c"]
    assert read_corpus(['{"text": "x"}', '{"text": "y"}']) == ["x", "y"]
    # a .txt file stays lines even when a line looks like JSON
    t = tmp_path / "c.txt"
    t.write_text('{"text": "x"}\n', encoding="utf-8")
    assert read_corpus(t) == ['{"text": "x"}']
    assert read_corpus(['{"text": "x"}'], format="lines") == ['{"text": "x"}']


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        (['{"text": "ok"}', "{not json"], "line 2 is not valid JSON"),
        (['{"text": "ok"}', '{"body": "x"}'], "line 2: the JSON object has no 'text' field"),
        (['{"text": "ok"}', "", '{"text": 5}'], "line 3: 'text' must be a string"),
        (['{"text": "ok"}', "[1, 2]"], "line 2: a JSONL record must be a JSON object"),
    ],
)
def test_jsonl_errors_name_the_line(lines, match):
    with pytest.raises(InvalidParameter, match=match):
        read_corpus(lines, format="jsonl")


def test_non_utf8_names_the_line(tmp_path):
    p = tmp_path / "c.txt"
    p.write_bytes(b"good line\nbad \xff line\n")
    with pytest.raises(InvalidParameter, match="line 2 is not valid UTF-8"):
        read_corpus(p)
    with pytest.raises(InvalidParameter, match="line 1 is not valid UTF-8"):
        read_corpus([b"\xc3"])


def test_limits_and_bad_arguments(tmp_path):
    assert read_corpus(["a", "b"], max_records=2) == ["a", "b"]
    with pytest.raises(InvalidParameter, match="max_records=2"):
        read_corpus(["a", "b", "c"], max_records=2)
    with pytest.raises(InvalidParameter, match="max_records must be >= 1"):
        read_corpus(["a"], max_records=0)
    with pytest.raises(InvalidParameter, match="no record"):
        read_corpus(["", "  "])
    with pytest.raises(InvalidParameter, match="format must be"):
        read_corpus(["a"], format="csv")
    with pytest.raises(InvalidParameter, match="no such file"):
        read_corpus(tmp_path / "missing.txt")
    with pytest.raises(TypeError, match="line 2"):
        read_corpus(["a", 3])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="path_or_lines"):
        read_corpus(42)  # type: ignore[arg-type]
