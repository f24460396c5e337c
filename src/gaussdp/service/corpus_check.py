"""The streaming check of an uploaded corpus: one chunk at a time, bounded memory, fail closed.

Used by ``POST /v1/corpora`` (:mod:`gaussdp.service.finetune`) while the body streams to disk: it
counts the records exactly as :func:`gaussdp.finetune.read_corpus` will read them (the job is planned
from that count and the worker re-plans from the file), refuses bytes that are not UTF-8, JSONL
lines that are not objects with a string ``text``, lines over 1 MB, and (for a corpus declared
perturbed by gaussdp's word mechanism) any token that is not a vocabulary word, naming the line and
never echoing the word (it may be raw text).
"""

from __future__ import annotations

import json

from fastapi import HTTPException

from gaussdp.text.tokenize import words

__all__ = ["CorpusChecker"]


class CorpusChecker:
    """Counts records and checks lines as the body streams in (one chunk at a time, bounded memory).

    Records and line numbers follow :func:`gaussdp.finetune.read_corpus`: lines split on ``\\n``,
    stripped, empty ones skipped; JSONL lines are objects with a string ``text``.
    """

    _MAX_LINE = 1_000_000  # a longer line is refused (it would be held in memory while incomplete)

    def __init__(self, fmt: str, vocab: frozenset[str] | None, clean: frozenset[str]) -> None:
        self.fmt, self.vocab, self.clean = fmt, vocab, clean
        self.records = 0
        self.lineno = 0
        self._tail = b""
        self._first = True

    def feed(self, chunk: bytes) -> None:
        data = self._tail + chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            self._tail = data
            if len(data) > self._MAX_LINE:
                raise HTTPException(422, f"corpus line {self.lineno + 1} is over {self._MAX_LINE} bytes")
            return
        self._tail = data[cut + 1 :]
        self._lines(data[: cut + 1])

    def finish(self) -> None:
        if self._tail:
            self._lines(self._tail + b"\n")
            self._tail = b""
        if self.records == 0:
            raise HTTPException(422, "the corpus holds no record (every line is empty)")

    def _lines(self, block: bytes) -> None:
        if self._first and block.startswith(b"\xef\xbb\xbf"):
            block = block[3:]
        self._first = False
        raw_lines = block.split(b"\n")[:-1]
        if self.fmt == "lines" and self.vocab is not None:
            # Fast path: whitespace-separated words all of which are one-token vocabulary words
            # (what perturbation outputs) need no per-line work.
            try:
                text = block.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if text is not None and set(text.split()) <= self.clean:
                # str.strip, as read_corpus: a line of Unicode spaces only is no record
                self.records += sum(1 for line in text.split("\n")[:-1] if line.strip())
                self.lineno += len(raw_lines)
                return
        for raw in raw_lines:
            self.lineno += 1
            try:
                line = raw.decode("utf-8").rstrip("\r").strip()
            except UnicodeDecodeError as exc:
                raise HTTPException(
                    422, f"corpus line {self.lineno} is not valid UTF-8 (byte {exc.start + 1})"
                ) from None
            if not line:
                continue
            if self.fmt == "jsonl":
                try:
                    obj = json.loads(line)
                except ValueError:
                    raise HTTPException(422, f"corpus line {self.lineno} is not valid JSON") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise HTTPException(
                        422, f"corpus line {self.lineno}: a JSON object with a string 'text' field is needed"
                    )
                line = obj["text"].strip()
                if not line:
                    continue
            if self.vocab is not None and any(w not in self.vocab for w in words(line)):
                # never echo the words: they may be raw text
                raise HTTPException(
                    422,
                    f"corpus line {self.lineno} holds a token that is not a word of this server's "
                    "vocabulary: "
                    "it was declared perturbed by gaussdp's mechanism, which outputs vocabulary words only",
                )
            self.records += 1
