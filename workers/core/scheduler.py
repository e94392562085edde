"""Continuous batching: each step, decide which tokens of which sequences the model computes.

Running sequences go first, in policy order (FCFS: by arrival; priority: by priority, then
arrival), each with a decode token or its next prompt chunk; then waiting ones are admitted
while sequence slots, the token budget and KV blocks allow. (Under FCFS a running prompt
arrived after every decoding sequence, so decodes come first; under the priority policy a
more urgent prompt's chunk goes before less urgent decodes and may take the budget.) Long prompts
are split into chunks so they never stall the decodes (chunked prefill). When blocks run
out, the lowest-priority, latest-arrived running sequence is preempted: its blocks are
freed and it later recomputes everything it had (its full blocks are likely still in the
prefix cache).

With KV offload, a sequence whose prompt blocks an offload tier holds beyond the pool first
loads them while others step (workers/core/kv_loads.py; ``SchedulerOutput.kv_writes``).

The scheduler owns sequence state: ``schedule`` plans a step as plain data (a
``SchedulerOutput``: no sequence reaches the runner) and ``update_from_output`` applies the
runner's ``RunnerOutput`` (computed tokens, sampled tokens, pooled embeddings, draft state,
forks, prefix-cache commits, removal of finished sequences). It is the only writer of a
sequence after its creation, so the engine only moves plans and outputs between it and the
model runner.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Collection, Iterable

from raylm.cache.block_tables import BlockManager, PrefixLookup
from raylm.cache.offload.connector import KVConnector
from raylm.workers.core.hidden_states import HiddenStateSlots
from raylm.workers.core.kv_loads import COMPUTE, LOADING, KVLoads
from raylm.workers.core.lora_adapters import LoraSlots
from raylm.workers.core.plan_rows import reuses_cached_prefix, scheduled_chunk, scheduled_decode
from raylm.workers.core.sequence import Sequence, SequenceStatus
from raylm.workers.core.speculation import SpecDecodeStats
from raylm.workers.core.step_plan import ScheduledChunk, ScheduledDecode, SchedulerOutput
from raylm.workers.core.step_result import RunnerOutput
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.runner.sampler import SampleResult


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's part of ``EngineArgs``, whose defaults it takes (they are declared there)."""

    max_num_seqs: int = EngineArgs.max_num_seqs
    max_num_batched_tokens: int = EngineArgs.max_num_batched_tokens
    enable_chunked_prefill: bool = EngineArgs.enable_chunked_prefill
    policy: str = EngineArgs.scheduling_policy  # "fcfs" or "priority"
    num_scheduler_steps: int = EngineArgs.num_scheduler_steps  # decode steps per engine step without prompts
    num_speculative_tokens: int = 0  # guesses per decoding sequence and step (speculative decoding)
    speculative_disable_by_batch_size: int | None = None  # more decoding sequences: no guesses

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> SchedulerConfig:
        spec = args.speculative
        return cls(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_chunked_prefill=args.enable_chunked_prefill,
            policy=args.scheduling_policy,
            num_scheduler_steps=args.num_scheduler_steps,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            speculative_disable_by_batch_size=spec.disable_by_batch_size if spec else None,
        )

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.num_scheduler_steps < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and num_scheduler_steps must be >= 1")


class Scheduler:
    """Owns the waiting and running queues and every sequence's progress; the engine feeds it
    sequences and each step's samples."""

    def __init__(self, config: SchedulerConfig, blocks: BlockManager, eos_ids: frozenset[int] = frozenset(),
                 hidden_slots: HiddenStateSlots | None = None, lora_slots: LoraSlots | None = None):
        self.config = config
        self.blocks = blocks
        self.eos_ids = eos_ids
        self.hidden_slots = hidden_slots or HiddenStateSlots(0)
        self.lora_slots = lora_slots  # None: LoRA is off (no sequence has an adapter)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._held_slots, self._row_cap = 0, None  # during a ``schedule`` with sequences held out
        self.loads: KVLoads | None = None  # sequences loading blocks from KV offload tiers; None: offload is off
        self.num_preemptions = 0
        self.num_prompt_tokens = 0  # prompt (and recomputed) tokens computed, lifetime
        self.num_generated_tokens = 0  # tokens sampled, lifetime
        self.spec_stats = SpecDecodeStats()  # speculative guesses scored and accepted, lifetime
        # Tokens a prompt chunk may hold (None: the budget alone decides). A served engine sets it
        # while its larger prompt programs are still to compile, so a long prompt runs in the
        # chunks already compiled rather than waiting for a compile (workers/engine/llm_engine.py).
        self.chunk_cap: int | None = None
        self.chunk_capped = False  # the last ``schedule`` shortened a chunk to ``chunk_cap``

    @property
    def _by_priority(self) -> bool:
        return self.config.policy == "priority"

    def add(self, seq: Sequence, forks: Iterable[Sequence] = ()) -> None:
        """Queue ``seq``; ``forks`` (a request's other n - 1 sequences) join after its first token."""
        seq.status = SequenceStatus.WAITING
        seq.forks = list(forks)
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """End ``seq`` now (``finish_reason`` "abort") and free its blocks."""
        seq.finish_reason = "abort"
        self.remove(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq.status == SequenceStatus.LOADING:
            self.loads.cancel(seq)
        self.blocks.free(seq)
        self._release_lora(seq)
        if seq.hidden is not None:
            self.hidden_slots.release(seq.hidden)
        seq.status = SequenceStatus.FINISHED

    def _preempt(self, victim: Sequence, preempted: list[Sequence]) -> None:
        """Evict ``victim`` to the waiting queue (noted in ``preempted``: not re-admitted this step)."""
        self.running.remove(victim)
        self.blocks.free(victim)
        self._release_lora(victim)
        victim.status = SequenceStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(victim)
        preempted.append(victim)

    def _victim(self) -> Sequence:
        return max(self.running, key=lambda s: s.order_key(self._by_priority))

    def _make_room_for_higher_priority(self, preempted: list[Sequence]) -> None:
        """Priority policy: evict running sequences of lower priority that block a waiting one.

        The waiting sequence needs a slot and the blocks of its first chunk; prefix-cache hits
        are not counted, so this errs towards evicting (the victim's full blocks stay cached).
        """
        if not self.waiting or not self.running:
            return
        best = min(self.waiting, key=lambda s: s.order_key(True))
        chunk, _ = self._chunk_tokens(best, self.config.max_num_batched_tokens)
        while self.running:
            victim = self._victim()
            if victim.priority <= best.priority:
                return
            short_of_slots = len(self.running) >= self._slots()
            if not short_of_slots and self.blocks.can_grow(best, chunk):
                return
            self._preempt(victim, preempted)

    def _chunk_tokens(self, seq: Sequence, budget: int) -> tuple[int, bool]:
        """How many of ``seq``'s uncomputed tokens a chunk takes within ``budget`` and the chunk
        cap, and whether the cap shortened it."""
        want = min(seq.num_uncomputed_tokens, budget)
        if self.chunk_cap is not None and want > self.chunk_cap:
            return self.chunk_cap, True
        return want, False

    def _may_compute(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether ``num_tokens`` of ``seq``'s uncomputed tokens may be computed this step.
        Without chunked prefill a prompt is computed whole; a preempted sequence's recompute
        (prompt and outputs, which may exceed any step's budget) is chunked all the same, or
        it could never run again and would block the queue behind it."""
        return (
            self.config.enable_chunked_prefill or num_tokens == seq.num_uncomputed_tokens or seq.num_preemptions > 0
        )

    def _count_first_admission(self, seq: Sequence, lookup: PrefixLookup | None) -> None:
        """Record the prefix hit of a sequence's first admission, once: in the pool's hit stats
        (failed admission attempts before it and re-admissions after a preemption do not
        count) and as its ``num_cached_tokens``, which then counts prompt tokens only (the
        lookup covered the prompt minus its last token). The pool counts tokens, as vLLM's
        prefix-cache counters do: every prompt token is looked up, so a prompt shorter than a
        block counts too. (A sequence loading from an offload tier is counted as its load starts; its
        ``num_cached_tokens`` becomes what it holds at admission: pool hits and loaded blocks.)"""
        if lookup is not None and not seq.prefix_counted:
            seq.prefix_counted = True
            seq.num_cached_tokens = lookup.hit_blocks * self.blocks.block_size
            self.blocks.pool.record_prefix_lookup(seq.num_tokens, seq.num_cached_tokens)
        if seq.kv_queried:  # what it holds uncomputed, each block once however often it was loaded
            seq.num_cached_tokens = seq.num_computed_tokens

    def schedule(self, in_flight: Collection[int] = (), max_rows: int | None = None) -> SchedulerOutput:
        """Plan a step. A pipeline keeps several plans in flight (workers/pipeline/micro_batches.py):
        their sequences (``in_flight``, by id) keep their slots and blocks but are neither
        scheduled nor preempted by this plan, and ``max_rows`` caps the sequences it takes (running
        ones first, in policy order; the rest wait for the next plan), so plans come out even."""
        if not in_flight and max_rows is None:
            return self._schedule()
        self.running.sort(key=lambda s: s.order_key(self._by_priority))
        free = [s for s in self.running if s.seq_id not in in_flight]
        visible = free[:max_rows] if max_rows is not None else free
        held = [s for s in self.running if s not in visible]
        self.running, self._held_slots, self._row_cap = visible, len(held), max_rows
        try:
            return self._schedule()
        finally:
            self.running, self._held_slots, self._row_cap = self.running + held, 0, None

    def _slots(self) -> int:
        """Sequence slots this plan may fill: ``max_num_seqs`` less those of sequences held out
        of it (``schedule``), at most its row cap."""
        slots = self.config.max_num_seqs - self._held_slots
        return slots if self._row_cap is None else min(slots, self._row_cap)

    def _schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        self.chunk_capped = False
        prefills: list[ScheduledChunk] = []
        decodes: list[ScheduledDecode] = []
        preempted: list[Sequence] = []
        kv_writes, sliding_kv_writes = self._finish_loads()
        if self._by_priority:
            self._make_room_for_higher_priority(preempted)
        any_prefill = any(s.runs_as_chunk for s in self.running) or self._may_admit()
        # Structured output and logits processors need the host before each token: one step at a time.
        constrained = any(s.host_before_each_token for s in self.running)
        steps = 1 if any_prefill or constrained else self._decode_steps()
        lookahead = self._lookahead()

        # 1. Running sequences, most important first; preempt from the back when blocks run out.
        self.running.sort(key=lambda s: s.order_key(self._by_priority))
        for seq in list(self.running):
            if seq not in self.running or budget <= 0:
                continue
            capped = False
            if seq.runs_as_chunk:
                want, capped = self._chunk_tokens(seq, budget)
                if not self._may_compute(seq, want):
                    continue
            elif lookahead:  # a structured output row's guesses are checked against its grammar
                want = min(1 + lookahead, seq.max_tokens - len(seq.output_ids))
                if not self.blocks.can_grow(seq, want) and self.blocks.can_grow(seq, 1):
                    want = 1  # guesses only where blocks are free: never preempt a sequence for them
            else:
                want = min(steps, seq.max_tokens - len(seq.output_ids)) if steps > 1 else 1
            while not self.blocks.can_grow(seq, want):
                victim = self._victim()
                self._preempt(victim, preempted)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            self.blocks.grow(seq, want)
            if seq.runs_as_chunk:
                prefills.append(scheduled_chunk(seq, want))
                self.chunk_capped |= capped
                budget -= want
            else:
                decodes.append(scheduled_decode(seq, want - 1 if lookahead and want > 1 else 0))
                budget -= 1

        # 2. Admit waiting sequences in policy order while slots, budget and blocks allow.
        self.waiting.sort(key=lambda s: s.order_key(self._by_priority))
        admitted: list[Sequence] = []
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) + len(admitted) + self.num_loading >= self._slots():
                break
            if seq in preempted:
                break  # do not re-admit what this step just evicted
            if seq.hidden is not None and not self.hidden_slots.acquire(seq.hidden):
                continue  # waits for a hidden-state buffer; others go ahead
            if not self._acquire_lora(seq):
                continue  # waits for a slot for its adapter; others go ahead
            lookup = self.blocks.reuse_cached_prefix(seq) if reuses_cached_prefix(seq) else None
            if lookup is None and self.loads is not None:
                lookup = self.loads.resumed_lookup(seq)
            load = self.loads.start(seq, lookup) if lookup is not None and self.loads is not None else COMPUTE
            if load != COMPUTE:  # waits for its blocks (or for another's load of them); others go ahead
                self._wait_for_load(seq, lookup, started=load == LOADING)
                continue
            self._release_out_of_window(seq)  # cached blocks before its window: not needed
            want, capped = self._chunk_tokens(seq, budget)
            if not self._may_compute(seq, want) or not self.blocks.can_grow(seq, want):
                self.blocks.free(seq)
                self._release_lora(seq)
                break
            self.blocks.grow(seq, want)
            if seq.num_preemptions == 0:
                self._count_first_admission(seq, lookup)
            admitted.append(seq)
            self.chunk_capped |= capped
            budget -= want
            if want > 1 or seq.runs_as_chunk:
                prefills.append(scheduled_chunk(seq, want))
            else:
                decodes.append(scheduled_decode(seq, 0))
        for seq in admitted:
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        for seq in self.waiting:  # loaded, not admitted: its blocks stay cached for its admission, but free,
            if seq.block_ids:     # or waiting sequences could hold every block while none can start
                self.blocks.free(seq)

        if prefills:
            steps = 1
        loads = self.lora_slots.take_loads() if self.lora_slots is not None else []
        return SchedulerOutput(prefills, decodes, steps, self.blocks.take_copies(), loads,
                               self.blocks.take_copies(1), kv_writes, sliding_kv_writes)

    def use_kv_offload(self, connector: KVConnector) -> None:  # sequences then load what the tiers hold
        self.loads = KVLoads(connector, self.blocks)

    @property
    def num_loading(self) -> int:
        """Sequences waiting for blocks from KV offload tiers (they hold sequence slots)."""
        return len(self.loads) if self.loads is not None else 0

    def _wait_for_load(self, seq: Sequence, lookup: PrefixLookup, started: bool) -> None:
        """``seq`` loads blocks (``started``: its pool hits count as its first admission's) or waits
        for another's load of them (its blocks go back; it finds them cached); its adapter slot waits."""
        if not started:
            self.blocks.free(seq)
        else:
            self.waiting.remove(seq)
            if seq.num_preemptions == 0:
                self._count_first_admission(seq, lookup)
        self._release_lora(seq)

    def _finish_loads(self) -> tuple[list[tuple[int, object]], list[tuple[int, object]]]:
        """Sequences whose loads ended rejoin the waiting queue; returns the step's block writes
        (the full group's, the sliding group's)."""
        if self.loads is None:
            return [], []
        ready, writes, sliding_writes = self.loads.finish()
        self.waiting += ready
        return writes, sliding_writes

    def _acquire_lora(self, seq: Sequence) -> bool:
        """Give ``seq`` its adapter's device slot (loaded with this step if it is not resident);
        False when every slot is held by other adapters' running sequences."""
        if seq.lora is None:
            return True
        assert self.lora_slots is not None, "a sequence with a LoRA adapter on a replica without LoRA"
        slot = self.lora_slots.acquire(seq.lora)
        if slot is None:
            return False
        seq.lora_slot = slot
        return True

    def _release_lora(self, seq: Sequence) -> None:
        if seq.lora_slot:
            self.lora_slots.release(seq.lora_slot)
            seq.lora_slot = 0

    def _may_admit(self) -> bool:
        """Whether a waiting sequence may start this step: one is waiting and a slot is free
        (whether its blocks fit is left to the admission itself)."""
        return bool(self.waiting) and len(self.running) + self.num_loading < self._slots()

    def _decode_steps(self) -> int:
        """Decode steps for a step without prompts: ``num_scheduler_steps``, or one while
        sequences wait for a slot and a running sequence has fewer tokens left than that, so
        the sequence finishing at its length frees its slot for them at the end of a call, not
        steps after it (one that stops early, at EOS or a stop string, still idles its row
        until the call ends). Only 1 and ``num_scheduler_steps`` are compiled step counts."""
        steps = self.config.num_scheduler_steps
        if self.waiting and any(seq.max_tokens - len(seq.output_ids) < steps for seq in self.running):
            return 1
        return steps

    def _lookahead(self) -> int:
        """Guesses per decoding sequence this step: none above the batch size where verifying
        k + 1 tokens per row costs more than it saves (vLLM's ``disable_by_batch_size``)."""
        k, limit = self.config.num_speculative_tokens, self.config.speculative_disable_by_batch_size
        if k and limit is not None and sum(not s.is_prefilling for s in self.running) > limit:
            return 0
        return k

    # -- applying a step's results ------------------------------------------------------------------
    def update_from_output(self, plan: SchedulerOutput, output: RunnerOutput, scheduled_at: float) -> list[Sequence]:
        """Apply the results of ``plan``'s step: computed tokens advance, embedding chunks fold
        in their pooled hidden states, the draft model's lag and the speculative counters are
        updated, sampled tokens are appended (stop conditions checked), a request's n > 1
        forks start after its first token, computed full blocks enter the prefix cache and
        finished sequences leave (their blocks freed). Returns the sequences that made progress."""
        by_id = {seq.seq_id: seq for seq in self.running}
        progressed = []
        for chunk in plan.prefills:
            if (seq := by_id.get(chunk.row.seq_id)) is None:
                continue  # aborted while its pipeline micro-batch was in flight
            seq.num_computed_tokens += chunk.num_tokens
            self.num_prompt_tokens += chunk.num_tokens
            seq.first_scheduled_time = seq.first_scheduled_time or scheduled_at
            pooled = output.pooled.get(seq.seq_id)
            if pooled is not None:
                seq.embedding.add_chunk(chunk.start, chunk.num_tokens, pooled.sums, pooled.last, chunk.samples)
            if seq.embedding is not None and chunk.samples:  # its prompt is pooled: done, nothing sampled
                seq.finish_reason = "stop"
            self._advance(seq, output)
            progressed.append(seq)
        for decode in plan.decodes:
            if (seq := by_id.get(decode.row.seq_id)) is None:
                continue
            seq.num_computed_tokens += 1  # the fed-back last token; further steps count below
            seq.first_scheduled_time = seq.first_scheduled_time or scheduled_at
            self._advance(seq, output)  # no samples: its logits processor failed
            progressed.append(seq)
        for scored, accepted in output.accepted.values():
            self.spec_stats.record(scored, accepted)
        return progressed

    def _advance(self, seq: Sequence, output: RunnerOutput) -> None:
        seq.draft_lag = output.draft_lags.get(seq.seq_id, seq.draft_lag)
        self._append_samples(seq, output.samples.get(seq.seq_id, ()))

    def _append_samples(self, seq: Sequence, results: Iterable[SampleResult]) -> None:
        """Apply sampled tokens (all but the first feed back one computed token each)."""
        for i, result in enumerate(results):
            if i > 0:
                seq.num_computed_tokens += 1
            seq.append_token(result, self.eos_ids)
            self.num_generated_tokens += 1
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
            if seq.forks:
                for child in seq.forks:
                    self.blocks.fork(seq, child)
                    self.add(child)
                seq.forks = []
            if seq.finished:
                break
        # Finished or not, its computed full blocks become prefix-cache entries: a request that
        # ends at its first token (max_tokens=1) leaves its prompt cached for the next one too.
        self.blocks.commit_computed_blocks(seq)
        if seq.finished:
            self.remove(seq)
        else:  # committed first: released blocks stay in the prefix cache
            self._release_out_of_window(seq)

    def _release_out_of_window(self, seq: Sequence) -> None:
        """Sliding-window attention: return the blocks ``seq``'s next step cannot read. It
        computes from its first uncomputed token on (a draft model that lags the target by
        ``draft_lag`` tokens recomputes those first)."""
        self.blocks.release_out_of_window(seq, seq.num_computed_tokens - seq.draft_lag)

