"""A sequence's part in a step's plan, copied out of it when the scheduler plans the step (the
plan's types: ``workers/core/step_plan.py``)."""

from __future__ import annotations

from raylm.workers.core.sequence import Sequence
from raylm.workers.core.step_plan import ScheduledChunk, ScheduledDecode, ScheduledRow


def scheduled_row(seq: Sequence) -> ScheduledRow:
    """What the runner needs of ``seq`` this step (its blocks as grown for the step)."""
    hidden = seq.hidden
    return ScheduledRow(
        seq.seq_id, seq.request_id, tuple(seq.block_ids), seq.params, seq.seed, seq.prompt_ids, seq.output_ids,
        seq.matcher, hidden.slot if hidden is not None else None, hidden.start if hidden is not None else 0,
        seq.lora_slot,
        tuple(seq.sliding_block_ids),
    )


def scheduled_chunk(seq: Sequence, num_tokens: int) -> ScheduledChunk:
    """``seq``'s next ``num_tokens`` uncomputed tokens as a prompt chunk."""
    start = seq.num_computed_tokens
    return ScheduledChunk(scheduled_row(seq), start, tuple(seq.all_ids[start : start + num_tokens]),
                          start + num_tokens == seq.num_tokens, seq.embedding is not None)


def scheduled_decode(seq: Sequence, guesses: int) -> ScheduledDecode:
    """``seq``'s last known token fed back (with the tokens its draft model is behind by)."""
    last = seq.num_tokens - 1
    window = tuple(seq.token_at(i) for i in range(last - seq.draft_lag, last + 1))
    return ScheduledDecode(scheduled_row(seq), last, window, guesses)


def reuses_cached_prefix(seq: Sequence) -> bool:
    """Whether ``seq`` may skip cached prompt blocks: not when it needs the hidden states of
    every prompt token (mean-pooled embeddings, hidden states with the prompt)."""
    if seq.embedding is not None and not seq.embedding.reuses_cached_prefix:
        return False
    return seq.hidden is None or not seq.hidden.includes_prompt
