"""cache/block_tables.py over a real ``BlockPool`` (4-token blocks): growth arithmetic across
block boundaries, freeing, prefix-cache reuse (salted, optional), forks and copy-on-write."""

from __future__ import annotations

import pytest

from raylm.cache.block_pool import BlockPool
from raylm.cache.block_tables import BlockManager, PrefixLookup
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.core.sequence import Sequence

BLOCK_SIZE = 4
PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks and 2 tokens of a third


def _manager(usable_blocks: int = 8, prefix_caching: bool = True, salt: str = "") -> BlockManager:
    return BlockManager(BlockPool(usable_blocks + 1, BLOCK_SIZE, enable_prefix_caching=prefix_caching), salt)


def _seq(prompt: list[int] = PROMPT) -> Sequence:
    return Sequence.create("r", 0, list(prompt), SamplingParams(max_tokens=8), 0, 8, 0, None)


def _computed(manager: BlockManager, prompt: list[int] = PROMPT) -> Sequence:
    """A sequence whose whole prompt was computed (its full blocks committed), as after its
    last prompt chunk."""
    seq = _seq(prompt)
    manager.grow(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    manager.commit_computed_blocks(seq)
    return seq


def _all_refs(pool: BlockPool) -> list[int]:
    return [pool.ref_count(b) for b in range(1, pool.num_blocks)]


# -- growth --------------------------------------------------------------------------------------------
def test_blocks_needed_counts_block_boundaries():
    manager = _manager(usable_blocks=8)
    seq = _seq()
    assert [manager.blocks_needed(seq, n) for n in (0, 1, 4, 5, 8, 9, 10)] == [0, 1, 1, 2, 2, 3, 3]
    manager.grow(seq, 10)
    assert len(seq.block_ids) == 3 and manager.pool.num_free_blocks == 5
    assert len(set(seq.block_ids)) == 3 and 0 not in seq.block_ids  # distinct, never the null block

    seq.num_computed_tokens = 10  # the third block holds positions 8, 9; 10 and 11 still fit
    assert [manager.blocks_needed(seq, n) for n in (0, 1, 2, 3, 6, 7, 11)] == [0, 0, 0, 1, 1, 2, 3]


def test_can_grow_is_exactly_the_free_blocks():
    manager = _manager(usable_blocks=8)
    seq = _seq()
    manager.grow(seq, 10)
    seq.num_computed_tokens = 10
    # 5 free blocks: up to position 31 (32 tokens, 8 blocks) fits, position 32 does not.
    assert manager.can_grow(seq, 22) and not manager.can_grow(seq, 23)
    manager.grow(seq, 3)  # positions 10..12: one more block
    assert len(seq.block_ids) == 4 and manager.pool.num_free_blocks == 4
    manager.grow(seq, 2)  # positions 10, 11 fit the blocks held: nothing allocated
    assert len(seq.block_ids) == 4 and manager.pool.num_free_blocks == 4
    assert manager.take_copies() == []


def test_free_returns_every_block_and_resets_progress():
    manager = _manager(usable_blocks=8)
    a, b = _computed(manager), _computed(manager, list(range(7)))
    assert manager.pool.num_free_blocks == 8 - 3 - 2
    manager.free(a)
    assert manager.pool.num_free_blocks == 6
    assert (a.block_ids, a.num_computed_tokens, a.num_committed_blocks) == ([], 0, 0)
    manager.free(b)
    manager.free(b)  # a sequence without blocks: nothing to free
    assert manager.pool.num_free_blocks == 8 and manager.pool.num_used_blocks == 0
    assert _all_refs(manager.pool) == [0] * 8


# -- prefix cache --------------------------------------------------------------------------------------
def test_a_committed_prompt_is_reused_by_the_next_sequence_with_it():
    manager = _manager()
    first = _computed(manager)
    assert first.num_committed_blocks == 2 and manager.pool.num_cached_blocks == 2

    second = _seq()
    assert manager.reuse_cached_prefix(second) == PrefixLookup(queried_blocks=2, hit_blocks=2)
    assert second.block_ids == first.block_ids[:2]
    assert (second.num_computed_tokens, second.num_committed_blocks) == (8, 2)
    assert [manager.pool.ref_count(b) for b in first.block_ids] == [2, 2, 1]
    assert manager.blocks_needed(second, 2) == 1  # only the third block is its own
    assert manager.reuse_cached_prefix(second) is None  # it holds blocks now: no second lookup


def test_the_last_known_token_is_always_recomputed():
    manager = _manager()
    _computed(manager)
    exact = _seq(PROMPT[:8])  # two full blocks, both cached: the second is recomputed anyway
    assert manager.reuse_cached_prefix(exact) == PrefixLookup(queried_blocks=1, hit_blocks=1)
    assert exact.num_computed_tokens == 4


def test_the_cache_is_freed_blocks_until_they_are_reallocated():
    manager = _manager(usable_blocks=3)
    manager.free(_computed(manager))  # all 3 blocks free again; 2 of them still cache the prompt
    assert (manager.pool.num_free_blocks, manager.pool.num_cached_blocks) == (3, 2)
    again = _seq()
    assert manager.reuse_cached_prefix(again).hit_blocks == 2
    assert manager.pool.num_free_blocks == 1


@pytest.mark.parametrize("prefix_caching, salts, prompt, lookup", [
    (True, ("m", "m"), PROMPT, PrefixLookup(2, 2)),
    (True, ("m", "other model"), PROMPT, PrefixLookup(2, 0)),
    (True, ("m", "m"), [1] + PROMPT[1:], PrefixLookup(2, 0)),  # block 0 differs: block 1 cannot hit
    (True, ("m", "m"), PROMPT[:4] + [1] + PROMPT[5:], PrefixLookup(2, 1)),
    (False, ("m", "m"), PROMPT, None),
])
def test_a_prefix_hit_needs_caching_on_the_same_salt_and_the_same_tokens_from_the_start(
    prefix_caching, salts, prompt, lookup
):
    pool = BlockPool(9, BLOCK_SIZE, enable_prefix_caching=prefix_caching)
    writer, reader = BlockManager(pool, salts[0]), BlockManager(pool, salts[1])
    _computed(writer)
    assert pool.num_cached_blocks == (2 if prefix_caching else 0)
    seq = _seq(prompt)
    assert reader.reuse_cached_prefix(seq) == lookup
    hits = lookup.hit_blocks if lookup else 0
    assert len(seq.block_ids) == hits and seq.num_computed_tokens == hits * BLOCK_SIZE


def test_a_block_hits_only_after_the_same_prefix():
    """Hashes are chained: a block's tokens cached after another prefix are no hit."""
    manager = _manager()
    _computed(manager)
    _computed(manager, list(range(200, 210)))
    mixed = _seq(PROMPT[:4] + list(range(204, 210)))  # the first's block 0, then the second's block 1
    assert manager.reuse_cached_prefix(mixed) == PrefixLookup(queried_blocks=2, hit_blocks=1)


# -- forks and copy-on-write --------------------------------------------------------------------------
def test_fork_shares_the_prompt_and_copies_the_partial_block_on_write():
    manager = _manager(usable_blocks=8)
    pool = manager.pool
    parent = _computed(manager, PROMPT[:6])  # block 0 full, block 1 holds positions 4, 5
    parent.output_ids.append(7)
    child = _seq(PROMPT[:6])
    manager.fork(parent, child)
    assert child.block_ids == parent.block_ids
    assert [pool.ref_count(b) for b in parent.block_ids] == [2, 2]
    assert (child.num_computed_tokens, child.num_committed_blocks) == (5, 1)
    assert pool.num_free_blocks == 6  # sharing allocates nothing

    # The child recomputes position 5, in the shared partial block: it gets its own copy.
    assert manager.blocks_needed(child, 1) == 1
    shared_partial = parent.block_ids[1]
    manager.grow(child, 1)
    assert child.block_ids[0] == parent.block_ids[0] and child.block_ids[1] != shared_partial
    assert manager.take_copies() == [(shared_partial, child.block_ids[1])]
    assert manager.take_copies() == []  # handed over once
    assert [pool.ref_count(b) for b in parent.block_ids] == [2, 1]
    assert pool.ref_count(child.block_ids[1]) == 1 and pool.num_free_blocks == 5

    # The parent writes position 6 into its block 1, no longer shared: no copy.
    assert manager.blocks_needed(parent, 1) == 0
    manager.grow(parent, 1)
    assert manager.take_copies() == []


def test_the_parent_copies_first_if_it_writes_first():
    manager = _manager(usable_blocks=8)
    parent = _computed(manager, PROMPT[:6])
    child = _seq(PROMPT[:6])
    manager.fork(parent, child)
    shared_partial = parent.block_ids[1]
    manager.grow(parent, 1)  # position 6 lands in the shared block
    assert manager.take_copies() == [(shared_partial, parent.block_ids[1])]
    assert child.block_ids[1] == shared_partial and manager.pool.ref_count(shared_partial) == 1
    assert manager.blocks_needed(child, 1) == 0  # the child is its only holder now


def test_nothing_leaks_after_forks_copies_and_reuse():
    manager = _manager(usable_blocks=8)
    pool = manager.pool
    parent = _computed(manager)
    children = [_seq() for _ in range(2)]
    for child in children:
        manager.fork(parent, child)
        manager.grow(child, 1)
    reused = _seq()
    manager.reuse_cached_prefix(reused)
    manager.grow(reused, 2)
    # the parent's 3, a copy of its partial block per child, the reused prompt's own third block
    assert len(manager.take_copies()) == 2 and pool.num_used_blocks == 6
    for seq in (parent, *children, reused):
        manager.free(seq)
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0
    assert _all_refs(pool) == [0] * 8
