"""The rules every entry point applies to a prompt before it runs (engine, reference
generator, router): one place, so their errors and arithmetic cannot drift apart."""

from __future__ import annotations

from typing import Sequence

from raylm.model.errors import PromptTooLongError


def check_prompt(prompt_ids: Sequence[int], vocab_size: int, max_tokens: int, max_len: int) -> None:
    """Raise ValueError for an empty prompt or ids outside the vocabulary, and PromptTooLongError
    (with the numbers) when the prompt and ``max_tokens`` new tokens exceed ``max_len``."""
    n = len(prompt_ids)
    if n == 0:
        raise ValueError("the prompt is empty: give at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    if n + max_tokens > max_len:
        raise PromptTooLongError(
            f"prompt has {n} tokens and {max_tokens} new tokens were requested, {n + max_tokens} in all, "
            f"but the maximum context is {max_len} tokens; shorten the prompt or lower max_tokens"
        )
