"""Incremental detokenization for streaming.

Byte-level BPE splits multi-byte characters across tokens, and some decoders strip or
add spaces depending on context, so decoding tokens one at a time is wrong. We decode a
short window of recent tokens and emit only text that (a) extends what the window
decoded to before and (b) does not end in a replacement character (an unfinished UTF-8
sequence). ``finish()`` flushes anything held back, so the concatenation of all emitted
pieces equals ``tokenizer.decode(all_ids)``.
"""

from __future__ import annotations

from typing import Sequence

from raylm.model.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas (one instance per sequence)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        # Tokens [prefix_offset, read_offset) were already emitted; they give decode context.
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly printable text (may be empty)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Flush text held back at the end (e.g. a genuinely incomplete UTF-8 sequence)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
