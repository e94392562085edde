"""Per-sequence state: tokens, KV blocks, progress, and the text/stop bookkeeping of its output.

A request with ``n > 1`` becomes ``n`` sequences; the first computes the prompt and the
others fork from it, sharing its prompt blocks. Only the scheduler changes a sequence after
it is created (the block manager under its calls, and ``append_token`` here), when it applies
a step's results (``Scheduler.update_from_output``); tests/workers/test_sequence_writers.py
holds every other module to that.

Stop strings are matched on the decoded text; the text kept never contains them (unless
asked).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any

from raylm.model.text.detokenizer import IncrementalDetokenizer
from raylm.model.text.tokenizer import Tokenizer
from raylm.workers.core.embedding import EmbeddingState
from raylm.workers.core.hidden_states import HiddenStateCapture
from raylm.workers.core.lora_adapters import LoRARequest
from raylm.workers.core.request_output import TokenLogprobs
from raylm.workers.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from raylm.workers.runner.sampler import SampleResult

logger = logging.getLogger(__name__)

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    RUNNING = "running"
    LOADING = "loading"  # holds blocks an offload tier is filling (workers/core/scheduler.py)
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One stream of tokens being generated."""

    request_id: str
    index: int  # which of the request's n completions
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int  # resolved against the context length
    priority: int = 0
    arrival_time: float = dataclasses.field(default_factory=time.monotonic)
    seq_id: int = dataclasses.field(default_factory=lambda: next(_seq_ids))
    output_ids: list[int] = dataclasses.field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_ids: list[int] = dataclasses.field(default_factory=list)
    # The sliding layers' own block table, for a model that interleaves them with full-attention
    # layers (cache/block_tables.py); empty otherwise.
    sliding_block_ids: list[int] = dataclasses.field(default_factory=list)
    block_hashes: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_committed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens it did not compute at its first admission: cached or loaded
    kv_load_fell_short: bool = False  # an offload tier failed to bring blocks it listed: compute, never reload
    kv_queried: bool = False  # its prompt's lookup in the offload tiers was counted
    kv_load_capped: bool = False  # its last load stopped where the pool ran out of free blocks: the tier holds more
    prefix_counted: bool = False  # its first admission's prefix-cache lookup was counted
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    forks: list["Sequence"] = dataclasses.field(default_factory=list)  # children waiting on our prompt
    num_preemptions: int = 0
    # Known tokens before the last one whose K/V a draft model has not computed yet (0 or 1:
    # after a speculative step that accepted every guess; see workers/runner/speculative_step.py).
    draft_lag: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Output text: everything decoded so far (a stop string cut away). What of it has been
    # streamed is the request's business (``RequestState.cursors``).
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    # Structured output: this sequence's grammar state (an llguidance matcher), advanced by
    # every sampled token; None when the output is free.
    matcher: Any = None
    # Embedding requests: the pooling of the prompt's hidden states (no tokens are sampled).
    embedding: EmbeddingState | None = None
    # Hidden-state extraction: the layers asked for, the device slot, and the result.
    hidden: HiddenStateCapture | None = None
    # LoRA: the adapter it is generated with (None: the base model), and the device slot it
    # holds while running (0: none; workers/core/lora_adapters.py).
    lora: LoRARequest | None = None
    lora_slot: int = 0

    @classmethod
    def create(
        cls, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams, seed: int,
        max_tokens: int, priority: int, tokenizer: Tokenizer | None, matcher: Any = None,
        embedding: EmbeddingState | None = None, hidden: HiddenStateCapture | None = None,
        lora: LoRARequest | None = None,
    ) -> "Sequence":
        detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens) if tokenizer is not None else None
        return cls(
            request_id, index, prompt_ids, params, seed, max_tokens, priority, detokenizer=detokenizer,
            logprobs=[] if params.logprobs is not None else None,
            matcher=matcher, embedding=embedding, hidden=hidden, lora=lora,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens whose K/V is not in the cache yet; the step computing the last one samples."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than one token to compute (a prompt, or a recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def runs_as_chunk(self) -> bool:
        """Its next tokens are computed as a prompt chunk, not decoded: a prompt (or recompute)
        of more than one token, or any part of an embedding request's prompt (it samples nothing)."""
        return self.is_prefilling or self.embedding is not None

    @property
    def host_before_each_token(self) -> bool:
        """Its next token needs the host first (a grammar's mask, logits processors)."""
        return self.matcher is not None or bool(self.params.logits_processors)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def order_key(self, by_priority: bool) -> tuple:
        """Scheduling order: lower priority value first, then earlier arrival."""
        return (self.priority if by_priority else 0, self.arrival_time, self.seq_id)

    # -- a sampled token (the scheduler's call) -----------------------------------------------------
    def append_token(self, result: SampleResult, eos_ids: frozenset[int]) -> None:
        """Add one sampled token and decide whether the sequence finished."""
        token = int(result.tokens)
        params = self.params
        self.output_ids.append(token)
        if self.logprobs is not None:
            entry = {int(i): float(lp) for i, lp in zip(result.top_ids[: params.logprobs], result.top_logprobs)}
            entry[token] = float(result.logprobs)
            self.logprobs.append(entry)
            self.cumulative_logprob += float(result.logprobs)
        grammar_done = self.matcher is not None and self._advance_grammar(token)
        past_min = len(self.output_ids) >= params.min_tokens
        if past_min and not params.ignore_eos and token in eos_ids:
            self._finish_text()
            self.finish_reason = "stop"
            return
        if past_min and token in params.stop_token_ids:
            self._finish_text()
            self.finish_reason, self.stop_reason = "stop", token
            return
        if self.detokenizer is not None:
            delta = self.detokenizer.add([token])
            if self._apply_stop_strings(len(delta), past_min):
                return
        if grammar_done:  # the output is complete: nothing but EOS could follow
            self._finish_text()
            self.finish_reason = "stop"
            return
        if len(self.output_ids) >= self.max_tokens:
            self._finish_text()
            self.finish_reason = "length"

    def _advance_grammar(self, token: int) -> bool:
        """Advance the grammar by ``token``; True once it cannot go on (it is complete, or ended
        with EOS). The sampler masks the tokens a grammar refuses, so a refused token means a
        bug: it is logged and ends the sequence rather than emitting invalid output."""
        matcher = self.matcher
        if not matcher.consume_token(token):
            logger.error("structured output refused token %d of sequence %d: %s", token, self.seq_id,
                         matcher.get_error())
            return True
        return matcher.is_stopped()

    def _finish_text(self) -> None:
        if self.detokenizer is not None:
            tail = self.detokenizer.finish()
            self.text = self.detokenizer.text
            if tail:
                self._apply_stop_strings(len(tail), len(self.output_ids) >= self.params.min_tokens)

    def _apply_stop_strings(self, delta_len: int, active: bool) -> bool:
        """Update ``text``; on a stop string, cut the text there and finish. Returns True if stopped."""
        full = self.detokenizer.text
        stops = self.params.stop
        if active and stops:
            longest = max(map(len, stops))
            start = max(0, len(full) - delta_len - longest + 1)
            hits = [(full.find(s, start), s) for s in stops]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, stop = min(hits)
                self.text = full[: index + (len(stop) if self.params.include_stop_str_in_output else 0)]
                self.finish_reason, self.stop_reason = "stop", stop
                return True
        self.text = full
        return False
