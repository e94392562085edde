"""The cluster tier: KV blocks in Ray's object store, shared by every replica on every node.

Blocks are owned by the directory actor (``kv_directory``), so they survive the replica that
published them. ``contains`` answers from a mirror of the directory's key set in this process,
brought up to date every ``sync_period_s`` by a background thread (and at once by ``refresh``,
for a decode replica admitting a request whose prefill was just published). ``get`` asks the
directory for the blocks' objects and fetches them: on the directory's node straight from
shared memory (the arrays are read-only views of the object store), from any other node by
Ray's object transfer. A block lost with its node, a fetch beyond ``load_timeout_s`` or a
directory that died returns None and is counted (``lost``, ``timeout``, ``directory``), logged
once per kind; the block is computed instead. Without a directory the tier tries to find or
start one again every ``RECONNECT_S``, so a directory started anew is used again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from raylm.cache.offload.tier import TierKey, TierStats, leading_run
from raylm.cluster.kv_directory import DIRECTORY_NAME, directory_handle

logger = logging.getLogger(__name__)

RECONNECT_S = 2.0  # how often a tier without a directory looks for one again
CALL_TIMEOUT_S = 10.0  # the longest a publish or a sync waits for the directory


class ClusterTier:
    """This replica's door to the cluster's directory; ``capacity_bytes`` is its ``cluster_bytes``."""

    name = "cluster"

    def __init__(self, capacity_bytes: int, load_timeout_s: float = 10.0, sync_period_s: float = 0.1,
                 directory_name: str = DIRECTORY_NAME):
        if capacity_bytes <= 0:
            raise ValueError(f"the cluster tier needs a capacity > 0 bytes, got {capacity_bytes}")
        if not ray.is_initialized():
            raise ValueError("kv_offload.cluster_bytes keeps blocks in a Ray cluster's object store, and this "
                             "process is not connected to one: serve on Ray, or set cluster_bytes to 0")
        self.load_timeout_s = load_timeout_s
        self.directory_name = directory_name
        self._lock = threading.Lock()  # the mirror, the stats and the handle
        self._sync_lock = threading.Lock()  # one sync at a time (the mirror thread, refresh)
        self._stats = TierStats(self.name, capacity_bytes)
        self._logged: set[str] = set()
        self._directory: ray.actor.ActorHandle | None = None
        self._last_connect = -float("inf")
        self._keys: set[TierKey] = set()
        self._incarnation: str | None = None
        self._version = 0
        self._stop = threading.Event()
        self.refresh(CALL_TIMEOUT_S)  # a replica that starts finds the cluster's blocks at once
        self._mirror = threading.Thread(target=self._follow, args=(sync_period_s,), daemon=True,
                                        name="raylm-kv-cluster-mirror")
        self._mirror.start()

    # -- the directory -----------------------------------------------------------------------------------
    def _connect(self) -> ray.actor.ActorHandle | None:
        """The directory's handle; found or started again when lost, at most every RECONNECT_S.
        None once this process has left Ray (``ray.shutdown``): a call through a handle then would
        start a new local Ray cluster of its own (Ray's auto-init), not reach the old one."""
        if not ray.is_initialized():
            with self._lock:  # its blocks are out of reach: forget them
                self._directory, self._incarnation = None, None
                self._keys.clear()
            return None
        with self._lock:
            if self._directory is not None:
                return self._directory
            if time.monotonic() - self._last_connect < RECONNECT_S:
                return None
            self._last_connect = time.monotonic()
        try:
            handle = directory_handle(self._stats.capacity_bytes, self.directory_name)
            ray.get(handle.reserve.remote(self._stats.capacity_bytes), timeout=CALL_TIMEOUT_S)
        except (RayError, ValueError) as e:  # ValueError: Ray's answer to a named actor it cannot find or make
            self._failed("directory", f"the KV directory {self.directory_name!r} cannot be reached ({e})")
            return None
        with self._lock:
            self._directory = handle
        return handle

    def _lost_directory(self, handle: ray.actor.ActorHandle, error: Exception) -> None:
        """The directory died or stopped answering: its blocks are gone with it; forget them."""
        with self._lock:
            if self._directory is not handle:
                return  # another thread saw it first
            self._directory = None
            self._keys.clear()
            self._incarnation = None
            self._last_connect = -float("inf")  # look for (or start) a new one at the next call
        self._failed("directory", f"the KV directory {self.directory_name!r} is gone ({type(error).__name__}: "
                                  f"{error}); its blocks will be computed")

    # -- the mirror --------------------------------------------------------------------------------------
    def _follow(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            self.refresh(CALL_TIMEOUT_S)

    def refresh(self, timeout: float = 5.0) -> bool:
        """Bring the mirror up to date with the directory now; False when it cannot be reached."""
        with self._sync_lock:
            handle = self._connect()
            if handle is None:
                return False
            with self._lock:
                incarnation, version = self._incarnation, self._version
            try:
                reply = ray.get(handle.changes.remote(incarnation, version), timeout=timeout)
            except RayActorError as e:
                self._lost_directory(handle, e)
                return False
            except GetTimeoutError:
                return False  # busy: the next sync catches up
            with self._lock:
                if "full" in reply:
                    self._keys = set(reply["full"])
                else:
                    for key, added in reply["changed"]:
                        if added:
                            self._keys.add(key)
                        else:
                            self._keys.discard(key)
                self._incarnation, self._version = reply["incarnation"], reply["version"]
                stats = self._stats
                stats.capacity_bytes, stats.stored_bytes = reply["capacity_bytes"], reply["stored_bytes"]
                stats.stored_blocks, stats.evicted = reply["stored_blocks"], reply["evicted"]
            return True

    def contains(self, keys: Sequence[TierKey]) -> int:
        with self._lock:
            return leading_run(keys, self._keys)

    # -- reading -----------------------------------------------------------------------------------------
    def get(self, keys: Sequence[TierKey]) -> list[np.ndarray | None]:
        start = time.perf_counter()
        found = self._fetch(list(keys), start + self.load_timeout_s)
        with self._lock:
            for payload in found:
                if payload is None:
                    self._stats.misses += 1
                else:
                    self._stats.hits += 1
                    self._stats.load_bytes += payload.nbytes
            self._stats.record_load(time.perf_counter() - start)
        return found

    def _fetch(self, keys: list[TierKey], deadline: float) -> list[np.ndarray | None]:
        found: list[np.ndarray | None] = [None] * len(keys)
        handle = self._connect()
        if handle is None or not keys:
            return found
        try:
            refs = ray.get(handle.lookup.remote(keys), timeout=max(deadline - time.perf_counter(), 0))
        except RayActorError as e:
            self._lost_directory(handle, e)
            return found
        except GetTimeoutError:
            self._failed("timeout", f"the KV directory did not answer a lookup within {self.load_timeout_s} s "
                                    "(kv_offload.load_timeout_s); the blocks will be computed")
            return found
        except RayError as e:
            self._failed("directory", f"looking KV blocks up in the directory failed ({e})")
            return found
        held = [(i, ref) for i, ref in enumerate(refs) if ref is not None]
        if not held:
            return found
        # Start every transfer at once; take what arrived by the deadline.
        ready, _ = ray.wait([ref for _, ref in held], num_returns=len(held), fetch_local=True,
                            timeout=max(deadline - time.perf_counter(), 0))
        ready_set = set(ready)
        lost = []
        for i, ref in held:
            if ref not in ready_set:
                self._failed("timeout", f"fetching KV blocks from the object store took over {self.load_timeout_s} s "
                                        "(kv_offload.load_timeout_s); they will be computed")
                continue
            try:
                payload = ray.get(ref, timeout=max(deadline - time.perf_counter(), 0.1))
            except GetTimeoutError:
                self._failed("timeout", f"fetching KV blocks from the object store took over {self.load_timeout_s} s")
                continue
            except RayError as e:  # ObjectLostError and its kinds: the owner or the node died, the object was freed
                self._failed("lost", f"a KV block's object is lost ({type(e).__name__}); lost blocks are computed")
                lost.append(keys[i])
                continue
            if isinstance(payload, np.ndarray) and payload.dtype == np.uint8 and payload.ndim == 1:
                found[i] = payload
            else:
                self._failed("corrupt", f"a KV block's object is not a uint8 payload ({type(payload).__name__})")
        if lost:
            self._forget(handle, lost)
        return found

    def _forget(self, handle: ray.actor.ActorHandle, keys: list[TierKey]) -> None:
        """Tell the directory (without waiting) that these objects are lost, and stop offering them."""
        with self._lock:
            self._keys.difference_update(keys)
        try:
            handle.forget.remote(keys)
        except RayError:
            pass

    # -- writing -----------------------------------------------------------------------------------------
    def put(self, items: Sequence[tuple[TierKey, np.ndarray]]) -> None:
        with self._lock:
            fresh = [(key, payload) for key, payload in items if key not in self._keys]
            too_large = [key for key, payload in fresh if payload.nbytes > self._stats.capacity_bytes]
            for _ in too_large:
                self._stats.count_error("too_large")
        fresh = [(key, payload) for key, payload in fresh if payload.nbytes <= self._stats.capacity_bytes]
        if not fresh:
            return
        handle = self._connect()
        if handle is None:
            self._failed("directory", f"the KV directory {self.directory_name!r} cannot be reached; "
                                      "blocks are not published")
            return
        keys = [key for key, _ in fresh]
        try:
            stored, held = ray.get(handle.publish.remote(keys, [np.ascontiguousarray(p) for _, p in fresh]),
                                   timeout=CALL_TIMEOUT_S)
        except RayActorError as e:
            self._lost_directory(handle, e)
            return
        except RayError as e:  # a timeout (the directory is busy) or a failed call: these blocks are not shared
            self._failed("write", f"publishing KV blocks to the directory failed ({type(e).__name__}: {e})")
            return
        if held < len(keys):
            self._failed("write", "the object store is full: KV blocks are not published until it has room")
        with self._lock:
            self._stats.stored += stored
            self._keys.update(keys[:held])

    # -- bookkeeping -------------------------------------------------------------------------------------
    def _failed(self, kind: str, message: str) -> None:
        with self._lock:
            self._stats.count_error(kind)
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            logger.warning("%s (further %r errors of the cluster tier are counted, not logged)", message, kind)

    def stats(self) -> TierStats:
        """This replica's hits, misses, loads and errors; stored and evicted blocks are the
        directory's, shared by every replica (as of the mirror's last sync)."""
        with self._lock:
            return self._stats.snapshot()

    def close(self) -> None:
        """Stop following the directory; the blocks stay in the cluster for other replicas."""
        self._stop.set()
        self._mirror.join(timeout=CALL_TIMEOUT_S)
