"""The cluster tier's directory: one detached Ray actor that owns every published KV block.

Blocks must outlive the replica that computed them, so no replica may own them: an object in
Ray's store lives as long as its owner. Ray 2.56 removed ``ray.put(..., _owner=...)``, so the
directory owns them the only way left: a replica sends it a batch of payloads (one task
argument), and the directory ``ray.put``s each block itself. That costs one copy more than a
put on the replica's behalf, and puts each block's primary copy in the object store of the
directory's node; readers fetch from there (through shared memory on that node, by Ray's
object transfer from any other).

The directory maps key -> ObjectRef, least recently used first, bounded by the bytes of the
payloads it holds: the largest ``cluster_bytes`` any replica reserved. Evicting a key drops the
directory's reference, and Ray frees the object once no reader still holds it. Replicas keep a
mirror of the key set (``ClusterTier``), fed by ``changes``: a version counter and a bounded
log of keys added and removed; a mirror that fell behind the log, or that knew an earlier
incarnation of the directory (the actor died and was created again, empty), gets every key.
"""

from __future__ import annotations

import functools
import uuid
from collections import OrderedDict, deque
from typing import Any

import numpy as np
import ray

from raylm.cluster.adapter_store import NAMESPACE

DIRECTORY_NAME = "raylm-kv-directory"
MAX_LOG_ENTRIES = 100_000  # changes kept for mirrors; one further behind resyncs in full


class KVDirectory:
    """The actor's state and methods (``directory_handle`` starts it as a Ray actor)."""

    def __init__(self, capacity_bytes: int):
        self.incarnation = uuid.uuid4().hex
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[bytes, tuple[ray.ObjectRef, int]] = OrderedDict()  # least recently used first
        self._stored_bytes = 0
        self._evicted = 0
        self._version = 0
        self._log: deque[tuple[int, bytes, bool]] = deque()  # (version, key, added)
        self._log_floor = 0  # changes up to this version have left the log

    def reserve(self, capacity_bytes: int) -> int:
        """A replica's ``cluster_bytes``: the directory holds the largest asked for. Returns it."""
        self.capacity_bytes = max(self.capacity_bytes, capacity_bytes)
        return self.capacity_bytes

    def publish(self, keys: list[bytes], payloads: list[np.ndarray]) -> tuple[int, int]:
        """Own a copy of each payload not held yet, evicting the least recently used beyond the
        capacity. Returns how many were stored and how many of ``keys``, from the first, are held
        now (a full object store, or a block larger than the capacity, ends the batch early)."""
        stored = held = 0
        for key, payload in zip(keys, payloads):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                held += 1
                continue
            if payload.nbytes > self.capacity_bytes:
                break
            while self._blocks and self._stored_bytes + payload.nbytes > self.capacity_bytes:
                dropped, (_, size) = self._blocks.popitem(last=False)
                self._stored_bytes -= size
                self._evicted += 1
                self._record(dropped, added=False)
            try:
                ref = ray.put(payload)
            except (ray.exceptions.ObjectStoreFullError, ray.exceptions.OutOfDiskError):
                break
            self._blocks[key] = (ref, payload.nbytes)
            self._stored_bytes += payload.nbytes
            self._record(key, added=True)
            stored += 1
            held += 1
        return stored, held

    def lookup(self, keys: list[bytes]) -> list[ray.ObjectRef | None]:
        """The objects of ``keys`` (None where not held); found keys become the most recent. The
        refs travel inside a list, so the caller gets refs to fetch, not the payloads."""
        refs = []
        for key in keys:
            entry = self._blocks.get(key)
            if entry is not None:
                self._blocks.move_to_end(key)
            refs.append(None if entry is None else entry[0])
        return refs

    def forget(self, keys: list[bytes]) -> None:
        """Drop keys whose objects a reader found lost (their node died): no one asks again."""
        for key in keys:
            entry = self._blocks.pop(key, None)
            if entry is not None:
                self._stored_bytes -= entry[1]
                self._record(key, added=False)

    def changes(self, incarnation: str | None, since: int) -> dict[str, Any]:
        """What changed after version ``since`` of incarnation ``incarnation``: ``added`` and
        ``removed`` keys in order, or ``full`` with every key when the caller cannot catch up."""
        reply: dict[str, Any] = {
            "incarnation": self.incarnation, "version": self._version, "capacity_bytes": self.capacity_bytes,
            "stored_bytes": self._stored_bytes, "stored_blocks": len(self._blocks), "evicted": self._evicted,
        }
        if incarnation != self.incarnation or since < self._log_floor or since > self._version:
            reply["full"] = list(self._blocks)
            return reply
        changed = []
        for version, key, added in reversed(self._log):
            if version <= since:
                break
            changed.append((key, added))
        changed.reverse()
        reply["changed"] = changed
        return reply

    def _record(self, key: bytes, added: bool) -> None:
        self._version += 1
        self._log.append((self._version, key, added))
        if len(self._log) > MAX_LOG_ENTRIES:
            self._log_floor = self._log.popleft()[0]


@functools.cache
def _directory_actor() -> ray.actor.ActorClass:
    return ray.remote(KVDirectory)


def directory_handle(capacity_bytes: int, name: str = DIRECTORY_NAME) -> ray.actor.ActorHandle:
    """The cluster's directory, started here if no replica started it yet: detached (it outlives
    every replica and Serve application), taking no CPU."""
    return _directory_actor().options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
    ).remote(capacity_bytes)
