"""workers/core/scheduler.py without a model: which tokens of which sequences each step computes.

A real ``BlockPool`` and ``BlockManager`` with small numbers (4-token blocks, a handful of them)
and real ``Sequence`` objects; ``_apply`` feeds each step's samples back through
``Scheduler.update_from_output`` as the engine does, so several steps can be planned in a row. Preemption is
observed through the queues and the sequences' state.
"""

from __future__ import annotations

import itertools

import pytest

from raylm.cache.block_pool import BlockPool
from raylm.cache.block_tables import BlockManager
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from raylm.workers.core.sequence import Sequence, SequenceStatus
from raylm.workers.core.step_result import RunnerOutput
from raylm.workers.runner.sampler import SampleResult

BLOCK_SIZE = 4
TOKEN = 7  # every sampled token (only how many there are matters here)
SAMPLE = SampleResult(TOKEN, 0.0, [], [])
_arrival = itertools.count()
_prompt_base = itertools.count(1000, 1000)
_made: dict[int, Sequence] = {}  # every sequence a test made, by id (plans name sequences by id)


def _scheduler(usable_blocks: int = 32, prefix_caching: bool = True, **config) -> Scheduler:
    pool = BlockPool(usable_blocks + 1, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    return Scheduler(SchedulerConfig(**config), BlockManager(pool))


def _seq(prompt: int | list[int], max_tokens: int = 32, priority: int = 0) -> Sequence:
    """A sequence as ``LLMEngine.add_request`` makes it (no tokenizer needed). An int prompt is
    that many tokens no other sequence shares; arrivals are strictly ordered by creation."""
    if isinstance(prompt, int):
        base = next(_prompt_base)
        prompt = list(range(base, base + prompt))
    arrival = next(_arrival)
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    seq = Sequence.create(f"r{arrival}", 0, prompt, params, 0, max_tokens, priority, None)
    seq.arrival_time = float(arrival)
    _made[seq.seq_id] = seq
    return seq


def _add(scheduler: Scheduler, *seqs: Sequence) -> None:
    for seq in seqs:
        scheduler.add(seq)


def _chunks(plan: SchedulerOutput) -> list[tuple[Sequence, int]]:
    return [(_made[chunk.row.seq_id], chunk.num_tokens) for chunk in plan.prefills]


def _decoded(plan: SchedulerOutput) -> list[Sequence]:
    return [_made[decode.row.seq_id] for decode in plan.decodes]


def _apply(scheduler: Scheduler, plan: SchedulerOutput) -> None:
    """Feed the step's results back as the engine does (``Scheduler.update_from_output``): a
    chunk reaching its sequence's last known token samples one token, a decode samples
    ``num_decode_steps``. Speculative guesses are all rejected here: a decode with guesses
    still yields one token."""
    samples = {chunk.row.seq_id: [SAMPLE] for chunk in plan.prefills if chunk.samples}
    samples.update({decode.row.seq_id: [SAMPLE] * plan.num_decode_steps for decode in plan.decodes})
    scheduler.update_from_output(plan, RunnerOutput(samples), scheduled_at=0.0)


def _step(scheduler: Scheduler) -> SchedulerOutput:
    plan = scheduler.schedule()
    _apply(scheduler, plan)
    return plan


# -- ordering and the token budget --------------------------------------------------------------------
def test_decodes_are_scheduled_before_prompt_chunks():
    """Under FCFS, the default. (The priority policy orders the running queue by priority: a
    higher-priority prompt's chunk goes before lower-priority decodes and may take the budget.)"""
    scheduler = _scheduler(max_num_batched_tokens=16)
    a = _seq(6)
    _add(scheduler, a)
    assert _chunks(_step(scheduler)) == [(a, 6)]

    b = _seq(40)
    _add(scheduler, b)
    plan = _step(scheduler)
    assert _decoded(plan) == [a]
    assert _chunks(plan) == [(b, 15)]  # the budget of 16 less a's decode token

    c = _seq(3)
    _add(scheduler, c)
    plan = _step(scheduler)
    assert _decoded(plan) == [a]  # b's remaining 25 tokens would fill the budget
    assert _chunks(plan) == [(b, 15)]  # the running prompt goes on before a new one starts
    assert scheduler.waiting == [c]

    plan = _step(scheduler)
    assert _decoded(plan) == [a]
    assert _chunks(plan) == [(b, 10), (c, 3)]
    assert _decoded(_step(scheduler)) == [a, b, c]


def test_chunked_prefill_splits_a_long_prompt_by_the_token_budget():
    scheduler = _scheduler(max_num_batched_tokens=16)
    seq = _seq(40)
    _add(scheduler, seq)
    chunks, blocks, outputs = [], [], []
    for _ in range(3):
        plan = _step(scheduler)
        assert _decoded(plan) == []
        chunks += [n for _, n in _chunks(plan)]
        blocks.append(len(seq.block_ids))
        outputs.append(len(seq.output_ids))
    assert chunks == [16, 16, 8]
    assert blocks == [4, 8, 10]  # blocks for the tokens computed so far, 4 per block
    assert outputs == [0, 0, 1]  # only the chunk reaching the prompt's end samples
    assert seq.num_computed_tokens == 40
    assert _decoded(_step(scheduler)) == [seq]


def test_without_chunked_prefill_a_prompt_is_computed_whole_or_waits():
    scheduler = _scheduler(usable_blocks=32, max_num_batched_tokens=16, enable_chunked_prefill=False)
    too_long = _seq(40)
    _add(scheduler, too_long)
    plan = scheduler.schedule()
    assert plan.empty
    assert scheduler.waiting == [too_long] and too_long.block_ids == []
    assert scheduler.blocks.pool.num_free_blocks == 32  # the refused admission holds nothing

    for chunked, expected in [(False, [12]), (True, [12, 4])]:
        scheduler = _scheduler(max_num_batched_tokens=16, enable_chunked_prefill=chunked)
        first, second = _seq(12), _seq(12)
        _add(scheduler, first, second)
        plan = scheduler.schedule()
        assert [n for _, n in _chunks(plan)] == expected, chunked
        assert (second in scheduler.waiting) is not chunked


def test_max_num_seqs_caps_admission():
    scheduler = _scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    s0, s1, s2 = _seq(3, max_tokens=2), _seq(3, max_tokens=2), _seq(3, max_tokens=2)
    _add(scheduler, s0, s1, s2)
    plan = _step(scheduler)
    assert _chunks(plan) == [(s0, 3), (s1, 3)]
    assert scheduler.waiting == [s2]

    plan = _step(scheduler)  # budget and blocks to spare, but no slot
    assert _decoded(plan) == [s0, s1] and plan.prefills == []
    assert scheduler.waiting == [s2]
    assert s0.finished and s1.finished and scheduler.running == []

    assert _chunks(_step(scheduler)) == [(s2, 3)]


# -- preemption ------------------------------------------------------------------------------------------
def test_when_blocks_run_out_the_latest_arrival_is_preempted_and_its_blocks_freed():
    scheduler = _scheduler(usable_blocks=4, prefix_caching=False)
    pool = scheduler.blocks.pool
    first, second = _seq(7, max_tokens=3), _seq(7, max_tokens=10)
    _add(scheduler, first, second)
    assert _chunks(_step(scheduler)) == [(first, 7), (second, 7)]
    assert pool.num_free_blocks == 0
    assert _decoded(_step(scheduler)) == [first, second]  # position 7 still fits each one's 2nd block

    plan = scheduler.schedule()  # position 8 needs a 3rd block each; none is free
    assert _decoded(plan) == [first] and plan.prefills == []
    assert second.status is SequenceStatus.WAITING
    assert scheduler.running == [first] and scheduler.waiting == [second]
    assert (second.block_ids, second.num_computed_tokens) == ([], 0)
    assert (second.num_preemptions, first.num_preemptions, scheduler.num_preemptions) == (1, 0, 1)
    assert len(first.block_ids) == 3
    assert pool.num_free_blocks == 1  # second's 2 blocks came back; first took 1 of them
    _apply(scheduler, plan)
    assert first.finished and pool.num_free_blocks == 4

    plan = _step(scheduler)
    assert _chunks(plan) == [(second, 9)]  # it recomputes its prompt and both outputs
    assert second.status is SequenceStatus.RUNNING and scheduler.num_preemptions == 1


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_victim_is_the_lowest_priority_then_the_latest_arrival(policy):
    scheduler = _scheduler(usable_blocks=4, prefix_caching=False, policy=policy)
    low, high = _seq(7, priority=1), _seq(7, priority=0)  # low arrived first
    _add(scheduler, low, high)
    _step(scheduler)
    _step(scheduler)
    plan = scheduler.schedule()
    victim, survivor = (high, low) if policy == "fcfs" else (low, high)
    assert _decoded(plan) == [survivor]
    assert scheduler.waiting == [victim] and victim.status is SequenceStatus.WAITING
    assert (victim.num_preemptions, survivor.num_preemptions) == (1, 0)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_priority_policy_evicts_a_lower_priority_running_sequence_for_a_waiting_one(policy):
    scheduler = _scheduler(max_num_seqs=1, policy=policy)
    low = _seq(5, priority=1)
    _add(scheduler, low)
    _step(scheduler)
    high = _seq(5, priority=0)
    _add(scheduler, high)
    plan = scheduler.schedule()
    if policy == "priority":
        assert _chunks(plan) == [(high, 5)] and _decoded(plan) == []
        assert scheduler.running == [high] and scheduler.waiting == [low]
        assert low.status is SequenceStatus.WAITING and low.block_ids == []
        assert (low.num_preemptions, scheduler.num_preemptions) == (1, 1)
    else:
        assert _decoded(plan) == [low] and plan.prefills == []
        assert scheduler.running == [low] and scheduler.waiting == [high]
        assert scheduler.num_preemptions == 0


def test_a_sequence_preempted_this_step_is_not_readmitted_in_the_same_step():
    """The evicting sequence's prompt is a prefix-cache hit, so it needs fewer blocks than the
    eviction assumed: after it, the victim would fit again at once (its first block is cached
    too), yet it waits for the next step."""
    scheduler = _scheduler(usable_blocks=4, policy="priority", max_num_batched_tokens=64)
    pool = scheduler.blocks.pool
    shared = list(range(1, 10))
    done = _seq(shared, max_tokens=1)  # leaves shared[:8] cached in 2 free blocks
    _add(scheduler, done)
    _step(scheduler)
    assert done.finished and (pool.num_free_blocks, pool.num_cached_blocks) == (4, 2)

    victim = _seq(shared[:4] + [50], priority=1)
    _add(scheduler, victim)
    assert _decoded(_step(scheduler)) == [victim]  # 4 cached tokens, 1 to compute: a decode
    assert pool.num_free_blocks == 2

    urgent = _seq(shared[:8] + [60, 61], priority=0)  # 3 blocks without its hits: not free
    _add(scheduler, urgent)
    plan = scheduler.schedule()
    assert _chunks(plan) == [(urgent, 2)] and _decoded(plan) == []  # 8 of its tokens were cached
    assert victim.status is SequenceStatus.WAITING and victim.num_preemptions == 1
    assert scheduler.waiting == [victim] and scheduler.running == [urgent]
    assert victim.block_ids == []
    assert pool.num_free_blocks == 1  # room for the victim's missing block: it still waits
    _apply(scheduler, plan)

    plan = _step(scheduler)
    assert _decoded(plan) == [urgent]
    assert _chunks(plan) == [(victim, 2)]  # readmitted next step, its first block a cache hit
    assert pool.num_free_blocks == 0 and scheduler.num_preemptions == 1


# -- speculative lookahead and multi-step decoding ------------------------------------------------------------
@pytest.mark.parametrize("k, guesses, blocks", [(0, 0, 1), (3, 3, 2), (5, 5, 3)])
def test_speculative_lookahead_grows_blocks_for_the_guesses(k, guesses, blocks):
    scheduler = _scheduler(num_speculative_tokens=k)
    seq = _seq(3)
    _add(scheduler, seq)
    assert _step(scheduler).guesses == {}  # a prompt chunk carries no guesses
    plan = scheduler.schedule()
    assert _decoded(plan) == [seq]
    assert plan.guesses == ({seq.seq_id: guesses} if guesses else {})
    # the fed-back token at position 3 and the guesses after it, 4 positions per block
    assert len(seq.block_ids) == blocks


def test_speculation_is_off_above_disable_by_batch_size():
    scheduler = _scheduler(num_speculative_tokens=2, speculative_disable_by_batch_size=1)
    short, long = _seq(3, max_tokens=3), _seq(3, max_tokens=20)
    _add(scheduler, short, long)
    _step(scheduler)
    for _ in range(2):  # two sequences decoding: above the limit of 1
        plan = _step(scheduler)
        assert _decoded(plan) == [short, long] and plan.guesses == {}
    assert short.finished
    plan = scheduler.schedule()  # one left: at the limit, guesses again
    assert _decoded(plan) == [long] and plan.guesses == {long.seq_id: 2}


def test_multi_step_decoding_only_when_no_prompt_is_computed():
    scheduler = _scheduler(num_scheduler_steps=4, max_num_batched_tokens=16)
    a = _seq(3)
    _add(scheduler, a)
    assert _step(scheduler).num_decode_steps == 1  # a's prompt

    plan = scheduler.schedule()
    assert _decoded(plan) == [a] and plan.num_decode_steps == 4
    assert len(a.block_ids) == 2  # grown for positions 3..6
    _apply(scheduler, plan)
    assert (len(a.output_ids), a.num_computed_tokens) == (5, 7)

    b = _seq(36)
    _add(scheduler, b)
    # While b's prompt waits or is being computed: one step, and a's blocks grow for one token
    # (positions 7, 8, 9), not four.
    for chunk, blocks in [(15, 2), (15, 3), (6, 3)]:
        plan = scheduler.schedule()
        assert _decoded(plan) == [a] and _chunks(plan) == [(b, chunk)] and plan.num_decode_steps == 1
        assert len(a.block_ids) == blocks
        _apply(scheduler, plan)
    plan = scheduler.schedule()
    assert _decoded(plan) == [a, b] and plan.num_decode_steps == 4


def test_a_sequence_waiting_for_a_slot_starts_when_one_frees_at_a_calls_end():
    """With every slot taken, decodes run several steps a call while every running sequence
    has that many tokens left, then one at a time: the sequence finishing at its length frees
    its slot at a call's end, and the waiting one starts in the next step, not steps later."""
    scheduler = _scheduler(num_scheduler_steps=4, max_num_seqs=2)
    a, b, c = _seq(3, max_tokens=7), _seq(3, max_tokens=32), _seq(3)
    _add(scheduler, a, b)
    _step(scheduler)  # both prompts, a first token each
    _add(scheduler, c)
    for steps, outputs in [(4, 5), (1, 6), (1, 7)]:  # a has 6, then 2 and 1 tokens left
        plan = _step(scheduler)
        assert _decoded(plan) == [a, b] and plan.prefills == [] and plan.num_decode_steps == steps
        assert len(a.output_ids) == outputs and scheduler.waiting == [c]
    assert a.finished
    plan = _step(scheduler)
    assert _decoded(plan) == [b] and _chunks(plan) == [(c, 3)] and plan.num_decode_steps == 1


def test_a_sequence_waiting_for_a_free_slot_keeps_decoding_to_one_step():
    """A slot is free but the waiting sequence cannot start yet (its blocks do not fit): one
    step at a time, so that it starts as soon as blocks free."""
    scheduler = _scheduler(usable_blocks=3, num_scheduler_steps=4, max_num_seqs=2)
    a, b = _seq(3), _seq(12)
    _add(scheduler, a)
    _step(scheduler)
    _add(scheduler, b)
    plan = scheduler.schedule()
    assert _decoded(plan) == [a] and plan.prefills == [] and plan.num_decode_steps == 1
    assert len(a.block_ids) == 1 and scheduler.waiting == [b]


# -- applying a step's results -----------------------------------------------------------------------
def test_update_from_output_forks_after_the_first_token_and_frees_what_finishes():
    """n = 2: the second sequence starts from the first's computed prompt once the first token
    is sampled; counters count prompt and sampled tokens; finished sequences free every block."""
    scheduler = _scheduler(usable_blocks=8)
    parent = _seq(6, max_tokens=2)
    child = Sequence.create(parent.request_id, 1, parent.prompt_ids, parent.params, 1, 2, 0, None)
    _made[child.seq_id] = child
    scheduler.add(parent, forks=[child])

    plan = scheduler.schedule()
    assert _chunks(plan) == [(parent, 6)] and plan.prefills[0].samples
    assert scheduler.update_from_output(plan, RunnerOutput({parent.seq_id: [SAMPLE]}), scheduled_at=5.0) == [parent]
    assert parent.output_ids == [TOKEN] and parent.num_computed_tokens == 6 and parent.first_scheduled_time == 5.0
    assert scheduler.waiting == [child] and child.num_computed_tokens == 5  # the shared prompt minus its last token
    assert child.block_ids == parent.block_ids[:2]  # the child shares the blocks holding prompt tokens 0..4
    assert (scheduler.num_prompt_tokens, scheduler.num_generated_tokens) == (6, 1)

    while scheduler.running or scheduler.waiting:
        _step(scheduler)
    assert parent.output_ids == child.output_ids == [TOKEN, TOKEN]
    assert parent.finish_reason == child.finish_reason == "length"
    assert parent.status == child.status == SequenceStatus.FINISHED
    assert scheduler.blocks.pool.num_free_blocks == 8
    # The child's one uncomputed prompt token runs as a decode (it feeds that token back), so
    # prompt tokens stay at the parent's 6.
    assert (scheduler.num_prompt_tokens, scheduler.num_generated_tokens) == (6, 4)


def test_update_from_output_stops_at_eos_within_a_multi_step_run():
    """Samples after a finishing token are dropped: a 4-step decode whose second token is EOS
    emits two tokens and the sequence leaves the running queue."""
    scheduler = Scheduler(SchedulerConfig(num_scheduler_steps=4), BlockManager(BlockPool(9, BLOCK_SIZE)),
                          eos_ids=frozenset({2}))
    seq = _seq(3)
    _add(scheduler, seq)
    _step(scheduler)  # the prompt, and its first token
    plan = scheduler.schedule()
    assert _decoded(plan) == [seq] and plan.num_decode_steps == 4
    eos = SampleResult(2, 0.0, [], [])
    scheduler.update_from_output(plan, RunnerOutput({seq.seq_id: [SAMPLE, eos, SAMPLE, SAMPLE]}), scheduled_at=0.0)
    assert seq.output_ids == [TOKEN, TOKEN, 2] and seq.finish_reason == "stop"
    assert scheduler.running == [] and scheduler.blocks.pool.num_free_blocks == 8


# -- a pipeline's micro-batches -----------------------------------------------------------------------
def test_plans_in_flight_hold_their_sequences_out_of_the_next_plan():
    """A pipeline plans its next micro-batch while others are in flight: their sequences keep
    their slots and blocks but are neither scheduled nor preempted, and a row cap splits the
    active sequences evenly between plans."""
    scheduler = _scheduler(usable_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    seqs = [_seq(6) for _ in range(4)]
    _add(scheduler, *seqs)
    first = scheduler.schedule(max_rows=2)
    assert [s for s, _ in _chunks(first)] == seqs[:2]
    in_flight = {s.seq_id for s in seqs[:2]}
    second = scheduler.schedule(in_flight, max_rows=2)
    assert [s for s, _ in _chunks(second)] == seqs[2:]
    assert len(scheduler.running) == 4  # held sequences are back in ``running``
    _apply(scheduler, first)
    # The first plan's sequences decode next; the second's are in flight and must not be planned,
    # nor preempted when blocks run short (4 sequences x 2 blocks + growth in a 12-block pool).
    third = scheduler.schedule({s.seq_id for s in seqs[2:]}, max_rows=2)
    assert _decoded(third) == seqs[:2] and not third.prefills
    assert all(s.status == SequenceStatus.RUNNING for s in seqs)
    # Slots held by plans in flight count: with 4 slots all taken, nothing new is admitted.
    late = _seq(3)
    _add(scheduler, late)
    assert late not in [s for s, _ in _chunks(scheduler.schedule(in_flight | {s.seq_id for s in seqs[2:]}))]


def test_a_sequence_aborted_while_its_plan_is_in_flight_is_skipped_by_its_update():
    scheduler = _scheduler()
    a, b = _seq(5), _seq(5)
    _add(scheduler, a, b)
    plan = scheduler.schedule()
    scheduler.abort(a)
    _apply(scheduler, plan)
    assert a.status == SequenceStatus.FINISHED and b.output_ids == [TOKEN]
