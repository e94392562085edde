"""Sequences waiting for KV blocks from offload tiers: the scheduler's side of the connector.

A sequence admitted while an offload tier (cache/offload/) holds blocks of its prompt beyond
what the pool holds takes pool blocks for them and waits here while the connector's thread
reads them; other sequences keep stepping. When the load ends, the blocks that arrived count as
computed (and enter the prefix cache), the ones that did not go back to the pool, and the
sequence returns to the waiting queue with only the rest of its prompt to compute. The payloads
travel to the runner in the next step's plan, which writes them into the pool before computing.
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
        self._loading: dict[int, tuple[Sequence, int]] = {}  # ticket -> (sequence, its first loaded block)
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
        held = min(held, self.blocks.pool.num_free_blocks)
        if not held or not self.blocks.reserve_for_load(seq, held):
            return COMPUTE
        ticket = self.connector.start_load(wanted[:held])
        self._loading[ticket] = (seq, first)
        self._in_flight.update(dict.fromkeys(wanted[:held], ticket))
        seq.status = SequenceStatus.LOADING
        return LOADING

    def finish(self) -> tuple[list[Sequence], list[tuple[int, Any]]]:
        """The sequences whose loads ended (their blocks adopted, status waiting), and the
        (block id, payload) writes the next step must make before it computes."""
        if not self._loading:
            return [], []
        ready, writes = [], []
        for ticket, payloads in self.connector.poll().items():
            entry = self._loading.pop(ticket, None)
            if entry is None:
                continue
            seq, first = entry
            self._forget(ticket)
            seq.kv_load_fell_short = first + len(payloads) < len(seq.block_ids)
            self.blocks.adopt_loaded(seq, first, len(payloads))
            writes += zip(seq.block_ids[first:first + len(payloads)], payloads)
            loaded = len(payloads) * self.blocks.block_size
            self.num_loaded_tokens += loaded
            if seq.num_preemptions == 0:
                seq.num_cached_tokens += loaded
            seq.status = SequenceStatus.WAITING
            ready.append(seq)
        return ready, writes

    def cancel(self, seq: Sequence) -> None:
        """Forget ``seq``'s load (it ended); the caller frees its blocks."""
        for ticket, (loading, _) in list(self._loading.items()):
            if loading is seq:
                del self._loading[ticket]
                self._forget(ticket)
                self.connector.cancel(ticket)

    def _forget(self, ticket: int) -> None:
        """The blocks of load ``ticket`` are no longer in flight."""
        self._in_flight = {h: t for h, t in self._in_flight.items() if t != ticket}
