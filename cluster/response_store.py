"""Where ``/v1/responses`` keeps stored responses, so ``previous_response_id`` works whichever
router replica takes the next turn.

Every router replica of an application talks to one named, detached Ray actor: it outlives
the replica that created it (and any replica's restart), and holds the records in memory,
bounded by bytes and by age (the deploy file's ``router.responses_store``), oldest evicted
first. The actor keeps a ``MemoryResponseStore``, the same class a router alone uses
in-process, so both have one set of semantics.

Records are JSON text, owned by the API key that stored them: a record is visible only to its
owner (any other owner gets None, exactly as for an id that does not exist). A background
response's stream events are kept beside the text, as a list, so its replica's flushes and
resumed streams' polls never parse or re-write the record.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from typing import Any, Callable, Protocol

from raylm.cluster.adapter_store import NAMESPACE


class ResponseStore(Protocol):
    """Stored responses by id, per owner; every call may block (run it off the event loop)."""

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> bool:
        """Store (or replace) a record; False when it alone exceeds the store's byte bound."""

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None: ...

    def replace(self, owner: str, response_id: str, record: dict[str, Any], status: str) -> bool:
        """Replace a record only while its response's status is ``status`` (atomically: a background
        response's end and its cancellation cannot both win); False, and nothing changed, otherwise."""

    def delete(self, owner: str, response_id: str) -> bool:
        """Forget a record; False when ``owner`` has no record of that id."""

    def append_events(self, owner: str, response_id: str, events: list[str], alive_at: float) -> bool:
        """Add a background response's next stream events to its record (``events``) and say when
        its replica last lived (``alive_at``), only while it is ``in_progress``; False otherwise.
        The replica sends only the new events, so a long reply costs its events once, not once per
        flush."""

    def events_after(self, owner: str, response_id: str, after: int) -> dict[str, Any] | None:
        """A background response's stream events past sequence number ``after`` (``events``), its
        ``status`` and ``alive_at``: what a resumed stream reads, without the rest of the record."""


@dataclasses.dataclass
class _Entry:
    """One record: its JSON text without the two fields a background response's replica updates
    every flush (its stream ``events``, kept as the list of their SSE texts, and ``alive_at``), so
    a flush appends to the list and a resumed stream slices it, and neither parses nor re-writes
    the record: a long reply's events are not re-serialized five times a second."""

    owner: str
    stored_at: float
    text: str
    status: str | None
    events: list[str] | None
    alive_at: float | None
    nbytes: int  # the text's and the events' characters: what the byte bound counts


class MemoryResponseStore:
    """Records in this process, at most ``max_bytes`` (of JSON text, and of stream events'
    texts) and ``max_age_s`` old."""

    def __init__(self, max_bytes: int, max_age_s: float, clock: Callable[[], float] = time.time):
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._clock = clock
        self._entries: collections.OrderedDict[str, _Entry] = collections.OrderedDict()  # oldest first
        self.bytes = 0

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> bool:
        rest = {key: value for key, value in record.items() if key not in ("events", "alive_at")}
        events = record.get("events")
        text = json.dumps(rest, separators=(",", ":"))
        nbytes = len(text) + sum(len(event) for event in events or ())
        if nbytes > self.max_bytes:
            return False
        self._drop(response_id)
        self._entries[response_id] = _Entry(owner, self._clock(), text, (record.get("response") or {}).get("status"),
                                            list(events) if events is not None else None, record.get("alive_at"),
                                            nbytes)
        self.bytes += nbytes
        self._evict()
        return True

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        entry = self._entry(owner, response_id)
        if entry is None:
            return None
        record = json.loads(entry.text)
        if entry.events is not None:
            record["events"] = list(entry.events)
        if entry.alive_at is not None:
            record["alive_at"] = entry.alive_at
        return record

    def replace(self, owner: str, response_id: str, record: dict[str, Any], status: str) -> bool:
        current = self._entry(owner, response_id)
        if current is None or current.status != status:
            return False
        return self.put(owner, response_id, record)

    def append_events(self, owner: str, response_id: str, events: list[str], alive_at: float) -> bool:
        current = self._entry(owner, response_id)
        if current is None or current.status != "in_progress":
            return False
        added = sum(len(event) for event in events)
        if current.nbytes + added > self.max_bytes:
            return False
        if current.events is None:
            current.events = []
        current.events.extend(events)  # get() hands out copies, so the list is this store's alone
        current.nbytes += added
        current.stored_at, current.alive_at = self._clock(), alive_at
        self._entries.move_to_end(response_id)  # the newest record again, as a put would make it
        self.bytes += added
        self._evict()
        return True

    def events_after(self, owner: str, response_id: str, after: int) -> dict[str, Any] | None:
        entry = self._entry(owner, response_id)
        if entry is None:
            return None
        return {"status": entry.status, "alive_at": entry.alive_at or 0.0, "events": (entry.events or [])[after + 1:]}

    def delete(self, owner: str, response_id: str) -> bool:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return False
        self._drop(response_id)
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, owner: str, response_id: str) -> _Entry | None:
        self._evict()
        entry = self._entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.nbytes

    def _evict(self) -> None:
        """Drop records past their age, then the oldest until the rest fit the byte bound."""
        oldest_kept = self._clock() - self.max_age_s
        while self._entries:
            response_id, entry = next(iter(self._entries.items()))
            if entry.stored_at >= oldest_kept and self.bytes <= self.max_bytes:
                break
            self._drop(response_id)


class _StoreActor:
    """The cluster's store: a ``MemoryResponseStore`` in a detached actor."""

    def __init__(self, max_bytes: int, max_age_s: float):
        self.store = MemoryResponseStore(max_bytes, max_age_s)

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> bool:
        return self.store.put(owner, response_id, record)

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        return self.store.get(owner, response_id)

    def replace(self, owner: str, response_id: str, record: dict[str, Any], status: str) -> bool:
        return self.store.replace(owner, response_id, record, status)

    def delete(self, owner: str, response_id: str) -> bool:
        return self.store.delete(owner, response_id)

    def append_events(self, owner: str, response_id: str, events: list[str], alive_at: float) -> bool:
        return self.store.append_events(owner, response_id, events, alive_at)

    def events_after(self, owner: str, response_id: str, after: int) -> dict[str, Any] | None:
        return self.store.events_after(owner, response_id, after)

    def held(self) -> tuple[int, int]:
        return self.store.bytes, len(self.store)


class RayResponseStore:
    """The store of the application ``app_name``: its named detached actor, created by the first
    router replica that asks for it (with that replica's limits) and found by every other."""

    def __init__(self, app_name: str, max_bytes: int, max_age_s: float):
        import ray

        self._actor = ray.remote(_StoreActor).options(
            name=f"responses/{app_name}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        ).remote(max_bytes, max_age_s)

    def put(self, owner: str, response_id: str, record: dict[str, Any]) -> bool:
        import ray

        return ray.get(self._actor.put.remote(owner, response_id, record))

    def get(self, owner: str, response_id: str) -> dict[str, Any] | None:
        import ray

        return ray.get(self._actor.get.remote(owner, response_id))

    def replace(self, owner: str, response_id: str, record: dict[str, Any], status: str) -> bool:
        import ray

        return ray.get(self._actor.replace.remote(owner, response_id, record, status))

    def delete(self, owner: str, response_id: str) -> bool:
        import ray

        return ray.get(self._actor.delete.remote(owner, response_id))

    def append_events(self, owner: str, response_id: str, events: list[str], alive_at: float) -> bool:
        import ray

        return ray.get(self._actor.append_events.remote(owner, response_id, events, alive_at))

    def events_after(self, owner: str, response_id: str, after: int) -> dict[str, Any] | None:
        import ray

        return ray.get(self._actor.events_after.remote(owner, response_id, after))

    def held(self) -> tuple[int, int]:
        """(bytes of JSON, records) the store holds now."""
        import ray

        return ray.get(self._actor.held.remote())
