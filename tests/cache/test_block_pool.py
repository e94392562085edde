"""Block pool and block hashes: a stateful model check plus hand-computed cases."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from raylm.cache.block_hash import block_hashes, hash_block
from raylm.cache.block_pool import BlockPool, NoFreeBlocksError

REPO_ROOT = Path(__file__).resolve().parents[2]


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives a BlockPool and a plain-dict model side by side.

    The model keeps the free queue as a list (head = next evicted) so every allocation's
    exact block ids, and every eviction, are predicted independently of the pool.
    """

    @initialize(num_blocks=st.integers(2, 10))
    def setup(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks, block_size=4)
        self.usable = num_blocks - 1
        self.ref = {b: 0 for b in range(1, num_blocks)}
        self.free_queue = list(range(1, num_blocks))
        self.hash_of: dict[int, int] = {}  # block -> hash, for cached blocks
        self.seqs: list[list[int]] = []  # each holds one reference to each of its blocks
        self.queries = 0
        self.hits = 0

    def _evict(self, block: int) -> None:
        self.hash_of.pop(block, None)

    def _cache(self, block: int, block_hash: int) -> None:
        current = self.hash_of.get(block)
        if current is not None and current != block_hash:
            with pytest.raises(ValueError):
                self.pool.cache_full_block(block, block_hash)
            return
        self.pool.cache_full_block(block, block_hash)
        if current is None and block_hash not in self.hash_of.values():
            self.hash_of[block] = block_hash

    @rule(n=st.integers(0, 11), hashes=st.lists(st.integers(0, 7), max_size=11))
    def allocate(self, n: int, hashes: list[int]) -> None:
        """Allocate n blocks, then cache the first len(hashes) of them, as a prefill would."""
        if n > len(self.free_queue):
            before = self.pool.stats()
            with pytest.raises(NoFreeBlocksError):
                self.pool.allocate(n)
            assert self.pool.stats() == before
            return
        got = self.pool.allocate(n)
        expected, self.free_queue = self.free_queue[:n], self.free_queue[n:]
        assert got == expected
        assert 0 not in got
        for block in got:
            self._evict(block)
            self.ref[block] = 1
        for block, block_hash in zip(got, hashes):
            self._cache(block, block_hash)
        self.seqs.append(got)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free_seq(self, data: st.DataObject) -> None:
        seq = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.pool.free(seq)
        for block in reversed(seq):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free_queue.append(block)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        seq = self.seqs[data.draw(st.integers(0, len(self.seqs) - 1))]
        self.pool.incref(seq)
        for block in seq:
            self.ref[block] += 1
        self.seqs.append(list(seq))

    @precondition(lambda self: any(self.seqs))
    @rule(data=st.data(), block_hash=st.integers(0, 7))
    def cache_full_block(self, data: st.DataObject, block_hash: int) -> None:
        self._cache(data.draw(st.sampled_from([b for seq in self.seqs for b in seq])), block_hash)

    @rule(data=st.data(), record=st.booleans())
    def reuse_prefix(self, data: st.DataObject, record: bool) -> None:
        block_of = {h: b for b, h in self.hash_of.items()}
        # Mostly cached hashes (so hits, including revivals of free blocks, are common)
        # and 99, which is never cached, to cut prefixes short.
        hashes = data.draw(st.lists(st.sampled_from(sorted(block_of) + [99]), max_size=4))
        expected = []
        for h in hashes:
            if h not in block_of:
                break
            expected.append(block_of[h])
        found = self.pool.find_cached_prefix(hashes, record_stats=record)
        assert found == expected
        if record:
            self.queries += len(hashes) * self.pool.block_size  # tokens, as vLLM counts them
            self.hits += len(found) * self.pool.block_size
        self.pool.touch(found)
        for block in found:
            if self.ref[block] == 0:
                self.free_queue.remove(block)
            self.ref[block] += 1
        self.seqs.append(found)

    @precondition(lambda self: any(r == 0 for r in self.ref.values()))
    @rule(data=st.data())
    def double_free_raises(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from([b for b, r in self.ref.items() if r == 0]))
        with pytest.raises(ValueError):
            self.pool.free([block])

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.pool.reset_prefix_cache() is True
        for block in self.free_queue:
            self._evict(block)

    @invariant()
    def matches_model(self) -> None:
        pool = self.pool
        for block, ref in self.ref.items():
            assert ref >= 0
            assert pool.ref_count(block) == ref
            assert pool.block_hash(block) == self.hash_of.get(block)
        assert pool.ref_count(0) == 0
        used = sum(1 for r in self.ref.values() if r > 0)
        assert pool.num_used_blocks == used
        assert pool.num_free_blocks == len(self.free_queue)
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_usable_blocks == self.usable
        assert pool.num_cached_blocks == len(self.hash_of)
        assert pool.usage == used / self.usable
        assert (pool.prefix_queries, pool.prefix_hits) == (self.queries, self.hits)

    @invariant()
    def in_use_blocks_stay_cached(self) -> None:
        for block, block_hash in self.hash_of.items():
            if self.ref[block] > 0:
                assert self.pool.find_cached_prefix([block_hash], record_stats=False) == [block]

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for seq in self.seqs:
            self.pool.free(seq)
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks
        assert self.pool.num_used_blocks == 0


BlockPoolMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestBlockPoolStateful = BlockPoolMachine.TestCase


def test_lru_evicts_first_freed_request_tail_first():
    pool = BlockPool(num_blocks=7, block_size=4)
    a = pool.allocate(3)
    b = pool.allocate(3)
    assert (a, b) == ([1, 2, 3], [4, 5, 6])
    for block in a + b:
        pool.cache_full_block(block, 100 + block)
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 6

    assert pool.allocate(1) == [3]  # A's tail block goes first
    assert pool.block_hash(3) is None
    assert pool.find_cached_prefix([101, 102], record_stats=False) == [1, 2]
    assert pool.allocate(2) == [2, 1]  # then A's prefix, last block first
    assert pool.allocate(3) == [6, 5, 4]  # then B's
    assert pool.num_cached_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)


def test_cache_hit_after_free_is_touched_back_without_allocation():
    pool = BlockPool(num_blocks=5, block_size=2)
    tokens = [5, 6, 7, 8, 9]
    hashes = block_hashes(tokens, 2, salt="m")
    blocks = pool.allocate(3)
    for block, block_hash in zip(blocks, hashes):
        pool.cache_full_block(block, block_hash)
    pool.free(blocks)
    assert pool.num_free_blocks == 4

    found = pool.find_cached_prefix(block_hashes(tokens + [10], 2, salt="m"))
    assert found == blocks[:2]  # the third block was partial and never cached
    assert pool.stats().prefix_queries == 3 * 2 and pool.stats().prefix_hits == 2 * 2  # tokens
    assert pool.find_cached_prefix([hashes[0], 12345, hashes[1]], record_stats=False) == blocks[:1]
    pool.touch(found)
    assert [pool.ref_count(b) for b in found] == [1, 1]
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 2
    assert pool.allocate(2) == [4, 3]  # queue was [4, 3, 2, 1]; the touched 2, 1 left it
    assert pool.find_cached_prefix(hashes, record_stats=False) == blocks[:2]


def test_no_free_blocks_allocates_nothing():
    pool = BlockPool(num_blocks=4, block_size=16)
    pool.allocate(2)
    before = pool.stats()
    with pytest.raises(NoFreeBlocksError, match="requested 2 .* only 1 are free"):
        pool.allocate(2)
    assert pool.stats() == before
    assert pool.allocate(1) == [3]
    assert issubclass(NoFreeBlocksError, RuntimeError)


def test_double_free_and_null_block_raise_without_changes():
    pool = BlockPool(num_blocks=4, block_size=16)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        pool.free(blocks[:1])
    with pytest.raises(ValueError, match="null block"):
        pool.free([0])
    with pytest.raises(ValueError, match="null block"):
        pool.incref([0])

    [block] = pool.allocate(1)
    with pytest.raises(ValueError, match="double free"):
        pool.free([block, block])  # one reference, freed twice in one call
    assert pool.ref_count(block) == 1


def test_shared_block_is_freed_only_by_its_last_holder():
    pool = BlockPool(num_blocks=3, block_size=16)
    blocks = pool.allocate(2)
    pool.incref(blocks)
    pool.free(blocks)
    assert pool.num_free_blocks == 0 and [pool.ref_count(b) for b in blocks] == [1, 1]
    pool.free(blocks)
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 0


def test_reviving_a_free_uncached_block_raises():
    pool = BlockPool(num_blocks=3, block_size=16)
    with pytest.raises(ValueError, match="no cached prefix"):
        pool.touch([1])
    assert pool.num_free_blocks == 2


def test_duplicate_hash_keeps_existing_mapping():
    pool = BlockPool(num_blocks=3, block_size=16)
    first, second = pool.allocate(2)
    pool.cache_full_block(first, 42)
    pool.cache_full_block(second, 42)
    assert pool.block_hash(second) is None
    assert pool.find_cached_prefix([42], record_stats=False) == [first]
    with pytest.raises(ValueError, match="already caches"):
        pool.cache_full_block(first, 43)


def test_reset_prefix_cache_drops_only_free_blocks():
    pool = BlockPool(num_blocks=3, block_size=16)
    kept, dropped = pool.allocate(2)
    pool.cache_full_block(kept, 1)
    pool.cache_full_block(dropped, 2)
    pool.free([dropped])
    assert pool.reset_prefix_cache() is True
    assert pool.find_cached_prefix([1], record_stats=False) == [kept]
    assert pool.find_cached_prefix([2], record_stats=False) == []
    assert pool.num_cached_blocks == 1


def test_disabled_prefix_caching_never_caches():
    pool = BlockPool(num_blocks=3, block_size=16, enable_prefix_caching=False)
    [block] = pool.allocate(1)
    pool.cache_full_block(block, 7)
    assert pool.block_hash(block) is None
    assert pool.find_cached_prefix([7]) == []


@pytest.mark.parametrize(("num_blocks", "block_size", "message"), [(1, 16, "num_blocks"), (4, 0, "block_size")])
def test_invalid_geometry_is_rejected(num_blocks: int, block_size: int, message: str):
    with pytest.raises(ValueError, match=message):
        BlockPool(num_blocks, block_size)


def test_block_hash_format_by_hand():
    """Pins the wire format: the router and workers of different builds must agree."""
    digest = hashlib.blake2b(
        b"\x00" + (1).to_bytes(4, "little") + b"m" + struct.pack("<3q", 1, 2, 3), digest_size=8
    ).digest()
    first = int.from_bytes(digest, "little")
    assert hash_block(None, [1, 2, 3], salt="m") == first
    digest = hashlib.blake2b(
        b"\x01" + first.to_bytes(8, "little") + (1).to_bytes(4, "little") + b"m" + struct.pack("<3q", 4, 5, 6),
        digest_size=8,
    ).digest()
    assert block_hashes([1, 2, 3, 4, 5, 6, 7], 3, salt="m") == [first, int.from_bytes(digest, "little")]


def test_block_hashes_cover_full_blocks_only_and_chain():
    tokens = list(range(100, 111))  # 2 full blocks of 4 + a partial of 3
    hashes = block_hashes(tokens, 4, salt="m")
    assert len(hashes) == 2
    assert block_hashes(tokens[:8], 4, salt="m") == hashes
    assert block_hashes(tokens[:3], 4) == []
    assert hashes == [hash_block(None, tokens[:4], "m"), hash_block(hashes[0], tokens[4:8], "m")]
    assert block_hashes(tokens[4:], 4, salt="m", parent=hashes[0]) == hashes[1:]
    assert all(0 <= h < 2**64 for h in hashes)
    with pytest.raises(ValueError, match="block_size"):
        block_hashes(tokens, 0)


def test_block_hashes_depend_on_salt_and_every_earlier_token():
    tokens = list(range(16))
    hashes = block_hashes(tokens, 4, salt="model-a")
    assert block_hashes(list(tokens), 4, salt="model-a") == hashes
    assert set(block_hashes(tokens, 4, salt="model-b")).isdisjoint(hashes)
    changed = block_hashes([99] + tokens[1:], 4, salt="model-a")
    assert all(a != b for a, b in zip(changed, hashes))
    changed_late = block_hashes(tokens[:8] + [99] + tokens[9:], 4, salt="model-a")
    assert changed_late[:2] == hashes[:2] and changed_late[2] != hashes[2] and changed_late[3] != hashes[3]
    assert hash_block(0, [1]) != hash_block(None, [1])


def test_block_hashes_are_identical_in_another_process():
    tokens = list(range(1000, 1050))
    code = "from cache import block_hashes; print(block_hashes(list(range(1000, 1050)), 16, salt='smollm2'))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == str(block_hashes(tokens, 16, salt="smollm2"))


def test_cached_hashes_report_in_use_first_then_most_recently_freed():
    pool = BlockPool(num_blocks=8, block_size=4)
    a, b, c, d = pool.allocate(4)
    for block, block_hash in zip((a, b, c, d), (11, 12, 13, 14)):
        pool.cache_full_block(block, block_hash)
    pool.free([b])
    pool.free([c])
    assert pool.cached_hashes(10) == [11, 14, 13, 12]  # in use, then c (freed last), then b
    assert pool.cached_hashes(3) == [11, 14, 13]
    assert pool.cached_hashes(1) == [11]
    pool.allocate(4)  # reuses the free blocks from the head: b's cached content is evicted first
    assert 12 not in pool.cached_hashes(10)
