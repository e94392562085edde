"""Sequences waiting for KV blocks from offload tiers: the scheduler's side of the connector.

A sequence admitted while an offload tier (cache/offload/) holds blocks of its prompt beyond
what the pool holds takes pool blocks for them and waits here while the connector's thread
reads them; other sequences keep stepping. When the load ends, the blocks that arrived count as
computed (and enter the prefix cache), the ones that did not go back to the pool, and the
sequence returns to the waiting queue with only the rest of its prompt to compute. The payloads
travel to the runner in the next step's plan, which writes them into the pool before computing.

A model whose sliding-window layers keep a KV group of their own loads, besides the full
group's blocks, the sliding group's blocks that the window after the load's end reads, as the
pool's prefix cache needs for a hit (``BlockManager.sliding_to_load``): a load ends only where
the tiers hold both.
"""

from __future__ import annotations

from typing import Any

from raylm.cache.block_tables import BlockManager, PrefixLookup
from raylm.cache.offload.connector import KVConnector
from raylm.workers.core.sequence import Sequence, SequenceStatus

LOADING, WAIT, COMPUTE = "loading", "wait", "compute"  # what ``KVLoads.start`` did with a sequence


class KVLoads:
    """The loads in flight, by the connector's tickets."""

    def __init__(self, connector: KVConnector, blocks: BlockManager):
        self.connector = connector
        self.blocks = blocks
        # ticket -> (sequence, its first loaded block, the sliding group's blocks leading the load's run,
        # whether the tier held more blocks than the pool had free blocks for)
        self._loading: dict[int, tuple[Sequence, int, int, bool]] = {}
        self._in_flight: dict[int, int] = {}  # block hash -> the ticket loading it
        self.num_loaded_tokens = 0  # prompt tokens loaded instead of computed, lifetime
        self.num_queried_tokens = 0  # prompt tokens looked up in the tiers (beyond the pool's hits), lifetime

    def __len__(self) -> int:
        return len(self._loading)

    def start(self, seq: Sequence, lookup: PrefixLookup) -> str:
        """Start loading the blocks of ``seq``'s prompt that follow its pool hits and a tier
        holds (of the blocks ``lookup`` covered: all but the last token's, as for pool hits), as
        many as the pool has free blocks for. Returns ``LOADING`` (the caller takes it out of the
        waiting queue), ``WAIT`` when another sequence is loading some of those blocks already
        (it is admitted once they are in the pool: one load per block, however many prompts
        share it), or ``COMPUTE`` when no tier holds the next block or the pool has none free
        (admitted as usual, as it always is after a load of its that fell short: a tier that
        lists blocks it cannot read would have it load forever)."""
        if seq.kv_load_fell_short:
            return COMPUTE
        first = len(seq.block_ids)
        wanted = seq.block_hashes[first:lookup.queried_blocks]
        held = self.connector.lookup(wanted) if wanted else 0
        if any(block_hash in self._in_flight for block_hash in wanted[:held]):
            return WAIT
        if not seq.kv_queried and seq.num_preemptions == 0:  # once per request, as the pool counts
            seq.kv_queried = True
            self.num_queried_tokens += len(wanted) * self.blocks.block_size
        sliding_held = self.connector.held(wanted[:held], group=1) if held and self.blocks.sliding is not None else None
        reserved = self.blocks.reserve_for_load(seq, held, sliding_held) if held else 0
        if not reserved:
            return COMPUTE
        sliding = self.blocks.sliding_to_load(first, first + reserved)
        ticket = self.connector.start_load(wanted[:reserved], [seq.block_hashes[i] for i in sliding])
        self._loading[ticket] = (seq, first, len(sliding), reserved < held)
        self._in_flight.update(dict.fromkeys(wanted[:reserved], ticket))
        seq.status = SequenceStatus.LOADING
        return LOADING

    def finish(self) -> tuple[list[Sequence], list[tuple[int, Any]], list[tuple[int, Any]]]:
        """The sequences whose loads ended (their blocks adopted, status waiting), and the
        (block id, payload) writes the next step must make before it computes, into the full
        group's pool and the sliding group's."""
        if not self._loading:
            return [], [], []
        ready, writes, sliding_writes = [], [], []
        for ticket, payloads in self.connector.poll().items():
            entry = self._loading.pop(ticket, None)
            if entry is None:
                continue
            seq, first, num_sliding, capped = entry
            self._forget(ticket)
            reserved = len(seq.block_ids) - first
            sliding_from = self.blocks.sliding_to_load(first, len(seq.block_ids)).start
            arrived = payloads[num_sliding:]
            num_loaded = self.blocks.adopt_loaded(seq, first, len(arrived), len(payloads[:num_sliding]))
            seq.kv_load_fell_short = num_loaded < reserved
            seq.kv_load_capped = capped and not seq.kv_load_fell_short
            writes += zip(seq.block_ids[first:first + num_loaded], arrived)
            sliding_writes += [(seq.sliding_block_ids[i], payloads[i - sliding_from])
                               for i in self.blocks.sliding_to_load(first, first + num_loaded)]
            self.num_loaded_tokens += num_loaded * self.blocks.block_size
            seq.status = SequenceStatus.WAITING
            ready.append(seq)
        return ready, writes, sliding_writes

    def resumed_lookup(self, seq: Sequence) -> PrefixLookup | None:
        """The lookup that resumes the load of a sequence back from one the pool's free blocks
        cut short (it holds the blocks loaded so far): its next admission loads the tier's further
        blocks too, instead of computing them. None for any other sequence."""
        if not (seq.kv_load_capped and seq.block_ids):
            return None
        seq.kv_load_capped = False
        return PrefixLookup((seq.num_tokens - 1) // self.blocks.block_size, len(seq.block_ids))

    def cancel(self, seq: Sequence) -> None:
        """Forget ``seq``'s load (it ended); the caller frees its blocks."""
        for ticket, (loading, *_) in list(self._loading.items()):
            if loading is seq:
                del self._loading[ticket]
                self._forget(ticket)
                self.connector.cancel(ticket)

    def _forget(self, ticket: int) -> None:
        """The blocks of load ``ticket`` are no longer in flight."""
        self._in_flight = {h: t for h, t in self._in_flight.items() if t != ticket}
