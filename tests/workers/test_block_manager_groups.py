"""cache/block_tables.py with two KV groups (a model interleaving sliding and full-attention
layers, 4-token blocks, a 4-token window): the full group keeps every block while the sliding
group releases what its window left behind, each from its own pool; growth needs both pools;
a prefix hit needs every block in the full group but only its window's in the sliding one;
forks and copy-on-write act per group; the limits the engine admits by read the full group; a
load from a KV offload tier follows the prefix-hit rule and leaves each table as a hit would."""

from __future__ import annotations

from raylm.cache.block_pool import BlockPool
from raylm.cache.block_tables import BlockManager
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.core.sequence import Sequence

BLOCK_SIZE = 4
WINDOW = 4


def _manager(full_blocks: int = 16, sliding_blocks: int = 16) -> BlockManager:
    return BlockManager(BlockPool(full_blocks + 1, BLOCK_SIZE), sliding=(BlockPool(sliding_blocks + 1, BLOCK_SIZE), WINDOW))


def _seq(prompt_len: int) -> Sequence:
    return Sequence.create("r", 0, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=8), 0, 8, 0, None)


def _compute(manager: BlockManager, seq: Sequence, n: int) -> None:
    """One step of ``n`` tokens, then the scheduler's commit and release."""
    manager.grow(seq, n)
    seq.num_computed_tokens += n
    manager.commit_computed_blocks(seq)
    manager.release_out_of_window(seq, seq.num_computed_tokens)


def test_the_sliding_group_releases_behind_its_window_while_the_full_group_keeps_every_block():
    manager = _manager()
    seq = _seq(22)
    for n in (8, 8, 6):
        _compute(manager, seq, n)
    # The next query (22) reads keys 19..22 in the sliding layers: blocks 4 and 5 there.
    assert seq.block_ids.count(0) == 0 and len(seq.block_ids) == 6
    assert seq.sliding_block_ids[:4] == [0] * 4 and 0 not in seq.sliding_block_ids[4:]
    assert (manager.pool.num_used_blocks, manager.sliding.num_used_blocks) == (6, 2)
    for _ in range(12):  # decoding: the full group grows, the sliding one stays within its window
        seq.output_ids.append(7)
        _compute(manager, seq, 1)
        assert manager.sliding.num_used_blocks <= manager.max_blocks_held(1, group=1) == 3
    assert (manager.pool.num_used_blocks, len(seq.sliding_block_ids)) == (9, 9)
    manager.free(seq)
    assert manager.pool.num_used_blocks == manager.sliding.num_used_blocks == 0
    assert seq.block_ids == seq.sliding_block_ids == []


def test_growth_needs_both_pools():
    manager = _manager(full_blocks=16, sliding_blocks=2)
    seq = _seq(12)
    assert manager.can_grow(seq, 8) and not manager.can_grow(seq, 9)  # 3 sliding blocks before any release
    assert manager.blocks_needed(seq, 9) == manager.blocks_needed(seq, 9, group=1) == 3


def test_a_prefix_hit_needs_only_the_sliding_blocks_its_window_reads_after_it():
    """vLLM's rule: a hit of 5 blocks (20 tokens) needs all 5 in the full group, but in the
    sliding group only those the query at position 20 reads (keys 17..20: block 4)."""
    manager = _manager(full_blocks=16, sliding_blocks=8)
    first = _seq(21)
    for n in (8, 4, 4, 4, 1):  # blocks 0..4 full; the sliding group released 0..3 along the way
        _compute(manager, first, n)
    manager.free(first)
    manager.sliding.allocate(7)  # evicts the sliding group's blocks but the last one freed: block 4
    again = _seq(21)
    lookup = manager.reuse_cached_prefix(again)
    assert (lookup.queried_blocks, lookup.hit_blocks, again.num_computed_tokens) == (5, 5, 20)
    assert again.sliding_block_ids[:4] == [0] * 4 and again.sliding_block_ids[4] != 0
    assert (manager.pool.num_used_blocks, manager.sliding.num_used_blocks) == (5, 8)
    manager.free(again)

    manager.sliding.allocate(1)  # block 4 too: no prefix has its window's blocks now
    probe = _seq(21)
    assert manager.reuse_cached_prefix(probe).hit_blocks == 0  # the full group alone would hit 5
    assert probe.block_ids == probe.sliding_block_ids == [] and manager.pool.num_used_blocks == 0


def test_a_fork_shares_per_group_and_copies_on_write_in_each():
    manager = _manager()
    parent = _seq(14)
    _compute(manager, parent, 8)
    manager.grow(parent, 6)
    parent.num_computed_tokens = 14
    parent.output_ids.append(7)
    child = _seq(14)
    manager.fork(parent, child)  # the child's first query is at 13: sliding keys 10..13, blocks 2, 3
    assert child.block_ids == parent.block_ids
    assert child.sliding_block_ids == [0, 0] + parent.sliding_block_ids[2:]
    manager.grow(child, 1)  # position 13 lands in the shared block 3 of both groups
    assert manager.take_copies() == [(parent.block_ids[3], child.block_ids[3])]
    assert manager.take_copies(1) == [(parent.sliding_block_ids[3], child.sliding_block_ids[3])]
    for seq in (parent, child):
        manager.free(seq)
    assert manager.pool.num_used_blocks == manager.sliding.num_used_blocks == 0


def test_admission_limits_come_from_the_group_without_a_window():
    manager = _manager(full_blocks=10, sliding_blocks=4)
    assert manager.max_tokens(1) == 40  # the full group: 10 blocks of 4 tokens
    assert manager.max_prompt_tokens(1) == 39  # the sliding group holds 3 blocks at a time: no bound
    assert _manager(full_blocks=10, sliding_blocks=2).max_tokens(1) == 8  # 3 > 2 sliding blocks: no bound


def _hashed(manager: BlockManager, prompt_len: int) -> Sequence:
    """A sequence looked up in the prefix cache (its full blocks hashed; it holds what hit)."""
    seq = _seq(prompt_len)
    manager.reuse_cached_prefix(seq)
    return seq


def test_a_load_from_a_tier_ends_where_the_tiers_hold_the_window_after_it():
    """As a prefix hit: a load of n blocks needs the full group's n and, in the sliding group,
    only block n - 1 (the query at 4n reads keys 4n - 3 .. 4n); the tiers lack sliding blocks 2,
    4 and 5, so of the 6 blocks they hold in the full group the load takes 4."""
    manager = _manager()
    seq = _hashed(manager, 30)
    assert manager.reserve_for_load(seq, 6, [True, True, False, True, False, False]) == 4
    assert manager.sliding_to_load(0, 4) == range(3, 4)
    assert len(seq.block_ids) == 4 and seq.sliding_block_ids[:3] == [0] * 3 and seq.sliding_block_ids[3] != 0
    assert manager.adopt_loaded(seq, 0, 4, 1) == 4 and seq.num_computed_tokens == 16
    manager.free(seq)
    # What the load brought is a prefix hit of the pool's own rule now.
    assert manager.reuse_cached_prefix(_seq(30)).hit_blocks == 4
    assert manager.sliding.num_used_blocks == 1 and manager.sliding.cached_block(seq.block_hashes[2]) is None


def test_a_load_after_a_prefix_hit_keeps_each_group_consistent_whatever_arrives():
    """A 2-block pool hit (sliding block 1 held), then 3 blocks from a tier (sliding block 4
    only): all arriving, the hit's sliding block goes back; nothing arriving, the tables are
    the hit's again; the full group falling short ends the load before any block whose window
    did not arrive. No block of either group is left held."""
    for full, sliding, adopted in ((3, 1, 3), (0, 0, 0), (2, 1, 0)):
        manager = _manager()
        manager.reuse_cached_prefix(warm := _seq(9))
        _compute(manager, warm, 9)
        manager.free(warm)
        seq = _hashed(manager, 30)
        hit = list(seq.sliding_block_ids)
        assert len(seq.block_ids) == 2 and hit[0] == 0 and hit[1] != 0
        assert manager.reserve_for_load(seq, 3, [False, False, True]) == 3
        assert seq.sliding_block_ids[2:4] == [0, 0]  # (a null run inside the table while loading)
        assert manager.adopt_loaded(seq, 2, full, sliding) == adopted
        end = 2 + adopted
        assert len(seq.block_ids) == len(seq.sliding_block_ids) == end and seq.num_computed_tokens == 4 * end
        expected = hit if adopted == 0 else [0] * (end - 1) + [seq.sliding_block_ids[-1]]
        assert seq.sliding_block_ids == expected and 0 not in seq.block_ids
        assert (manager.pool.num_used_blocks, manager.sliding.num_used_blocks) == (end, 1)
        manager.free(seq)
        assert manager.pool.num_used_blocks == manager.sliding.num_used_blocks == 0


def test_a_shorter_load_stands_where_the_window_reaches_back_into_what_arrived():
    """An 8-token window (the sliding group needs the last 2 blocks of a load): a load of
    blocks 0 and 1 that brings only block 0 of the full group keeps it, and gives the rest back;
    the sliding group's free blocks bound a load too."""
    manager = BlockManager(BlockPool(17, BLOCK_SIZE), sliding=(BlockPool(3, BLOCK_SIZE), 8))
    seq = _hashed(manager, 9)
    assert manager.reserve_for_load(seq, 2, [True, True]) == 2
    assert manager.adopt_loaded(seq, 0, 1, 2) == 1
    assert (len(seq.block_ids), len(seq.sliding_block_ids), seq.num_computed_tokens) == (1, 1, 4)
    assert (manager.pool.num_used_blocks, manager.sliding.num_used_blocks) == (1, 1)
    other = _hashed(manager, 30)  # 3 sliding blocks would be held; 1 is free: 1 block, sliding block 0
    assert manager.reserve_for_load(other, 5, [True] * 5) == 1
    for held in (seq, other):
        manager.free(held)
    assert manager.pool.num_used_blocks == manager.sliding.num_used_blocks == 0
