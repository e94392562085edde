"""Turn sampled tokens into output: stop conditions, incremental text, held-back stop prefixes.

Stop strings are matched on the decoded text; the text returned never contains them
(unless asked), and while the tail of the text could still grow into a stop string it is
held back from streaming.
"""

from __future__ import annotations

import logging

from workers.outputs import CompletionOutput, RequestOutput
from workers.request_state import RequestState
from workers.sampler import SampleResult
from workers.sequence import Sequence

logger = logging.getLogger(__name__)


def append_token(seq: Sequence, result: SampleResult, eos_ids: frozenset[int]) -> None:
    """Add one sampled token to ``seq`` and decide whether it finished."""
    token = int(result.tokens)
    params = seq.params
    seq.output_ids.append(token)
    if seq.logprobs is not None:
        entry = {int(i): float(lp) for i, lp in zip(result.top_ids[: params.logprobs], result.top_logprobs)}
        entry[token] = float(result.logprobs)
        seq.logprobs.append(entry)
        seq.cumulative_logprob += float(result.logprobs)
    grammar_done = seq.matcher is not None and _advance_grammar(seq, token)
    past_min = len(seq.output_ids) >= params.min_tokens
    if past_min and not params.ignore_eos and token in eos_ids:
        _finish_text(seq)
        seq.finish_reason = "stop"
        return
    if past_min and token in params.stop_token_ids:
        _finish_text(seq)
        seq.finish_reason, seq.stop_reason = "stop", token
        return
    if seq.detokenizer is not None:
        delta = seq.detokenizer.add([token])
        if _apply_stop_strings(seq, len(delta), past_min):
            return
    if grammar_done:  # the output is complete: nothing but EOS could follow
        _finish_text(seq)
        seq.finish_reason = "stop"
        return
    if len(seq.output_ids) >= seq.max_tokens:
        _finish_text(seq)
        seq.finish_reason = "length"


def _advance_grammar(seq: Sequence, token: int) -> bool:
    """Advance the sequence's grammar by ``token``; True once the grammar cannot go on (it is
    complete, or ended with EOS). The sampler masks the tokens a grammar refuses, so a refused
    token means a bug: it is logged and ends the sequence rather than emitting invalid output."""
    matcher = seq.matcher
    if not matcher.consume_token(token):
        logger.error("structured output refused token %d of sequence %d: %s", token, seq.seq_id, matcher.get_error())
        return True
    return matcher.is_stopped()


def _finish_text(seq: Sequence) -> None:
    if seq.detokenizer is not None:
        tail = seq.detokenizer.finish()
        seq.text = seq.detokenizer.text
        if tail:
            _apply_stop_strings(seq, len(tail), len(seq.output_ids) >= seq.params.min_tokens)


def _apply_stop_strings(seq: Sequence, delta_len: int, active: bool) -> bool:
    """Update ``seq.text``; on a stop string, cut the text there and finish. Returns True if stopped."""
    full = seq.detokenizer.text
    stops = seq.params.stop
    if active and stops:
        longest = max(map(len, stops))
        start = max(0, len(full) - delta_len - longest + 1)
        hits = [(full.find(s, start), s) for s in stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            index, stop = min(hits)
            seq.text = full[: index + (len(stop) if seq.params.include_stop_str_in_output else 0)]
            seq.finish_reason, seq.stop_reason = "stop", stop
            return True
    seq.text = full
    return False


def _streamable_text(seq: Sequence) -> str:
    """Text that can be shown now: all of it once finished, else minus a possible stop prefix."""
    if seq.finished or not seq.params.stop:
        return seq.text
    hold = max(map(len, seq.params.stop)) - 1
    return seq.text[: max(seq.emitted, len(seq.text) - hold)]


def completion_output(seq: Sequence) -> CompletionOutput:
    """The cumulative output of ``seq``, with the deltas since the previous call."""
    visible = _streamable_text(seq)
    out = CompletionOutput(
        index=seq.index,
        text=visible,
        token_ids=list(seq.output_ids),
        cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        text_delta=visible[seq.emitted :],
        token_ids_delta=seq.output_ids[seq.emitted_tokens :],
        hidden_states=seq.hidden.result if seq.hidden is not None else None,
    )
    seq.emitted, seq.emitted_tokens = len(visible), len(seq.output_ids)
    return out


def request_output(state: RequestState, final: bool) -> RequestOutput:
    """A ``RequestOutput`` for a request's current state."""
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_ids,
        outputs=[completion_output(seq) for seq in state.seqs],
        finished=final,
        num_cached_tokens=state.seqs[0].num_cached_tokens,
        arrival_time=state.arrival_time,
        first_scheduled_time=state.seqs[0].first_scheduled_time,
        embedding=state.seqs[0].embedding.vector if state.seqs[0].embedding is not None else None,
    )
