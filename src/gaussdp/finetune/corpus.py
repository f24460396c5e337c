"""Training corpora for :mod:`gaussdp.finetune`: one record per line, or JSONL with a ``text`` field.

A record is the privacy unit of the fine-tuning guarantee (add/remove of one record): one line of a
text file, or one JSON object of a JSONL file. Reading fails closed: a line that is not UTF-8, not
JSON (in JSONL), or has no string ``text`` is refused with its line number; nothing is returned.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gaussdp._validate import check_choice
from gaussdp.errors import InvalidParameter

__all__ = ["CORPUS_FORMATS", "read_corpus"]

CORPUS_FORMATS = ("auto", "lines", "jsonl")
_JSONL_SUFFIXES = (".jsonl", ".ndjson")


def _raw_lines(path_or_lines: Any) -> tuple[list[bytes | str], str | None]:
    """The lines (undecoded where they came from a file) and the file's suffix, if any."""
    if isinstance(path_or_lines, str | Path):
        p = Path(path_or_lines)
        if not p.is_file():
            raise InvalidParameter(f"corpus: no such file {str(p)!r}")
        data = p.read_bytes()
        if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark is not text
            data = data[3:]
        return list(data.split(b"\n")), p.suffix.lower()
    if isinstance(path_or_lines, bytes | bytearray):
        return list(bytes(path_or_lines).split(b"\n")), None
    if isinstance(path_or_lines, Iterable):
        out: list[bytes | str] = []
        for i, line in enumerate(path_or_lines, 1):
            if not isinstance(line, str | bytes):
                raise TypeError(f"corpus line {i} must be str or bytes, got {type(line).__name__}")
            out.append(line)
        return out, None
    raise TypeError(
        "path_or_lines must be a path (str or Path), bytes, or an iterable of lines, "
        f"got {type(path_or_lines).__name__}"
    )


def _decode(line: bytes | str, lineno: int) -> str:
    if isinstance(line, str):
        return line
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidParameter(
            f"corpus line {lineno} is not valid UTF-8 (byte {exc.start + 1}): {exc.reason}"
        ) from None


def _looks_like_jsonl(first: str) -> bool:
    try:
        obj = json.loads(first)
    except ValueError:
        return False
    return isinstance(obj, dict) and "text" in obj


def read_corpus(
    path_or_lines: str | Path | bytes | Iterable[str | bytes],
    *,
    format: str = "auto",
    max_records: int | None = None,
) -> list[str]:
    """The records of a training corpus: one per non-empty line, or per JSONL object's ``text``.

    Each record is one unit of privacy for :func:`gaussdp.finetune.run_finetune` (add/remove one
    record). Lines are split on ``\\n`` (a trailing ``\\r`` is dropped), stripped of surrounding
    whitespace, and empty ones skipped; a UTF-8 byte-order mark at the start of a file is ignored.

    Args:
        path_or_lines: a file path (``str`` or ``Path``), the file's bytes, or an iterable of lines.
        format: ``"lines"`` (one record per line), ``"jsonl"`` (one JSON object per line, the record
            its ``"text"`` string; other fields ignored; an empty ``text`` is skipped like an empty
            line), or ``"auto"`` (default): JSONL when the file name ends in ``.jsonl``/``.ndjson``
            or the first non-empty line is a JSON object with a ``"text"`` field (not for ``.txt``),
            else lines.
        max_records: the most records accepted (``None``: no limit); a corpus with more is refused
            (not truncated), so a service can bound the cost of an upload.

    Returns:
        The records, in file order.

    Raises:
        InvalidParameter: an unknown ``format``, a line that is not UTF-8, bad JSON or a missing or
            non-string ``text`` in JSONL (each with its 1-based line number), no record at all, or
            more than ``max_records``.
        TypeError: ``path_or_lines`` or one of its lines has the wrong type.

    >>> read_corpus(["first line", "", '  second  '])
    ['first line', 'second']
    >>> read_corpus(['{"text": "a"}', '{"text": "b", "id": 7}'])
    ['a', 'b']
    """
    check_choice("format", format, CORPUS_FORMATS)
    if max_records is not None:
        if isinstance(max_records, bool) or not isinstance(max_records, int):
            raise TypeError(f"max_records must be an int or None, got max_records={max_records!r}")
        if max_records < 1:
            raise InvalidParameter(f"max_records must be >= 1, got max_records={max_records}")
    lines, suffix = _raw_lines(path_or_lines)
    mode = format
    records: list[str] = []
    for lineno, raw in enumerate(lines, 1):
        text = _decode(raw, lineno).rstrip("\r").strip()
        if not text:
            continue
        if mode == "auto":
            # a .txt file is lines even if its first line happens to be a JSON object
            sniff = suffix != ".txt" and text.startswith("{") and _looks_like_jsonl(text)
            mode = "jsonl" if suffix in _JSONL_SUFFIXES or sniff else "lines"
        if mode == "jsonl":
            try:
                obj = json.loads(text)
            except ValueError as exc:
                raise InvalidParameter(f"corpus line {lineno} is not valid JSON: {exc}") from None
            if not isinstance(obj, dict):
                raise InvalidParameter(
                    f"corpus line {lineno}: a JSONL record must be a JSON object with a 'text' "
                    f"field, got {type(obj).__name__}"
                )
            if "text" not in obj:
                raise InvalidParameter(f"corpus line {lineno}: the JSON object has no 'text' field")
            value = obj["text"]
            if not isinstance(value, str):
                raise InvalidParameter(
                    f"corpus line {lineno}: 'text' must be a string, got {type(value).__name__}"
                )
            text = value.strip()
            if not text:
                continue
        records.append(text)
        if max_records is not None and len(records) > max_records:
            raise InvalidParameter(
                f"the corpus holds more than max_records={max_records} records (line {lineno})"
            )
    if not records:
        raise InvalidParameter("the corpus holds no record (every line is empty)")
    return records
