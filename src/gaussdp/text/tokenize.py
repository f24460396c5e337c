"""Reading and tokenising the text to perturb: one documented rule, the same in Python and in the browser.

Rule: a word is a maximal run of Unicode letters and digits, optionally joined by single inner
apostrophes (``couldn't``, ``harry's``); it is lower-cased. Everything else (punctuation, symbols,
whitespace) separates words and is **dropped** from the perturbed output. Line breaks are kept so the
output has the same lines as the input. What the output still reveals: the number of words per line
(each word maps to exactly one output word) and the number of lines.

The browser page (``gaussdp/text/static/text.js``) implements the same rule with the regular
expression ``/[\\p{L}\\p{N}]+(?:'[\\p{L}\\p{N}]+)*/gu``.

Input limits (the text perturbation service): UTF-8, at most 20 MB (20 * 10^6 bytes). Anything else raises
:class:`gaussdp.errors.UnsafeInput` before any word is processed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from gaussdp.errors import UnsafeInput

__all__ = ["MAX_INPUT_BYTES", "decode_text", "lines_of_words", "read_text", "words"]

MAX_INPUT_BYTES = 20_000_000

# [^\W_] is "a word character that is not the underscore": Unicode letters and digits.
_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")


def words(text: str) -> list[str]:
    """The lower-cased words of ``text`` under the rule above (punctuation dropped)."""
    return [m.group(0).lower() for m in _WORD.finditer(text.replace("\u2019", "'"))]


def lines_of_words(text: str) -> list[list[str]]:
    """``words`` applied line by line (``\\n``, ``\\r\\n`` and ``\\r`` end a line)."""
    return [words(line) for line in text.splitlines()]


def decode_text(data: bytes, *, max_bytes: int = MAX_INPUT_BYTES) -> str:
    """Decode UTF-8 bytes, refusing oversize or invalid input with :class:`UnsafeInput`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise UnsafeInput(f"input is {len(data)} bytes, over the limit of {max_bytes} bytes (20 MB)")
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsafeInput(f"input is not valid UTF-8 (byte {exc.start}: {exc.reason})") from None
    return text.removeprefix("\ufeff")


def read_text(path: str | os.PathLike[str], *, max_bytes: int = MAX_INPUT_BYTES) -> str:
    """Read a UTF-8 file of at most ``max_bytes`` bytes (checked before reading it whole)."""
    path = Path(path)
    size = path.stat().st_size
    if size > max_bytes:
        raise UnsafeInput(f"{path} is {size} bytes, over the limit of {max_bytes} bytes (20 MB)")
    with open(path, "rb") as fh:
        data = fh.read(max_bytes + 1)
    return decode_text(data, max_bytes=max_bytes)
