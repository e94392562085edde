"""Structured output's token masks: what a step's constrained rows may sample, filled from their
grammars (``workers/core/grammar.py`` compiles them) on the host before the step runs.

A mask is int32 words per row, token ``t`` allowed iff bit ``t % 32`` of word ``t // 32`` is
set; free rows allow everything. A speculative step needs one mask per verify position: the
tokens the grammar allows after the row's first ``j`` guesses, which it must accept first
(``accepted_prefix`` drops the guesses past the first it refuses).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from raylm.model.runtime.buckets import cdiv
from raylm.workers.core.step_plan import ScheduledRow

if TYPE_CHECKING:
    import llguidance


def fill_bitmask(matcher: llguidance.LLMatcher, mask: np.ndarray, row: int) -> None:
    """Write the tokens ``matcher`` allows next into ``mask[row]`` (int32 words)."""
    import llguidance.numpy

    llguidance.numpy.fill_next_token_bitmask(matcher, mask, row)


def accepted_prefix(matcher: llguidance.LLMatcher, tokens: Sequence[int]) -> int:
    """How many of ``tokens`` the grammar takes in a row from its current state: speculative
    guesses past the first it refuses are dropped before the target verifies them."""
    return matcher.validate_tokens(list(tokens)) if len(tokens) else 0


def fill_bitmasks_along(matcher: llguidance.LLMatcher, tokens: Sequence[int], masks: np.ndarray, row: int) -> None:
    """``masks[j][row]``: the tokens allowed after ``tokens[:j]``, for ``j`` up to
    ``len(tokens)`` (which the grammar must accept, see ``accepted_prefix``). The matcher
    advances through them and rolls back, so it is left as it was."""
    fill_bitmask(matcher, masks[0], row)
    for j, token in enumerate(tokens, 1):
        if not matcher.consume_token(int(token)):
            raise AssertionError(f"the grammar refused guess {token}, which it had accepted: {matcher.get_error()}")
        fill_bitmask(matcher, masks[j], row)
    if len(tokens):
        matcher.rollback(len(tokens))


def allow_all(rows: int, vocab_size: int) -> np.ndarray:
    """A bitmask that allows every token (the rows of unconstrained sequences): int32 words,
    token ``t`` is bit ``t % 32`` of word ``t // 32``."""
    return np.full((rows, cdiv(vocab_size, 32)), -1, np.int32)


def token_bitmask(rows: Sequence[ScheduledRow], num_rows: int, vocab_size: int) -> np.ndarray | None:
    """The allowed next tokens per row ``[num_rows, W]`` (all for free and padding rows), or
    None when no row is constrained. Valid for the next sampled token only."""
    if not any(row.matcher is not None for row in rows):
        return None
    no_guesses = np.zeros((num_rows, 0), np.int32)
    return position_bitmasks(rows, num_rows, vocab_size, no_guesses, np.zeros(num_rows, np.int32))[0]


def position_bitmasks(rows: Sequence[ScheduledRow], num_rows: int, vocab_size: int, guesses: np.ndarray,
                      num_drafts: np.ndarray) -> np.ndarray:
    """``[K + 1, num_rows, W]``: at verify position ``j``, the tokens each constrained row's
    grammar allows after its first ``j`` guesses (all tokens for free rows and past a row's
    ``num_drafts`` guesses, where nothing is accepted)."""
    K = guesses.shape[1]
    masks = np.stack([allow_all(num_rows, vocab_size)] * (K + 1))
    for r, row in enumerate(rows):
        if row.matcher is not None:
            fill_bitmasks_along(row.matcher, guesses[r, : num_drafts[r]], masks, r)
    return masks
