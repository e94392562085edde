"""Incremental detokenization: streamed pieces add up to the full decode, never a broken char."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raylm.model.text.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! 😀 naïve café — 你好，世界 👨‍👩‍👧‍👦",
    "code:\n\tdef f():\n\t\treturn '🇫🇷'\n",
    "Привет 123 مرحبا नमस्ते",
]


def _stream(tokenizer, ids, chunk_sizes, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    pieces, i = [], 0
    for size in chunk_sizes:
        if i >= len(ids):
            break
        pieces.append(detok.add(ids[i : i + size]))
        i += size
    if i < len(ids):
        pieces.append(detok.add(ids[i:]))
    pieces.append(detok.finish())
    return pieces


def test_real_text_streams_whole_characters(bundled_model):
    tok = bundled_model.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        pieces = _stream(tok, ids, [1] * len(ids))
        assert "".join(pieces) == text
        # Emoji and CJK span several byte-level tokens: no piece may carry half of one.
        assert all("\ufffd" not in piece for piece in pieces)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ids=st.lists(st.integers(min_value=0, max_value=49151), min_size=0, max_size=40),
    chunks=st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=40),
    skip=st.booleans(),
)
def test_concatenation_equals_full_decode(bundled_model, ids, chunks, skip):
    """Any ids (special tokens, split multi-byte chars, invalid bytes) and any chunking."""
    tok = bundled_model.tokenizer
    pieces = _stream(tok, ids, chunks, skip_special_tokens=skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
