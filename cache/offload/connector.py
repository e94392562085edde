"""The engine's one door to KV beyond its pool: publish computed blocks, load blocks by hash.

The scheduler asks ``lookup`` at admission how many of a prompt's next blocks (after those its
pool holds) some tier has, and if any, takes pool blocks for them and ``start_load``s them. The
load runs on this connector's loader thread, trying the tiers nearest first (host, disk,
cluster) block by block; the request waits in a loading state while the engine keeps stepping,
and ``poll`` hands the scheduler the payloads that arrived, which the next step writes into the
pool before it computes. A load returns the leading run of blocks it could read: a block that is
lost, late or corrupt ends the run there, and the rest is computed. Nothing here raises into a
request.

A model whose sliding-window layers keep a KV group of their own (``BlockManager``) publishes
each group's blocks under keys of their own (``identity.group_namespace``) with payloads of
their own size; a load of such a model reads the sliding group's blocks that its end needs, then
the full group's, as one run.

After each step the engine ``publish``es the blocks that became full: the host tier takes them
at once (a copy in memory); the disk and cluster tiers on the publisher thread, behind a bounded
backlog that drops rather than slows the step.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from raylm.cache.offload.identity import group_namespace, tier_keys
from raylm.cache.offload.tier import KVTier, TierKey, TierStats

logger = logging.getLogger(__name__)

MAX_PUBLISH_BACKLOG_BYTES = 512 << 20  # payloads waiting for the disk and cluster tiers
MAX_SHARED_HASHES = 65536  # block hashes remembered as held by a tier every replica reads
SHARED_TIERS = ("cluster",)  # tiers every replica of the deployment can load from


class KVConnector:
    """Tiers in load order (nearest first) behind one interface, for one namespace of blocks of
    ``block_nbytes`` bytes each; ``sliding_nbytes``: the bytes of a block of the sliding layers'
    KV group (group 1), for a model that keeps one."""

    def __init__(self, tiers: Sequence[KVTier], space: bytes, block_nbytes: int, sliding_nbytes: int | None = None):
        if not tiers:
            raise ValueError("a KV connector needs at least one tier")
        self.tiers = list(tiers)
        self.space = space
        self.block_nbytes = block_nbytes
        self._groups = [(space, block_nbytes)]  # each KV group's (namespace, payload bytes)
        if sliding_nbytes is not None:
            self._groups.append((group_namespace(space, 1), sliding_nbytes))
        self._host = next((t for t in self.tiers if t.name == "host"), None)
        self._remote = [t for t in self.tiers if t is not self._host]  # written on the publisher thread
        self._tickets = itertools.count(1)
        self._loads: dict[int, Future] = {}
        # Each load in flight's full-group block hashes, and how many sliding-group payloads lead its run.
        self._hashes: dict[int, tuple[list[int], int]] = {}
        self._done: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="raylm-kv-load")
        self._publisher = ThreadPoolExecutor(1, thread_name_prefix="raylm-kv-publish")
        self._backlog_bytes = 0
        self._backlog_lock = threading.Lock()
        self.dropped_publishes = 0  # blocks not written to the remote tiers: the backlog was full
        # Block hashes (not keys: the router knows hashes) this replica published to or loaded
        # while a shared tier was on, most recent last: what it tells routers other replicas can load.
        self._shared: OrderedDict[int, None] | None = \
            OrderedDict() if any(t.name in SHARED_TIERS for t in self.tiers) else None

    # -- loading --------------------------------------------------------------------------------------
    def _keys(self, block_hashes: Sequence[int], group: int) -> list[TierKey]:
        return tier_keys(self._groups[group][0], block_hashes)

    def lookup(self, block_hashes: Sequence[int], group: int = 0) -> int:
        """How many of ``block_hashes`` (of KV group ``group``), from the first, some tier holds
        (from memory: no I/O)."""
        keys = self._keys(block_hashes, group)
        held = 0
        while held < len(keys):
            run = max(tier.contains(keys[held:]) for tier in self.tiers)
            if run == 0:
                break
            held += run
        return held

    def held(self, block_hashes: Sequence[int], group: int = 0) -> list[bool]:
        """Whether some tier holds each of ``block_hashes`` (of KV group ``group``), from memory."""
        return [any(tier.contains([key]) for tier in self.tiers) for key in self._keys(block_hashes, group)]

    def start_load(self, block_hashes: Sequence[int], sliding_hashes: Sequence[int] = ()) -> int:
        """Begin reading the blocks of ``block_hashes``, after the sliding group's blocks of
        ``sliding_hashes`` (their payloads lead the run ``poll`` gives); returns the ticket
        ``poll`` reports it under."""
        ticket = next(self._tickets)
        keys = (self._keys(sliding_hashes, 1) if sliding_hashes else []) + self._keys(block_hashes, 0)
        sizes = [self._groups[-1][1]] * len(sliding_hashes) + [self.block_nbytes] * len(block_hashes)
        future = self._loader.submit(self._load, keys, sizes)
        self._loads[ticket] = future
        self._hashes[ticket] = (list(block_hashes), len(sliding_hashes))
        future.add_done_callback(lambda _: self._done.put(ticket))
        return ticket

    def poll(self) -> dict[int, list[np.ndarray]]:
        """Finished loads by ticket: the leading run of payloads read (possibly none), the
        sliding group's first."""
        finished: dict[int, list[np.ndarray]] = {}
        while True:
            try:
                ticket = self._done.get_nowait()
            except queue.Empty:
                return finished
            future = self._loads.pop(ticket, None)
            hashes, num_sliding = self._hashes.pop(ticket, ([], 0))
            if future is None:
                continue  # cancelled
            try:
                finished[ticket] = future.result()
            except Exception:  # a tier bug: the blocks are computed instead
                logger.exception("a KV load failed; its blocks will be computed")
                finished[ticket] = []
            self._remember_shared(hashes[:max(0, len(finished[ticket]) - num_sliding)])

    def wait(self, timeout: float) -> None:
        """Block until some load finishes (or ``timeout`` seconds): for an engine with nothing
        to compute but loads in flight."""
        try:
            ticket = self._done.get(timeout=timeout)
        except queue.Empty:
            return
        self._done.put(ticket)

    def cancel(self, ticket: int) -> None:
        """Forget a load (its request ended); its payloads, if they still arrive, are dropped."""
        future = self._loads.pop(ticket, None)
        self._hashes.pop(ticket, None)
        if future is not None:
            future.cancel()

    @property
    def loads_in_flight(self) -> int:
        return len(self._loads)

    def _load(self, keys: list[TierKey], sizes: list[int]) -> list[np.ndarray]:
        """The leading run of ``keys`` (payloads of ``sizes`` bytes) readable from the tiers,
        each block from the nearest tier that has it; blocks read from farther tiers are kept in
        the nearer ones too."""
        loaded: list[np.ndarray] = []
        while len(loaded) < len(keys):
            got = self._read_run(keys[len(loaded):], sizes[len(loaded):])
            if not got:
                break
            loaded += got
        return loaded

    def _read_run(self, keys: list[TierKey], sizes: list[int]) -> list[np.ndarray]:
        """Blocks from the start of ``keys`` out of the first tier that holds a run there."""
        for tier in self.tiers:
            run = tier.contains(keys)
            if run == 0:
                continue
            payloads = tier.get(keys[:run])
            good = []
            for payload, size in zip(payloads, sizes):
                if payload is None or payload.dtype != np.uint8 or payload.shape != (size,):
                    break
                good.append(payload)
            if good:
                self._keep_nearer(tier, list(zip(keys, good)))
                return good
        return []

    def _keep_nearer(self, source: KVTier, items: list[tuple[TierKey, np.ndarray]]) -> None:
        """Blocks read from ``source`` go into the tiers before it too: the host tier at once (a
        copy: a cluster payload is a view of Ray's object store), the disk tier on the publisher's
        thread, so the next load finds them nearer and a restart keeps what came from the cluster."""
        nearer = self.tiers[:self.tiers.index(source)]
        if self._host in nearer:
            self._host.put([(key, np.array(payload)) for key, payload in items])
        remote = [tier for tier in nearer if tier is not self._host]
        if remote:
            self._submit_remote(items, remote)

    # -- publishing -----------------------------------------------------------------------------------
    def wants(self, block_hashes: Sequence[int], group: int = 0) -> list[bool]:
        """Which blocks (of KV group ``group``) some tier does not hold yet (those are worth
        reading off the device)."""
        return [any(tier.contains([key]) == 0 for tier in self.tiers) for key in self._keys(block_hashes, group)]

    def publish(self, block_hashes: Sequence[int], payloads: np.ndarray, group: int = 0) -> None:
        """Offer full blocks of KV group ``group`` (``payloads`` ``[n, bytes]`` uint8, one row
        per hash) to every tier."""
        if not block_hashes:
            return
        items = list(zip(self._keys(block_hashes, group), payloads))
        if self._host is not None:
            self._host.put(items)
        if not self._remote:
            return
        if group == 0:  # what routers learn: a prompt's full-group blocks
            self._remember_shared(block_hashes)
        self._submit_remote(items, self._remote)

    def _submit_remote(self, items: list[tuple[TierKey, np.ndarray]], tiers: list[KVTier]) -> None:
        """Queue a write of ``items`` to ``tiers`` on the publisher's thread, unless the backlog is full."""
        size = sum(payload.nbytes for _, payload in items)
        with self._backlog_lock:
            if self._backlog_bytes + size > MAX_PUBLISH_BACKLOG_BYTES:
                self.dropped_publishes += len(items)
                return
            self._backlog_bytes += size
        self._publisher.submit(self._write_remote, items, size, tiers)

    def _remember_shared(self, block_hashes: Sequence[int]) -> None:
        if self._shared is None:
            return
        for block_hash in block_hashes:
            self._shared[block_hash] = None
            self._shared.move_to_end(block_hash)
        while len(self._shared) > MAX_SHARED_HASHES:
            self._shared.popitem(last=False)

    def shared_hashes(self, limit: int) -> list[int]:
        """Up to ``limit`` block hashes, most recent first, that a tier every replica reads holds
        as far as this replica knows (it published or loaded them): a router need not send their
        prompts to the replica whose pool holds them. Empty without such a tier."""
        if self._shared is None:
            return []
        return list(itertools.islice(reversed(self._shared), limit))

    def _write_remote(self, items: list[tuple[TierKey, np.ndarray]], size: int, tiers: list[KVTier]) -> None:
        try:
            for tier in tiers:
                try:
                    tier.put(items)
                except Exception:  # put counts its own failures; anything else is a bug, logged
                    logger.exception("writing KV blocks to the %s tier failed", tier.name)
        finally:
            with self._backlog_lock:
                self._backlog_bytes -= size

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every block published so far has been written to every tier."""
        self._publisher.submit(lambda: None).result(timeout)

    # -- introspection and shutdown --------------------------------------------------------------------
    def stats(self) -> list[TierStats]:
        return [tier.stats() for tier in self.tiers]

    def close(self) -> None:
        for ticket in list(self._loads):
            self.cancel(ticket)
        self._loader.shutdown(wait=True, cancel_futures=True)
        self._publisher.shutdown(wait=True)
        for tier in self.tiers:
            tier.close()
