"""What this router has sent where: tokens in flight per replica, and the prompt blocks each
replica was sent (so it holds, or is computing, them).

Serve tells a ``RequestRouter`` about a request three times: when it chooses replicas for it,
when a replica accepts it (``on_request_routed``, one actor round trip later) and when it
completes. Charging load only on acceptance lets a burst of choices made within those few
milliseconds all see the same loads and pile onto one replica, so a choice is charged at
once, moved if the request lands on another replica, and released on completion. A request
cancelled before any replica accepted it gets no completion call: its charge is released at
the next choice once ``cancelled()`` says so, and in any case after ``pending_ttl_s``.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Hashable, Sequence


@dataclasses.dataclass
class Charge:
    replica: Hashable
    tokens: int
    reason: str  # why the policy chose this replica
    cancelled: Callable[[], bool] = lambda: False


class RoutingLedger:
    def __init__(self, max_tracked_blocks: int = 200_000, pending_ttl_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_tracked_blocks = max_tracked_blocks
        self.pending_ttl_s = pending_ttl_s
        self.clock = clock
        self._charges: dict[str, Charge] = {}
        self._pending: dict[str, float] = {}  # chosen, not yet accepted: when it was chosen
        self._load: collections.Counter[Hashable] = collections.Counter()
        self._sent: collections.OrderedDict[int, set[Hashable]] = collections.OrderedDict()  # LRU

    # -- events --------------------------------------------------------------------------------------
    def choose(self, request_id: str, replica: Hashable, tokens: int, block_hashes: Sequence[int], reason: str,
               cancelled: Callable[[], bool] = lambda: False) -> None:
        """The policy picked ``replica``: charge it now and remember it holds the prompt's blocks."""
        self._expire_pending()
        self.release(request_id)  # a retried choice replaces the earlier one
        self._charges[request_id] = Charge(replica, tokens, reason, cancelled)
        self._pending[request_id] = self.clock()
        self._load[replica] += tokens
        self._record_blocks(replica, block_hashes)

    def accepted(self, request_id: str, replica: Hashable, tokens: int, block_hashes: Sequence[int]) -> tuple[Hashable, str]:
        """``replica`` accepted the request; returns the replica the policy chose and why."""
        self._pending.pop(request_id, None)
        charge = self._charges.get(request_id)
        if charge is None:  # chosen without the policy (or the charge expired): charge it now
            charge = self._charges[request_id] = Charge(replica, tokens, "fallback")
            self._load[replica] += tokens
        chosen, reason = charge.replica, charge.reason
        if chosen != replica:
            self._move(charge, replica)
            self._record_blocks(replica, block_hashes)
        return chosen, reason

    def release(self, request_id: str) -> None:
        """The request completed (or was cancelled): its tokens no longer load the replica."""
        self._pending.pop(request_id, None)
        charge = self._charges.pop(request_id, None)
        if charge is not None:
            self._discharge(charge.replica, charge.tokens)

    def forget_replica(self, replica: Hashable) -> None:
        for owners in self._sent.values():
            owners.discard(replica)
        for request_id in [rid for rid, c in self._charges.items() if c.replica == replica]:
            self.release(request_id)

    # -- queries -------------------------------------------------------------------------------------
    def load(self, replica: Hashable) -> int:
        """Prompt + maximum output tokens of the requests this router has in flight there."""
        return self._load.get(replica, 0)

    def matched_blocks(self, replica: Hashable, block_hashes: Sequence[int]) -> int:
        """Leading prompt blocks this router sent to ``replica`` (a chain: stops at the first miss)."""
        count = 0
        for block_hash in block_hashes:
            if replica not in self._sent.get(block_hash, ()):
                break
            count += 1
        return count

    def in_flight(self) -> int:
        return len(self._charges)

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _record_blocks(self, replica: Hashable, block_hashes: Sequence[int]) -> None:
        for block_hash in block_hashes:
            self._sent.setdefault(block_hash, set()).add(replica)
            self._sent.move_to_end(block_hash)
        while len(self._sent) > self.max_tracked_blocks:
            self._sent.popitem(last=False)

    def _move(self, charge: Charge, replica: Hashable) -> None:
        self._discharge(charge.replica, charge.tokens)
        charge.replica = replica
        self._load[replica] += charge.tokens

    def _discharge(self, replica: Hashable, tokens: int) -> None:
        self._load[replica] -= tokens
        if self._load[replica] <= 0:
            del self._load[replica]

    def _expire_pending(self) -> None:
        deadline = self.clock() - self.pending_ttl_s
        for request_id, since in list(self._pending.items()):
            if since <= deadline or self._charges[request_id].cancelled():
                self.release(request_id)
