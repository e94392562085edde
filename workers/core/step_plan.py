"""A step's plan as plain data: what the runner computes, with no ``Sequence`` in it.

``Scheduler.schedule`` copies out of each sequence what the step needs when it plans the
step (token spans, the block-table row, sampling parameters, speculative guesses, the
grammar to mask with, the hidden-state slot), so the runner reads the plan and never a
sequence, and sequences change only in ``Scheduler.update_from_output`` (vLLM v1's
``SchedulerOutput``).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from typing import Sequence as SequenceOf

from raylm.model.loaders.lora_adapter import LoraAdapter
from raylm.workers.core.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class ScheduledRow:
    """One sequence's part in a step, as the runner needs it."""

    seq_id: int
    request_id: str  # named in the log when its logits processor fails
    block_ids: tuple[int, ...]  # its block-table row
    params: SamplingParams
    seed: int
    # The sequence's token lists (penalties, logits processors and n-gram guesses read them).
    # Not copied: the runner reads them during the step, before any token is appended.
    prompt_ids: SequenceOf[int]
    output_ids: SequenceOf[int]
    # Structured output's grammar state (an llguidance matcher): the runner fills masks from
    # it and checks guesses against it, and leaves it as it was. None: free output.
    matcher: Any = None
    hidden_slot: int | None = None  # hidden-state capture: its buffers' slot ...
    hidden_start: int = 0  # ... and the first position captured there
    lora_slot: int = 0  # its LoRA adapter's device slot (0: the base model)
    sliding_block_ids: tuple[int, ...] = ()  # the sliding layers' row, when they keep a KV group

    @property
    def host_before_each_token(self) -> bool:
        """Its next token needs the host first (a grammar's mask, logits processors)."""
        return self.matcher is not None or bool(self.params.logits_processors)


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """Prompt tokens ``[start, start + num_tokens)`` of a sequence to compute this step."""

    row: ScheduledRow
    start: int
    token_ids: tuple[int, ...]
    samples: bool  # the chunk reaches the last known token, so its logits give the next token
    pools: bool = False  # an embedding request's: its hidden states are pooled, nothing is sampled

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass(frozen=True)
class ScheduledDecode:
    """A decoding sequence: its last known token (at ``position``) is fed back."""

    row: ScheduledRow
    position: int  # of the last known token
    # The known tokens a draft model has not computed yet, the last known token last (1 token,
    # or 2 after a speculative step accepted every guess: see workers/runner/speculative_step.py).
    window: tuple[int, ...]
    guesses: int = 0  # speculative guesses it may carry this step (its blocks were grown for them)


@dataclasses.dataclass(frozen=True)
class SchedulerOutput:
    prefills: list[ScheduledChunk]
    decodes: list[ScheduledDecode]
    num_decode_steps: int
    block_copies: list[tuple[int, int]]  # (src, dst) device copies before the step (copy-on-write)
    # (slot, adapter) LoRA slots to fill before the step (workers/core/lora_adapters.py)
    lora_loads: list[tuple[int, LoraAdapter]] = dataclasses.field(default_factory=list)
    sliding_block_copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # the sliding group's
    # (block id, payload) blocks loaded from KV offload tiers, which the engine writes into the
    # pool before the step computes, even a step with nothing else to do (cache/offload/block_layout.py)
    kv_writes: list[tuple[int, Any]] = dataclasses.field(default_factory=list)
    sliding_kv_writes: list[tuple[int, Any]] = dataclasses.field(default_factory=list)  # the sliding group's

    @property
    def empty(self) -> bool:
        """Nothing for the device to do (an adapter load left by an admission that then failed
        still has to happen: the slots' bookkeeping already counts it resident)."""
        return not self.prefills and not self.decodes and not self.lora_loads

    @property
    def guesses(self) -> dict[int, int]:
        """Guesses per decoding sequence (by seq_id) that carries any."""
        return {d.row.seq_id: d.guesses for d in self.decodes if d.guesses}

    @property
    def num_tokens(self) -> int:
        """Positions the step computes: prompt chunks, decode steps and the guesses a verify scores."""
        return (sum(c.num_tokens for c in self.prefills) + len(self.decodes) * self.num_decode_steps
                + sum(d.guesses for d in self.decodes))
