"""Per-sequence block tables over the shared ``BlockPool``: prefix-cache reuse, growth, COW, release.

The pool only counts blocks; this class knows which blocks a sequence holds, which of
them are full (and so hashable and shareable), and when a write would land in a block
another sequence still reads (copy-on-write after a fork).

Sliding-window attention: when every layer reads only the last ``window`` keys, the blocks
a sequence's next queries can no longer reach go back to the pool and its block-table entry
becomes the null block (released entries are always a leading run of the table: block index
i is position ``i * block_size`` onwards in every layer, so one table serves all layers only
because all of them slide). A model with any full-attention layer keeps every block.
"""

from __future__ import annotations

import dataclasses

from cache import NULL_BLOCK, BlockPool, adapter_salt, hash_block
from model.buckets import cdiv
from workers.sequence import Sequence


@dataclasses.dataclass(frozen=True)
class PrefixLookup:
    """One prefix-cache lookup: how many full blocks were looked up and how many were cached."""

    queried_blocks: int
    hit_blocks: int


class BlockManager:
    """Allocates and frees the KV blocks of sequences; records block copies for the runner."""

    def __init__(self, pool: BlockPool, cache_salt: str = "", window: int | None = None):
        """``window``: keys a query reads in EVERY layer (a query at p reads p - window + 1 .. p)
        of the model and of any draft model sharing the block tables; None when some layer
        attends to the whole context (then no block is released before its sequence ends)."""
        if window is not None and window < 1:
            raise ValueError(f"an attention window must be >= 1 token, got {window}")
        self.pool = pool
        self.block_size = pool.block_size
        self.salt = cache_salt
        self.window = window
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) device copies before next step

    # -- prefix cache ---------------------------------------------------------------------
    def _extend_hashes(self, seq: Sequence, num_blocks: int) -> None:
        """Make ``seq.block_hashes`` cover its first ``num_blocks`` full blocks of known tokens."""
        bs = self.block_size
        ids = None
        salt = adapter_salt(self.salt, None if seq.lora is None else seq.lora.lora_name)
        while len(seq.block_hashes) < num_blocks:
            ids = ids or seq.all_ids
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            seq.block_hashes.append(hash_block(parent, ids[i * bs : (i + 1) * bs], salt))

    def reuse_cached_prefix(self, seq: Sequence) -> PrefixLookup | None:
        """Take the longest cached prefix of ``seq``'s known tokens into use; None if no lookup
        was made (prefix caching off, or ``seq`` already holds blocks, e.g. a fork).

        At least the last known token is always recomputed (its logits are needed), so a
        fully cached sequence reuses all but its last block. The lookup is not counted in the
        pool's hit stats here: a sequence that cannot be admitted yet is looked up again next
        step, so the scheduler counts the lookup of its admission instead.
        """
        if not self.pool.enable_prefix_caching or seq.block_ids:
            return None
        usable = (seq.num_tokens - 1) // self.block_size
        self._extend_hashes(seq, usable)
        hits = self.pool.find_cached_prefix(seq.block_hashes[:usable], record_stats=False)
        if hits:
            self.pool.touch(hits)
            seq.block_ids = list(hits)
        seq.num_computed_tokens = seq.num_committed_blocks = len(hits)
        seq.num_computed_tokens *= self.block_size
        return PrefixLookup(usable, len(hits))

    def commit_computed_blocks(self, seq: Sequence) -> None:
        """Register hashes of blocks that are now full of computed tokens (future prefix hits)."""
        if not self.pool.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        self._extend_hashes(seq, full)
        for i in range(seq.num_committed_blocks, full):
            self.pool.cache_full_block(seq.block_ids[i], seq.block_hashes[i])
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)

    # -- growth -----------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to allocate so ``seq`` can write ``num_new_tokens`` more tokens (COW included)."""
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        new = max(0, total - len(seq.block_ids))
        return new + len(self._shared_targets(seq, num_new_tokens))

    def _shared_targets(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Indices of held blocks that the next write touches while another sequence shares them."""
        if num_new_tokens <= 0:
            return []
        first = seq.num_computed_tokens // self.block_size
        last = min(len(seq.block_ids), cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size))
        return [i for i in range(first, last) if self.pool.ref_count(seq.block_ids[i]) > 1]

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.pool.num_free_blocks

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` room for ``num_new_tokens`` more tokens; caller checked ``can_grow``."""
        for i in self._shared_targets(seq, num_new_tokens):
            (fresh,) = self.pool.allocate(1)
            self.pending_copies.append((seq.block_ids[i], fresh))
            self.pool.free([seq.block_ids[i]])
            seq.block_ids[i] = fresh
        total = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        if total > len(seq.block_ids):
            seq.block_ids.extend(self.pool.allocate(total - len(seq.block_ids)))

    # -- sharing and release ----------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share the parent's computed prompt; it recomputes only the last prompt token."""
        upto = len(parent.prompt_ids) - 1
        shared = parent.block_ids[: cdiv(upto, self.block_size)]
        # Only what the child's first query (at ``upto``) can read; the parent may still hold
        # more (it released as of its last chunk's start), and the child needs none of it.
        skipped = min(len(shared), self._num_out_of_window(upto))
        self.pool.incref(shared[skipped:])
        child.block_ids = [NULL_BLOCK] * skipped + shared[skipped:]
        child.block_hashes = list(parent.block_hashes[: upto // self.block_size])
        child.num_computed_tokens = upto
        child.num_committed_blocks = upto // self.block_size

    def release_out_of_window(self, seq: Sequence, first_position: int) -> None:
        """Return the blocks that no query at ``first_position`` or later can read: with a window,
        those whose last position is before ``first_position - window + 1``. ``first_position``
        is the first position ``seq``'s next step computes (a draft model behind the target
        starts earlier). Their entries become the null block; the blocks stay cached, as any
        freed block does, until evicted. Nothing happens without a window."""
        end = min(len(seq.block_ids), self._num_out_of_window(first_position))
        start = end
        while start > 0 and seq.block_ids[start - 1] != NULL_BLOCK:  # released entries lead the table
            start -= 1
        if start < end:
            self.pool.free(seq.block_ids[start:end])
            seq.block_ids[start:end] = [NULL_BLOCK] * (end - start)

    def _num_out_of_window(self, first_position: int) -> int:
        """Leading blocks of a sequence that queries at ``first_position`` and later never read:
        block i's last position, ``(i + 1) * block_size - 1``, is before the window's first key."""
        if self.window is None:
            return 0
        return max(0, (first_position - self.window + 1) // self.block_size)

    def max_blocks_held(self, num_new_tokens: int) -> int | None:
        """The most blocks one sequence holds at once when each step computes at most
        ``num_new_tokens`` of its tokens and the window releases the rest (a step's tokens plus
        the ``window`` keys before them, one position of draft lag included, at any alignment);
        None without a window (a sequence then holds a block per ``block_size`` tokens)."""
        if self.window is None:
            return None
        return cdiv(self.window + num_new_tokens, self.block_size) + 1

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks (they stay reusable as cached prefix until evicted)."""
        held = [b for b in seq.block_ids if b != NULL_BLOCK]
        if held:
            self.pool.free(held)
        seq.block_ids = []
        seq.num_computed_tokens = seq.num_committed_blocks = 0

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies
