"""What this router has sent where: tokens in flight per replica, and the prompt blocks each
replica was sent (so it holds, or is computing, them).

The replicas' own reports (their cached block hashes, every stats period) are the truth about
what they hold, but lag by up to a period and show a prompt's blocks only once computed; the
sent record covers that gap. It counts a block as held while a request carrying it is in
flight there and for ``report_grace_s`` after, then leaves it to the reports: a replica that
once got a prompt on a detour and has since evicted it must not keep attracting that prefix.

Serve tells a ``RequestRouter`` about a request three times: when it chooses replicas for it,
when a replica accepts it (``on_request_routed``, one actor round trip later) and when it
completes. Charging load only on acceptance lets a burst of choices made within those few
milliseconds all see the same loads and pile onto one replica, so a choice is charged at
once, moved if the request lands on another replica, and released on completion. A request
cancelled before any replica accepted it gets no completion call: its charge is released at
the next choice once ``cancelled()`` says so, and in any case after ``pending_ttl_s``. That
also covers a caller that gives up after its replica was chosen but before the call was sent:
Serve neither cancels the (already resolved) choice nor reports a completion, so the TTL is
kept short; an acceptance that still comes after it is charged then (as "fallback").
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Hashable, Sequence

PENDING_TTL_S = 5.0  # how long a choice no replica accepted stays charged at most


@dataclasses.dataclass
class Charge:
    request_id: str
    replica: Hashable
    tokens: int
    reason: str  # why the policy chose this replica
    block_hashes: Sequence[int] = ()
    chosen_at: float = 0.0
    cancelled: Callable[[], bool] = lambda: False


@dataclasses.dataclass
class _Held:
    """One replica's claim on one block in the sent record."""

    in_flight: int = 0  # requests carrying the block that are chosen for or running there
    released_at: float = float("-inf")  # when the last of them completed


class RoutingLedger:
    """Charges are keyed by a ticket per routed call while pending, then by Serve's request id:
    the calls one HTTP request fans out to (several prompts, ``n``) share that id, and its
    completion callback names only the id and the replica, so each sibling keeps its own charge
    and a completion releases one of them on that replica."""

    def __init__(self, max_tracked_blocks: int = 200_000, pending_ttl_s: float = PENDING_TTL_S,
                 report_grace_s: float = 3.0, clock: Callable[[], float] = time.monotonic):
        self.max_tracked_blocks = max_tracked_blocks
        self.pending_ttl_s = pending_ttl_s
        self.report_grace_s = report_grace_s
        self.clock = clock
        self._pending: dict[Hashable, Charge] = {}  # ticket -> chosen, not yet accepted
        self._accepted: dict[str, list[Charge]] = {}  # request id -> running calls
        self._ended_unaccepted: dict[Hashable, Charge] = {}  # ticket -> call that ended before its acceptance came
        self._load: collections.Counter[Hashable] = collections.Counter()
        self._sent: collections.OrderedDict[int, dict[Hashable, _Held]] = collections.OrderedDict()  # LRU

    # -- events --------------------------------------------------------------------------------------
    def choose(self, request_id: str, replica: Hashable, tokens: int, block_hashes: Sequence[int], reason: str,
               cancelled: Callable[[], bool] = lambda: False, ticket: Hashable = None) -> None:
        """The policy picked ``replica``: charge it now and remember it holds the prompt's blocks.
        ``ticket`` names this call (default: the request id); a retried choice replaces the earlier one."""
        self._expire_pending()
        ticket = request_id if ticket is None else ticket
        self._drop_pending(ticket)
        self._ended_unaccepted.pop(ticket, None)  # a retry after a refusal
        self._pending[ticket] = Charge(request_id, replica, tokens, reason, block_hashes, self.clock(), cancelled)
        self._charge(replica, tokens, block_hashes)

    def withdraw(self, ticket: Hashable) -> None:
        """A choice about to be made again (Serve asks anew when its pick missed the probe
        or was full): take back the earlier one, so the request does not weigh on its own choice."""
        self._drop_pending(ticket)

    def accepted(self, request_id: str, replica: Hashable, tokens: int, block_hashes: Sequence[int],
                 ticket: Hashable = None) -> tuple[Hashable, str]:
        """``replica`` accepted the call; returns the replica the policy chose and why."""
        ticket = request_id if ticket is None else ticket
        ended = self._ended_unaccepted.pop(ticket, None)
        if ended is not None:  # it already completed (or was cancelled): nothing to charge
            return ended.replica, ended.reason
        charge = self._pending.pop(ticket, None)
        if charge is None:  # chosen without the policy (or the charge expired): charge it now
            charge = Charge(request_id, replica, tokens, "fallback", block_hashes)
            self._charge(replica, tokens, block_hashes)
        chosen, reason = charge.replica, charge.reason
        if chosen != replica:
            self._discharge(charge, ran=False)
            charge.replica = replica
            self._charge(replica, charge.tokens, charge.block_hashes)
        self._accepted.setdefault(request_id, []).append(charge)
        return chosen, reason

    def release(self, request_id: str, replica: Hashable = None) -> None:
        """A call of the request ended on ``replica`` (any, if None): its tokens no longer load it.

        Serve also reports the end of calls it never reported accepted: one the replica refused
        (a retry will choose again) and one that completed or was cancelled before its
        acceptance was processed (the acceptance may still follow; it is then ignored)."""
        charges = self._accepted.get(request_id, [])
        index = next((i for i, c in enumerate(charges) if replica is None or c.replica == replica), None)
        if index is not None:
            charge = charges.pop(index)
            if not charges:
                del self._accepted[request_id]
            self._discharge(charge)
            return
        mine = [t for t, c in self._pending.items() if c.request_id == request_id]
        ticket = next((t for t in mine if self._pending[t].replica == replica), mine[0] if mine else None)
        if ticket is not None:
            self._ended_unaccepted[ticket] = self._pending[ticket]
            self._drop_pending(ticket)

    def forget_replica(self, replica: Hashable) -> None:
        for holders in self._sent.values():
            holders.pop(replica, None)
        for ticket in [t for t, c in self._pending.items() if c.replica == replica]:
            self._drop_pending(ticket)
        for request_id in list(self._accepted):
            while any(c.replica == replica for c in self._accepted.get(request_id, ())):
                self.release(request_id, replica)

    # -- queries -------------------------------------------------------------------------------------
    def load(self, replica: Hashable) -> int:
        """Prompt + maximum output tokens of the requests this router has in flight there."""
        return self._load.get(replica, 0)

    def matched_blocks(self, replica: Hashable, block_hashes: Sequence[int]) -> int:
        """Leading prompt blocks this router sent to ``replica`` recently enough that its reports
        may not show them yet (a chain: stops at the first miss)."""
        recent = self.clock() - self.report_grace_s
        count = 0
        for block_hash in block_hashes:
            held = self._sent.get(block_hash, {}).get(replica)
            if held is None or (held.in_flight == 0 and held.released_at < recent):
                break
            count += 1
        return count

    def in_flight(self) -> int:
        """Calls chosen or running."""
        return len(self._pending) + sum(len(charges) for charges in self._accepted.values())

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _charge(self, replica: Hashable, tokens: int, block_hashes: Sequence[int]) -> None:
        self._load[replica] += tokens
        for block_hash in block_hashes:
            holders = self._sent.setdefault(block_hash, {})
            holders.setdefault(replica, _Held()).in_flight += 1
            self._sent.move_to_end(block_hash)
        while len(self._sent) > self.max_tracked_blocks:
            self._sent.popitem(last=False)

    def _discharge(self, charge: Charge, ran: bool = True) -> None:
        """Take ``charge`` off its replica; ``ran``: the replica may have computed its blocks."""
        self._load[charge.replica] -= charge.tokens
        if self._load[charge.replica] <= 0:
            del self._load[charge.replica]
        now = self.clock()
        for block_hash in charge.block_hashes:
            held = self._sent.get(block_hash, {}).get(charge.replica)
            if held is not None and held.in_flight > 0:
                held.in_flight -= 1
                if ran:
                    held.released_at = now

    def _drop_pending(self, ticket: Hashable) -> None:
        charge = self._pending.pop(ticket, None)
        if charge is not None:
            self._discharge(charge)

    def _expire_pending(self) -> None:
        deadline = self.clock() - self.pending_ttl_s
        for ticket, charge in list(self._pending.items()):
            if charge.chosen_at <= deadline or charge.cancelled():
                self._drop_pending(ticket)
        for ticket, charge in list(self._ended_unaccepted.items()):
            if charge.chosen_at <= deadline:
                del self._ended_unaccepted[ticket]
