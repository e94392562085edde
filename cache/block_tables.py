"""Per-sequence block tables over the shared ``BlockPool``: prefix-cache reuse, growth, COW, release.

The pool only counts blocks; this class knows which blocks a sequence holds, which of
them are full (and so hashable and shareable), and when a write would land in a block
another sequence still reads (copy-on-write after a fork).

Sliding-window attention: when every layer reads only the last ``window`` keys, the blocks
a sequence's next queries can no longer reach go back to the pool and its block-table entry
becomes the null block (released entries are always a leading run of the table: block index
i is position ``i * block_size`` onwards in every layer). A model that interleaves sliding and
full-attention layers (Gemma 2 and 3) keeps two KV groups, as vLLM's hybrid KV cache manager
does: the full-attention layers' table (``seq.block_ids``, every block kept) and the sliding
layers' (``seq.sliding_block_ids``, released behind the window), each over a pool of its own.
Both tables cover the same positions (one entry per ``block_size`` tokens); every operation
here applies to each group, and a sequence grows only when every group has the blocks.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from raylm.cache.block_hash import adapter_salt, hash_block
from raylm.cache.block_pool import NULL_BLOCK, BlockPool
from raylm.model.runtime.buckets import cdiv

if TYPE_CHECKING:  # the engine's sequence: this package only reads and sets its block ids
    from raylm.workers.core.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class PrefixLookup:
    """One prefix-cache lookup: how many full blocks were looked up and how many were cached."""

    queried_blocks: int
    hit_blocks: int


@dataclasses.dataclass
class KVGroup:
    """One KV group: the pool its blocks come from, the window its layers read (None: every
    key), and the block copies (copy-on-write) its layers need before the next step."""

    pool: BlockPool
    window: int | None
    copies: list[tuple[int, int]] = dataclasses.field(default_factory=list)


class BlockManager:
    """Allocates and frees the KV blocks of sequences; records block copies for the runner."""

    def __init__(self, pool: BlockPool, cache_salt: str = "", window: int | None = None,
                 sliding: tuple[BlockPool, int] | None = None):
        """``window``: keys a query reads in EVERY layer (a query at p reads p - window + 1 .. p)
        of the model and of any draft model sharing the block tables; None when some layer
        attends to the whole context (then no block of ``pool`` is released before its
        sequence ends). ``sliding``: the pool and window of the sliding layers' own KV group, for
        a model that interleaves them with full-attention layers (``pool`` then serves those)."""
        self.groups = [KVGroup(pool, window)]
        if sliding is not None:
            self.groups.append(KVGroup(*sliding))
        for group in self.groups:
            if group.window is not None and group.window < 1:
                raise ValueError(f"an attention window must be >= 1 token, got {group.window}")
            if group.pool.block_size != pool.block_size:
                raise ValueError("the KV groups' pools must have one block size")
        self.pool = pool
        self.block_size = pool.block_size
        self.salt = cache_salt
        self.window = window
        # With KV offload on, the (KV group, block id, hash) of each block computed full since the engine
        # last took them (``take_committed``): what it publishes to the tiers.
        self.record_commits = False
        self._committed: list[tuple[int, int, int]] = []

    @property
    def sliding(self) -> BlockPool | None:
        """The sliding layers' pool, when they keep a KV group of their own."""
        return self.groups[1].pool if len(self.groups) > 1 else None

    def _tables(self, seq: Sequence) -> list[list[int]]:
        """``seq``'s block table in each group (the lists themselves: changed in place)."""
        return [seq.block_ids, seq.sliding_block_ids][: len(self.groups)]

    # -- prefix cache ---------------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        """Make ``seq.block_hashes`` cover its first ``num_blocks`` full blocks of known tokens."""
        bs = self.block_size
        ids = None
        salt = adapter_salt(self.salt, None if seq.lora is None else seq.lora.cache_key)
        while len(seq.block_hashes) < num_blocks:
            ids = ids or seq.all_ids
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(hash_block(parent, ids[i * bs : (i + 1) * bs], salt))

    def reuse_cached_prefix(self, seq: Sequence) -> PrefixLookup | None:
        """Take the longest cached prefix of ``seq``'s known tokens into use; None if no lookup
        was made (prefix caching off, or ``seq`` already holds blocks, e.g. a fork).

        At least the last known token is always recomputed (its logits are needed), so a
        fully cached sequence reuses all but its last block. With a sliding KV group a prefix
        hits as far as the full-attention group caches it and the sliding group still caches
        the blocks its window reads from there on (``_sliding_hit``). The lookup is not counted
        in the pool's hit stats here: a sequence that cannot be admitted yet is looked up again
        next step, so the scheduler counts the lookup of its admission instead.
        """
        if not self.pool.enable_prefix_caching or seq.block_ids:
            return None
        usable = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, usable)
        found = [self.pool.find_cached_prefix(seq.block_hashes[:usable], record_stats=False)]
        if len(self.groups) > 1:
            found.append(self._sliding_hit(seq.block_hashes[: len(found[0])]))
        hits = len(found[-1])
        for group, table, blocks in zip(self.groups, self._tables(seq), found):
            table[:] = blocks[:hits]
            group.pool.touch([b for b in table if b != NULL_BLOCK])
        seq.num_computed_tokens = seq.num_committed_blocks = hits
        seq.num_computed_tokens *= self.block_size
        return PrefixLookup(usable, hits)

    def _sliding_hit(self, hashes: list[int]) -> list[int]:
        """The sliding group's table for the longest prefix of ``hashes`` (full blocks) whose
        blocks its window still reads after the prefix are all cached: the null block for the
        blocks before them (vLLM's rule for sliding-window prefix hits)."""
        group = self.groups[1]
        found = [group.pool.cached_block(h) for h in hashes]
        for hits in range(len(found), 0, -1):
            first = _num_out_of_window(group.window, hits * self.block_size, self.block_size)
            if None not in found[first:hits]:
                return [NULL_BLOCK] * first + found[first:hits]  # type: ignore[operator]
        return []

    def commit_computed_blocks(self, seq: Sequence) -> None:
        """Register hashes of blocks that are now full of computed tokens (future prefix hits)."""
        if not self.pool.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        self._extend_hashes(seq, full)
        for group, table in zip(self.groups, self._tables(seq)):
            for i in range(seq.num_committed_blocks, full):
                group.pool.cache_full_block(table[i], seq.block_hashes[i])
        if self.record_commits:  # (the sliding group releases its blocks after this: all are still held)
            self._committed += [(g, table[i], seq.block_hashes[i]) for g, table in enumerate(self._tables(seq))
                                for i in range(seq.num_committed_blocks, full)]
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)

    def take_committed(self) -> list[tuple[int, int, int]]:
        """The (KV group, block id, hash) of blocks computed full since the last call
        (``record_commits``), each block once: the engine reads them off the device before the
        next step may reuse them."""
        committed, self._committed = self._committed, []
        return [(g, block, h) for (g, block), h in {(g, block): h for g, block, h in committed}.items()]

    # -- blocks from an offload tier ------------------------------------------------------------------
    def sliding_to_load(self, first: int, end: int) -> range:
        """Of blocks ``first .. end - 1`` loaded from an offload tier, those whose sliding-group
        K/V the load must bring too: the ones the window of the query right after them (at
        ``end * block_size``) reads, as a prefix hit needs (``_sliding_hit``); the others stay
        the null block. Empty without a sliding group."""
        if len(self.groups) == 1:
            return range(end, end)
        window = self.groups[1].window
        return range(max(first, _num_out_of_window(window, end * self.block_size, self.block_size)), end)

    def reserve_for_load(self, seq: Sequence, held: int, sliding_held: list[bool] | None = None) -> int:
        """Append fresh blocks to ``seq``'s tables for the longest load of at most ``held``
        blocks after those it holds (which an offload tier holds) that the pools have free blocks
        for and, with a sliding group, whose ``sliding_to_load`` blocks the tiers hold too
        (``sliding_held``: per block after those ``seq`` holds); returns its block count, 0
        when there is none (then its prompt is computed instead)."""
        first = len(seq.block_ids)
        for num_blocks in range(min(held, self.pool.num_free_blocks), 0, -1):
            sliding = self.sliding_to_load(first, first + num_blocks)
            if sliding and (len(sliding) > self.groups[1].pool.num_free_blocks
                            or not all(sliding_held[i - first] for i in sliding)):
                continue
            seq.block_ids.extend(self.pool.allocate(num_blocks))
            if len(self.groups) > 1:  # (a null run inside the table while loading: ``adopt_loaded`` ends it)
                seq.sliding_block_ids.extend([NULL_BLOCK] * (sliding.start - first)
                                             + self.groups[1].pool.allocate(len(sliding)))
            return num_blocks
        return 0

    def adopt_loaded(self, seq: Sequence, first: int, num_loaded: int, num_sliding_loaded: int = 0) -> int:
        """A load into the blocks ``reserve_for_load`` appended after block ``first`` ended with
        the full group's first ``num_loaded`` blocks and the leading ``num_sliding_loaded`` of
        its ``sliding_to_load`` blocks; returns how many blocks after ``first`` now hold their
        tier's K/V in every group (the step about to run writes them before it computes): the
        most whose sliding blocks arrived, maybe none. They count as computed and enter the prefix
        cache; the blocks reserved beyond them go back, and so do the sliding group's blocks
        before the window of the query after them (released entries lead its table again)."""
        reserved = self.sliding_to_load(first, len(seq.block_ids))
        arrived = range(reserved.start, reserved.start + num_sliding_loaded)
        end = first + num_loaded
        while end > first and not _within(self.sliding_to_load(first, end), arrived):
            end -= 1
        for g, (group, table) in enumerate(zip(self.groups, self._tables(seq))):
            # (the first group releases behind its window, if it has one, as the sequence is admitted)
            keep = _num_out_of_window(group.window, end * self.block_size, self.block_size) if g else 0
            unneeded = [b for b in table[:keep] + table[end:] if b != NULL_BLOCK]
            if unneeded:
                group.pool.free(unneeded)
            table[:] = [NULL_BLOCK] * min(keep, end) + table[keep:end]
            for i in range(max(first, keep), end):
                group.pool.cache_full_block(table[i], seq.block_hashes[i])
        seq.num_computed_tokens = end * self.block_size
        seq.num_committed_blocks = end
        return end - first

    # -- growth -----------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int, group: int = 0) -> int:
        """Blocks of KV group ``group`` to allocate so ``seq`` can write ``num_new_tokens`` more
        tokens (COW included)."""
        table, pool = self._tables(seq)[group], self.groups[group].pool
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, total - len(table)) + len(self._shared_targets(seq, table, pool, num_new_tokens))

    def _shared_targets(self, seq: Sequence, table: list[int], pool: BlockPool, num_new_tokens: int) -> list[int]:
        """Indices of held blocks that the next write touches while another sequence shares them."""
        if num_new_tokens <= 0:
            return []
        first = seq.num_computed_tokens // self.block_size
        last = min(len(table), cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size))
        return [i for i in range(first, last) if pool.ref_count(table[i]) > 1]

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether every KV group has the blocks ``grow`` would take."""
        return all(self.blocks_needed(seq, num_new_tokens, g) <= group.pool.num_free_blocks
                   for g, group in enumerate(self.groups))

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` room for ``num_new_tokens`` more tokens; caller checked ``can_grow``."""
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        for group, table in zip(self.groups, self._tables(seq)):
            for i in self._shared_targets(seq, table, group.pool, num_new_tokens):
                (fresh,) = group.pool.allocate(1)
                group.copies.append((table[i], fresh))
                group.pool.free([table[i]])
                table[i] = fresh
            if total > len(table):
                table.extend(group.pool.allocate(total - len(table)))

    # -- sharing and release ----------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share the parent's computed prompt; it recomputes only the last prompt token."""
        upto = len(parent.prompt_ids) - 1
        for group, held, table in zip(self.groups, self._tables(parent), self._tables(child)):
            shared = held[: cdiv(upto, self.block_size)]
            # Only what the child's first query (at ``upto``) can read; the parent may still hold
            # more (it released as of its last chunk's start), and the child needs none of it.
            skipped = min(len(shared), _num_out_of_window(group.window, upto, self.block_size))
            group.pool.incref(shared[skipped:])
            table[:] = [NULL_BLOCK] * skipped + shared[skipped:]
        child.block_hashes = list(parent.block_hashes[: upto // self.block_size])
        child.num_computed_tokens = upto
        child.num_committed_blocks = upto // self.block_size

    def release_out_of_window(self, seq: Sequence, first_position: int) -> None:
        """Return the blocks that no query at ``first_position`` or later can read: in a group
        with a window, those whose last position is before ``first_position - window + 1``.
        ``first_position`` is the first position ``seq``'s next step computes (a draft model
        behind the target starts earlier). Their entries become the null block; the blocks stay
        cached, as any freed block does, until evicted. Nothing happens without a window."""
        for group, table in zip(self.groups, self._tables(seq)):
            end = min(len(table), _num_out_of_window(group.window, first_position, self.block_size))
            start = end
            while start > 0 and table[start - 1] != NULL_BLOCK:  # released entries lead the table
                start -= 1
            if start < end:
                group.pool.free(table[start:end])
                table[start:end] = [NULL_BLOCK] * (end - start)

    def max_blocks_held(self, num_new_tokens: int, group: int = 0) -> int | None:
        """The most blocks of KV group ``group`` one sequence holds at once when each step
        computes at most ``num_new_tokens`` of its tokens and the window releases the rest (a
        step's tokens plus the ``window`` keys before them, one position of draft lag included,
        at any alignment); None without a window (a sequence then holds a block per
        ``block_size`` tokens)."""
        window = self.groups[group].window
        if window is None:
            return None
        return cdiv(window + num_new_tokens, self.block_size) + 1

    def max_tokens(self, num_new_tokens: int) -> int | None:
        """The most tokens one sequence alone can keep K/V for, each step computing at most
        ``num_new_tokens`` of them: None when every group's window bounds what it holds
        within the group's pool, else the smallest pool without such a bound, in tokens."""
        limits = []
        for i, group in enumerate(self.groups):
            held = self.max_blocks_held(num_new_tokens, i)
            if held is None or held > group.pool.num_usable_blocks:
                limits.append(group.pool.num_usable_blocks * self.block_size)
        return min(limits, default=None)

    def max_prompt_tokens(self, num_new_tokens: int) -> int | None:
        """The longest prompt one sequence alone can be admitted with (its tokens and the first
        sampled token's K/V), computed ``num_new_tokens`` per step: None when
        every group's window bounds what it holds within the group's pool (then only the context
        limits it). What a replica reports to the router, which refuses longer prompts at once."""
        pool_tokens = self.max_tokens(num_new_tokens)
        return None if pool_tokens is None else pool_tokens - 1

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks (they stay reusable as cached prefix until evicted)."""
        for group, table in zip(self.groups, self._tables(seq)):
            held = [b for b in table if b != NULL_BLOCK]
            if held:
                group.pool.free(held)
            table.clear()
        seq.num_computed_tokens = seq.num_committed_blocks = 0

    def take_copies(self, group: int = 0) -> list[tuple[int, int]]:
        """The (src, dst) block copies KV group ``group``'s layers need before the next step
        (none for a group the model does not have)."""
        if group >= len(self.groups):
            return []
        copies, self.groups[group].copies = self.groups[group].copies, []
        return copies


def _within(inner: range, outer: range) -> bool:
    """Whether every index of ``inner`` is in ``outer`` (an empty ``inner`` always is)."""
    return not inner or (inner.start >= outer.start and inner.stop <= outer.stop)


def _num_out_of_window(window: int | None, first_position: int, block_size: int) -> int:
    """Leading blocks of a sequence that queries at ``first_position`` and later never read:
    block i's last position, ``(i + 1) * block_size - 1``, is before the window's first key."""
    if window is None:
        return 0
    return max(0, (first_position - window + 1) // block_size)
