"""cache/block_tables.py with a sliding window (4-token blocks): which blocks a sequence's
next queries can no longer read (hand-computed at block edges, window below, at and above a
block), release during chunked prefill and decoding, forks, the prefix cache after release, and
the bound on the blocks a sequence holds (checked against a position-by-position simulation)."""

from __future__ import annotations

import pytest

from raylm.cache.block_pool import BlockPool
from raylm.cache.block_tables import BlockManager
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.core.sequence import Sequence

BLOCK_SIZE = 4


def _manager(window: int | None, usable_blocks: int = 16, prefix_caching: bool = True) -> BlockManager:
    return BlockManager(BlockPool(usable_blocks + 1, BLOCK_SIZE, enable_prefix_caching=prefix_caching), window=window)


def _seq(prompt_len: int) -> Sequence:
    return Sequence.create("r", 0, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=8), 0, 8, 0, None)


def _compute(manager: BlockManager, seq: Sequence, n: int) -> int:
    """One step computing ``n`` tokens of ``seq``, then what the scheduler does after it: commit
    the full blocks, release what the next step cannot read. Returns the blocks held during it."""
    manager.grow(seq, n)
    held = len(seq.block_ids) - _released(seq)
    seq.num_computed_tokens += n
    manager.commit_computed_blocks(seq)
    manager.release_out_of_window(seq, seq.num_computed_tokens)
    return held


def _released(seq: Sequence) -> int:
    return seq.block_ids.count(0)


def _readable_positions_present(seq: Sequence, first_position: int, window: int) -> bool:
    """Every key a query at ``first_position`` (or later) reads lies in a block the sequence holds."""
    first_key = max(0, first_position - window + 1)
    return all(seq.block_ids[p // BLOCK_SIZE] != 0 for p in range(first_key, seq.num_computed_tokens))


# -- the rule at block edges -----------------------------------------------------------------------
@pytest.mark.parametrize("window, first_position, released", [
    # window of one block: a query at 6 reads keys 3..6, block 0 (0..3) still holds key 3
    (4, 3, 0), (4, 4, 0), (4, 6, 0), (4, 7, 1), (4, 10, 1), (4, 11, 2),
    # window smaller than a block: a query at p reads only p (window 1) or p-1, p (window 2)
    (1, 3, 0), (1, 4, 1), (1, 7, 1), (1, 8, 2),
    (2, 4, 0), (2, 5, 1), (2, 8, 1), (2, 9, 2),
    # window larger than a block: a query at 12 reads keys 3..12, at 13 keys 4..13
    (10, 9, 0), (10, 12, 0), (10, 13, 1), (10, 16, 1), (10, 17, 2), (10, 20, 2), (10, 21, 3),
])
def test_a_block_goes_when_its_last_position_is_before_the_window(window, first_position, released):
    manager = _manager(window)
    seq = _seq(24)
    manager.grow(seq, 24)
    seq.num_computed_tokens = first_position
    held = list(seq.block_ids)
    manager.release_out_of_window(seq, first_position)
    assert seq.block_ids == [0] * released + held[released:]
    assert [manager.pool.ref_count(b) for b in held] == [0] * released + [1] * (6 - released)
    assert manager.pool.num_used_blocks == 6 - released
    assert _readable_positions_present(seq, first_position, window)


def test_release_is_incremental_and_idempotent():
    manager = _manager(window=4)
    seq = _seq(24)
    manager.grow(seq, 24)
    for first_position, released in [(7, 1), (7, 1), (5, 1), (15, 3), (16, 3), (23, 5)]:
        manager.release_out_of_window(seq, first_position)  # an earlier position frees nothing back
        assert _released(seq) == released and manager.pool.num_used_blocks == 6 - released


def test_without_a_window_nothing_is_released():
    manager = _manager(window=None)
    seq = _seq(24)
    _compute(manager, seq, 24)
    manager.release_out_of_window(seq, 24)
    assert _released(seq) == 0 and manager.pool.num_used_blocks == 6
    assert manager.max_blocks_held(8) is None


def test_a_window_must_be_positive():
    with pytest.raises(ValueError, match="window"):
        _manager(window=0)


# -- chunked prefill, decoding, freeing ------------------------------------------------------------
@pytest.mark.parametrize("window, chunk", [(1, 8), (3, 5), (4, 4), (6, 8), (9, 3), (16, 8)])
def test_chunked_prefill_then_decode_holds_only_the_window(window, chunk):
    manager = _manager(window, usable_blocks=30)
    seq = _seq(50)
    while seq.num_computed_tokens < 50:  # prompt chunks, then one token per step
        assert _compute(manager, seq, min(chunk, 50 - seq.num_computed_tokens)) <= manager.max_blocks_held(chunk)
        assert manager.pool.num_used_blocks == len(seq.block_ids) - _released(seq)  # nothing leaks
        assert _readable_positions_present(seq, seq.num_computed_tokens, window)
    for _ in range(40):
        seq.output_ids.append(7)
        assert _compute(manager, seq, 1) <= manager.max_blocks_held(1)
        assert _readable_positions_present(seq, seq.num_computed_tokens, window)
    assert _released(seq) == (90 - window + 1) // BLOCK_SIZE
    manager.free(seq)
    assert manager.pool.num_used_blocks == 0 and manager.pool.num_free_blocks == 30


@pytest.mark.parametrize("window", [1, 2, 3, 4, 5, 7, 8, 13])
@pytest.mark.parametrize("step_tokens", [1, 2, 3, 4, 9])
@pytest.mark.parametrize("draft_lag", [0, 1])
def test_max_blocks_held_bounds_every_alignment(window, step_tokens, draft_lag):
    """Position by position: at each step, the blocks covering the keys its first query reads
    (the draft's one position earlier, with a lag) up to its last written token."""
    manager = _manager(window)
    most = 0
    for first in range(draft_lag, 60):
        lowest = max(0, first - draft_lag - window + 1)
        blocks = {p // BLOCK_SIZE for p in range(lowest, first + step_tokens)}
        most = max(most, len(blocks))
    assert most <= manager.max_blocks_held(step_tokens)


# -- prefix cache after release ------------------------------------------------------------------------
def test_released_blocks_stay_cached_and_a_later_prompt_hits_then_releases_them():
    manager = _manager(window=4)
    first = _seq(22)
    for n in (8, 8, 6):
        _compute(manager, first, n)
    assert _released(first) == 4 and manager.pool.num_cached_blocks == 5  # blocks 0..4 are full
    manager.free(first)

    again = _seq(22)
    lookup = manager.reuse_cached_prefix(again)
    assert lookup.hit_blocks == 5 and again.num_computed_tokens == 20
    manager.release_out_of_window(again, again.num_computed_tokens)  # the scheduler, after the lookup
    assert _released(again) == 4 and manager.pool.num_used_blocks == 1
    assert _readable_positions_present(again, 20, 4)


def test_a_chain_with_an_evicted_block_is_a_shorter_hit_or_none():
    """Released blocks join the free queue in release order: the sequence's first blocks are the
    first evicted, and without them nothing after them can hit."""
    manager = _manager(window=4, usable_blocks=6)
    seq = _seq(21)
    for n in (8, 4, 4, 4, 1):  # one block released per step from the second on
        _compute(manager, seq, n)
    assert _released(seq) == 4 and manager.pool.num_free_blocks == 6 - 2
    manager.pool.allocate(1)  # evicts the least recently released: block 0 of the chain
    probe = _seq(21)
    assert manager.reuse_cached_prefix(probe).hit_blocks == 0  # blocks 1..3 are cached but unreachable

    manager = _manager(window=4, usable_blocks=6)
    seq = _seq(21)
    for n in (20, 1):  # blocks 0..3 released at once: the last of them is evicted first
        _compute(manager, seq, n)
    manager.pool.allocate(1)
    probe = _seq(21)
    assert manager.reuse_cached_prefix(probe).hit_blocks == 3


def test_without_prefix_caching_released_blocks_are_plain_free_blocks():
    manager = _manager(window=4, prefix_caching=False)
    seq = _seq(22)
    _compute(manager, seq, 22)
    assert _released(seq) == 4 and manager.pool.num_free_blocks == 16 - 2
    assert manager.reuse_cached_prefix(_seq(22)) is None


# -- forks ----------------------------------------------------------------------------------------------
def test_a_fork_after_chunked_prefill_shares_only_the_window_and_nothing_leaks():
    manager = _manager(window=4)
    pool = manager.pool
    parent = _seq(14)
    _compute(manager, parent, 8)  # positions 0..7; the next chunk's first query (8) reads 5..8
    assert _released(parent) == 1
    manager.grow(parent, 6)  # the last chunk samples the first token, which forks the child ...
    parent.num_computed_tokens = 14
    parent.output_ids.append(7)
    blocks = list(parent.block_ids)
    assert blocks[0] == 0

    child = _seq(14)
    manager.fork(parent, child)  # the child's first query is at 13: keys 10..13, blocks 2 and 3
    assert child.block_ids == [0, 0, blocks[2], blocks[3]]
    assert [pool.ref_count(b) for b in blocks[1:]] == [1, 2, 2]
    assert (child.num_computed_tokens, child.num_committed_blocks) == (13, 3)
    manager.commit_computed_blocks(parent)  # ... before the parent's update goes on
    manager.release_out_of_window(parent, 14)
    assert pool.ref_count(blocks[1]) == 0 and pool.num_used_blocks == 2

    manager.grow(child, 1)  # position 13 lands in the shared block 3: copied
    assert manager.take_copies() == [(blocks[3], child.block_ids[3])]
    child.num_computed_tokens = 14
    manager.release_out_of_window(child, 14)  # keys 11.. from now on: block 2 is still read
    assert child.block_ids[:3] == [0, 0, blocks[2]]

    for _ in range(3):  # the parent decodes on alone, releasing its share of block 2 at 15
        parent.output_ids.append(7)
        _compute(manager, parent, 1)
    assert pool.ref_count(blocks[2]) == 1 and _released(parent) == 3
    for seq in (parent, child):
        manager.free(seq)
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 16
