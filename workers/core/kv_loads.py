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


class KVLoads:
    """The loads in flight, by the connector's tickets."""

    def __init__(self, connector: KVConnector, blocks: BlockManager):
        self.connector = connector
        self.blocks = blocks
        self._loading: dict[int, tuple[Sequence, int]] = {}  # ticket -> (sequence, its first loaded block)
        self.num_loaded_tokens = 0  # prompt tokens loaded instead of computed, lifetime
        self.num_queried_tokens = 0  # prompt tokens looked up in the tiers (beyond the pool's hits), lifetime

    def __len__(self) -> int:
        return len(self._loading)

    def start(self, seq: Sequence, lookup: PrefixLookup) -> bool:
        """Start loading the blocks of ``seq``'s prompt that follow its pool hits and a tier
        holds (of the blocks ``lookup`` covered: all but the last token's, as for pool hits);
        False when no tier holds the next one or the pool lacks free blocks for them (then it is
        admitted as usual, as it always is after a load of its that fell short: a tier that lists
        blocks it cannot read would have it load forever). The caller takes it out of the waiting
        queue."""
        if seq.kv_load_fell_short:
            return False
        first = len(seq.block_ids)
        wanted = seq.block_hashes[first:lookup.queried_blocks]
        held = self.connector.lookup(wanted) if wanted else 0
        if seq.num_preemptions == 0:  # counted once per request, as the pool's lookups are
            self.num_queried_tokens += len(wanted) * self.blocks.block_size
        if not held or not self.blocks.reserve_for_load(seq, held):
            return False
        self._loading[self.connector.start_load(wanted[:held])] = (seq, first)
        seq.status = SequenceStatus.LOADING
        return True

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
                self.connector.cancel(ticket)
