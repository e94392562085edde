"""Host-side bookkeeping of the paged KV pool: ref counts, free queue, prefix cache.

Modelled on vLLM v1's block pool. Block 0 is the null block (padding writes there) and
is never handed out. A block is *in use* while its ref count is > 0; otherwise it sits
in the free queue. The free queue doubles as the LRU eviction order: a freed block
keeps its cached hash (its K/V stay valid) until ``allocate`` takes it from the head
for new data, so recently freed prefixes are reused before they are overwritten.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict
from collections.abc import Sequence

NULL_BLOCK = 0


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool's counts: blocks, and lifetime prefix-cache lookups in prompt tokens
    (looked up, and found cached), as vLLM counts them."""

    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    num_usable_blocks: int
    usage: float  # fraction of usable blocks in use
    prefix_queries: int
    prefix_hits: int


class NoFreeBlocksError(RuntimeError):
    """Fewer free blocks than requested; the scheduler should wait or preempt."""


class BlockPool:
    """Ref-counted KV blocks with a prefix cache keyed by chained block hashes.

    Invariants: free + used == usable; a block with ref > 0 is never in the free queue
    and its cached hash is never evicted; ref counts are never negative.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be >= 2 (block 0 is the reserved null block), got {num_blocks}; "
                "give the KV pool more memory"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._block_of_hash: dict[int, int] = {}
        # Ordered head (evicted first) -> tail (most recently freed); values unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._num_used = 0
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- allocation -----------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue (least recently freed).

        A taken block that still held a cached prefix is about to be overwritten, so its
        hash leaves the cache. All or nothing: on shortage nothing is allocated.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise NoFreeBlocksError(f"requested {n} KV blocks but only {len(self._free)} are free")
        block_ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref[block_id] = 1
            block_ids.append(block_id)
        self._num_used += n
        return block_ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the free queue's tail.

        Pass a sequence's blocks first..last: they are queued in reverse so its tail
        blocks (least likely to be shared as a prefix) are evicted before its prefix.
        Freeing an unreferenced block is a double free and raises; nothing changes then.
        """
        for block_id, count in Counter(block_ids).items():
            self._check_id(block_id)
            if self._ref[block_id] < count:
                raise ValueError(
                    f"double free: block {block_id} has ref count {self._ref[block_id]} "
                    f"but is freed {count} time(s)"
                )
        for block_id in reversed(block_ids):
            self._ref[block_id] -= 1
            if self._ref[block_id] == 0:
                self._free[block_id] = None
                self._num_used -= 1

    def incref(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block: share it (forked sequences) or revive it.

        A free block is revived only if it holds a cached prefix (its K/V are still
        valid); it leaves the free queue so it cannot be evicted while in use. Reviving a
        free uncached block would read garbage, so that raises and nothing changes.
        """
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref[block_id] == 0 and self._hash_of[block_id] is None:
                raise ValueError(
                    f"block {block_id} is free and holds no cached prefix; allocate() new blocks instead"
                )
        for block_id in block_ids:
            if self._ref[block_id] == 0:
                del self._free[block_id]
                self._num_used += 1
            self._ref[block_id] += 1

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take cached blocks found by ``find_cached_prefix`` into use (same as ``incref``).

        Call it before allocating the request's new blocks: ``allocate`` may evict them.
        """
        self.incref(block_ids)

    def ref_count(self, block_id: int) -> int:
        """Number of sequences currently holding the block (0 for free and null blocks)."""
        return self._ref[block_id]

    # -- prefix cache ---------------------------------------------------------------

    def cache_full_block(self, block_id: int, block_hash: int) -> None:
        """Record that in-use ``block_id`` now holds a full block of tokens with ``block_hash``.

        If another block already holds that hash, the existing mapping is kept and this
        block stays uncached (a duplicate; it is simply reused for new data once freed).
        """
        if not self.enable_prefix_caching:
            return
        self._check_id(block_id)
        if self._ref[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only in-use blocks can be cached")
        current = self._hash_of[block_id]
        if current is not None:
            if current != block_hash:
                raise ValueError(
                    f"block {block_id} already caches hash {current:#x}; a full block's tokens "
                    f"cannot change to hash {block_hash:#x}"
                )
            return
        if block_hash in self._block_of_hash:
            return
        self._hash_of[block_id] = block_hash
        self._block_of_hash[block_hash] = block_id

    def find_cached_prefix(self, hashes: Sequence[int], record_stats: bool = True) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``; ref counts are unchanged.

        With ``record_stats`` the lookup counts toward ``prefix_queries``/``prefix_hits`` as the
        full blocks' tokens; pass False for probes (e.g. retrying admission) to avoid double
        counts, and count the lookup acted on with ``record_prefix_lookup``.
        """
        found = []
        for block_hash in hashes:
            block_id = self._block_of_hash.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        if record_stats:
            self.record_prefix_lookup(len(hashes) * self.block_size, len(found) * self.block_size)
        return found

    def cached_block(self, block_hash: int) -> int | None:
        """The block that caches ``block_hash`` (in use or free), or None; ref counts unchanged."""
        return self._block_of_hash.get(block_hash)

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup made earlier without ``record_stats``, in tokens: the prompt tokens
        looked up (all of them, the partial last block's too) and those found cached. A caller
        that probes until it can act on the result counts only the lookup it acted on."""
        self.prefix_queries += num_queried_tokens
        self.prefix_hits += num_hit_tokens

    def block_hash(self, block_id: int) -> int | None:
        """The hash the block currently caches, or None."""
        return self._hash_of[block_id]

    def reset_prefix_cache(self) -> bool:
        """Forget the prefixes cached in free blocks (e.g. after a weight update).

        In-use blocks keep their hashes: their sequences still depend on them. Always
        returns True (vLLM's signature, where the reset can be refused).
        """
        for block_id in self._free:
            self._evict(block_id)
        return True

    # -- accounting -----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now, including free blocks that still cache a prefix."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref count > 0 (the null block is never counted)."""
        return self._num_used

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a registered hash, in use or free."""
        return len(self._block_of_hash)

    @property
    def num_usable_blocks(self) -> int:
        """All blocks except the null block."""
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (cached-free blocks count as free)."""
        return self._num_used / self.num_usable_blocks

    def cached_hashes(self, limit: int) -> list[int]:
        """Up to ``limit`` hashes of cached blocks, those in use first, then free ones from the
        most recently freed: what a router should know this pool holds (bounded, since it is
        shipped with every routing-stats report)."""
        in_use = [h for h, b in self._block_of_hash.items() if self._ref[b] > 0]
        if len(in_use) >= limit:
            return in_use[:limit]
        free = []
        for block_id in reversed(self._free):
            if len(in_use) + len(free) >= limit:
                break
            block_hash = self._hash_of[block_id]
            if block_hash is not None:
                free.append(block_hash)
        return in_use + free

    def stats(self) -> PoolStats:
        """Counts for metrics and routing: block usage and prefix-cache queries/hits."""
        return PoolStats(self.num_free_blocks, self.num_used_blocks, self.num_cached_blocks, self.num_usable_blocks,
                         self.usage, self.prefix_queries, self.prefix_hits)

    # -- internals ------------------------------------------------------------------

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            del self._block_of_hash[block_hash]
            self._hash_of[block_id] = None

    def _check_id(self, block_id: int) -> None:
        if block_id == NULL_BLOCK:
            raise ValueError("block 0 is the reserved null block; it is never allocated, freed or shared")
        if not 0 < block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range 1..{self.num_blocks - 1}")
