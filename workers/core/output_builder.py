"""Request outputs from sequences: the cumulative text and tokens, and what is new since the
request's previous output.

While the tail of a sequence's text could still grow into a stop string it is held back from
streaming (``Sequence.append_token`` matches stop strings and cuts them away).
"""

from __future__ import annotations

import numpy as np

from raylm.workers.core.request import RequestState, StreamCursor
from raylm.workers.core.request_output import CompletionOutput, RequestOutput
from raylm.workers.core.sequence import Sequence


def _streamable_text(seq: Sequence, cursor: StreamCursor) -> str:
    """Text that can be shown now: all of it once finished, else minus a possible stop prefix."""
    if seq.finished or not seq.params.stop:
        return seq.text
    hold = max(map(len, seq.params.stop)) - 1
    return seq.text[: max(cursor.chars, len(seq.text) - hold)]


def stream_completion_output(seq: Sequence, cursor: StreamCursor,
                             hidden_states: np.ndarray | None = None) -> CompletionOutput:
    """The cumulative output of ``seq`` with the deltas since ``cursor``, which it advances to
    the end of what is returned (so the next call's deltas start there)."""
    visible = _streamable_text(seq, cursor)
    out = CompletionOutput(
        index=seq.index,
        text=visible,
        token_ids=list(seq.output_ids),
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        text_delta=visible[cursor.chars :],
        token_ids_delta=seq.output_ids[cursor.tokens :],
        hidden_states=hidden_states,
    )
    cursor.chars, cursor.tokens = len(visible), len(seq.output_ids)
    return out


def stream_request_output(state: RequestState, final: bool) -> RequestOutput:
    """A ``RequestOutput`` for a request's current state; advances its stream cursors."""
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_ids,
        outputs=[stream_completion_output(seq, cursor, state.hidden_states)
                 for seq, cursor in zip(state.seqs, state.cursors)],
        finished=final,
        num_cached_tokens=state.seqs[0].num_cached_tokens,
        arrival_time=state.arrival_time,
        first_scheduled_time=state.seqs[0].first_scheduled_time,
        embedding=state.seqs[0].embedding.vector if state.seqs[0].embedding is not None else None,
    )
