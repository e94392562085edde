"""Per-sequence state: tokens, KV blocks, progress, and the text/stop bookkeeping of its output.

A request with ``n > 1`` becomes ``n`` sequences; the first computes the prompt and the
others fork from it, sharing its prompt blocks.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import Any

from model import IncrementalDetokenizer, Tokenizer
from workers.embedding import EmbeddingState
from workers.hidden_states import HiddenStateCapture
from workers.outputs import TokenLogprobs
from workers.sampling_params import SamplingParams

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to recompute
    RUNNING = "running"
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
    block_hashes: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    num_committed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at its first admission
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float = 0.0
    forks: list["Sequence"] = dataclasses.field(default_factory=list)  # children waiting on our prompt
    num_preemptions: int = 0
    # Known tokens before the last one whose K/V a draft model has not computed yet (0 or 1:
    # after a speculative step that accepted every guess; see workers/speculative.py).
    draft_lag: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Output text: ``text`` is everything decoded so far (stop string cut away), of which
    # ``emitted`` characters have been streamed; the rest is held back while it could still
    # turn out to start a stop string.
    detokenizer: IncrementalDetokenizer | None = None
    text: str = ""
    emitted: int = 0
    emitted_tokens: int = 0
    # Structured output: this sequence's grammar state (an llguidance matcher), advanced by
    # every sampled token; None when the output is free.
    matcher: Any = None
    # Embedding requests: the pooling of the prompt's hidden states (no tokens are sampled).
    embedding: EmbeddingState | None = None
    # Hidden-state extraction: the layers asked for, the device slot, and the result.
    hidden: HiddenStateCapture | None = None

    @classmethod
    def create(
        cls, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams, seed: int,
        max_tokens: int, priority: int, tokenizer: Tokenizer | None,
    ) -> "Sequence":
        seq = cls(request_id, index, prompt_ids, params, seed, max_tokens, priority)
        if tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        if params.logprobs is not None:
            seq.logprobs = []
        return seq

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
