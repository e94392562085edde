"""The disk tier: block payloads as files in a local directory, so a restarted replica starts warm.

One file per block, ``<dir>/<hex[:2]>/<hex>.kvb`` (the key's hex; the two-character fan-out keeps
directories small), holding a header (magic, format version, payload length, the key, a blake2b
digest of the payload) and the payload. A file is written under a temporary name and moved into
place with ``os.replace``, so a crash never leaves half a block under a real name, and two
replicas sharing the directory that write the same key both succeed (the last one wins, with
the same bytes). Whatever still goes wrong on disk (a torn write after a power loss, a flipped
bit) fails the digest on read: the file is deleted and the block recomputed.

The index (key -> file size, least recently used first) lives in memory, so ``contains`` never
touches the disk; it is rebuilt at start from the directory (LRU order by modification time; a
read touches its file), and files it does not recognise are left alone. Each tier bounds the
bytes it knows of: replicas sharing one directory each evict within their own capacity, and a
block another replica wrote after this one started is found at this one's next start.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from hashlib import blake2b

import numpy as np

from raylm.cache.offload.tier import TierKey, TierStats, leading_run

logger = logging.getLogger(__name__)

MAGIC = b"RKVB"
FORMAT_VERSION = 1
DIGEST_BYTES = 16
# magic, format version, reserved (0), payload length, the block's key, blake2b digest of the payload
HEADER = struct.Struct("<4sHHQ16s16s")
SUFFIX = ".kvb"
_FILE_NAME = re.compile(r"[0-9a-f]{32}\.kvb")
_FAN_OUT = re.compile(r"[0-9a-f]{2}")


def payload_digest(payload: np.ndarray | memoryview | bytes) -> bytes:
    """The checksum a block file carries for its payload."""
    return blake2b(payload, digest_size=DIGEST_BYTES).digest()


class CorruptBlock(Exception):
    """A block file that is not what its name says: short, a bad header or a digest mismatch."""


class DiskTier:
    """At most ``capacity_bytes`` of block files (headers included) under ``path``."""

    name = "disk"

    def __init__(self, path: str | os.PathLike, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"the disk tier needs a capacity > 0 bytes, got {capacity_bytes}")
        self.path = os.fspath(path)
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_offload.disk_path {self.path!r} cannot be created ({e}); "
                             "name a directory this replica may write") from e
        self._files: OrderedDict[TierKey, int] = OrderedDict()  # key -> file size, least recently used first
        self._lock = threading.Lock()
        self._stats = TierStats(self.name, capacity_bytes)
        self._logged: set[str] = set()  # error kinds already logged: once each, not per block
        self._scan()

    # -- the index ---------------------------------------------------------------------------------------
    def file_path(self, key: TierKey) -> str:
        """Where the block of ``key`` lives (whether or not it is there)."""
        name = key.hex()
        return os.path.join(self.path, name[:2], name + SUFFIX)

    def _scan(self) -> None:
        """Index the block files already in the directory, oldest first; skip anything else."""
        found: list[tuple[float, TierKey, int]] = []
        for fan_out in os.scandir(self.path):
            if not (fan_out.is_dir(follow_symlinks=False) and _FAN_OUT.fullmatch(fan_out.name)):
                continue
            try:
                entries = list(os.scandir(fan_out.path))
            except OSError:  # not ours to read
                continue
            for entry in entries:
                if not (_FILE_NAME.fullmatch(entry.name) and entry.name.startswith(fan_out.name)):
                    continue
                try:
                    status = entry.stat(follow_symlinks=False)
                    with open(entry.path, "rb") as f:
                        head = f.read(HEADER.size)
                except OSError:
                    continue
                if len(head) == HEADER.size and HEADER.unpack(head)[:2] == (MAGIC, FORMAT_VERSION):
                    found.append((status.st_mtime, bytes.fromhex(entry.name[:-len(SUFFIX)]), status.st_size))
        found.sort()
        stats = self._stats
        for _, key, size in found:
            self._files[key] = size
            stats.stored_bytes += size
            stats.stored_blocks += 1
        victims = self._evict_locked(0)
        self._delete(victims)

    def contains(self, keys: Sequence[TierKey]) -> int:
        with self._lock:
            return leading_run(keys, self._files)

    # -- reading -----------------------------------------------------------------------------------------
    def get(self, keys: Sequence[TierKey]) -> list[np.ndarray | None]:
        start = time.perf_counter()
        found: list[np.ndarray | None] = []
        for key in keys:
            payload = self._read(key)
            with self._lock:
                if payload is not None:
                    self._stats.hits += 1
                    self._stats.load_bytes += payload.nbytes
                    if key in self._files:
                        self._files.move_to_end(key)
                else:
                    self._stats.misses += 1
            found.append(payload)
        with self._lock:
            self._stats.record_load(time.perf_counter() - start)
        return found

    def _read(self, key: TierKey) -> np.ndarray | None:
        """The payload of ``key``'s file; None (the file forgotten, and deleted if corrupt) otherwise."""
        path = self.file_path(key)
        try:
            with open(path, "rb") as f:
                payload = self._read_block(f, key, os.fstat(f.fileno()).st_size)
        except FileNotFoundError:  # never written, evicted, or deleted by a replica sharing the directory
            self._forget_if_missing(key, path)
            return None
        except CorruptBlock as e:
            self._failed("corrupt", f"the block file {path} is corrupt ({e}); it is deleted and recomputed")
            self._forget(key)
            self._delete([path])
            return None
        except OSError as e:
            self._failed("read", f"reading the block file {path} failed ({e}); its block is recomputed")
            return None
        try:
            os.utime(path)  # least recently used order survives a restart
        except OSError:  # a read-only directory still serves its blocks
            pass
        return payload

    @staticmethod
    def _read_block(f, key: TierKey, file_size: int) -> np.ndarray:
        head = f.read(HEADER.size)
        if len(head) < HEADER.size:
            raise CorruptBlock(f"{len(head)} bytes, shorter than the header")
        magic, version, _, length, stored_key, digest = HEADER.unpack(head)
        if magic != MAGIC or version != FORMAT_VERSION:
            raise CorruptBlock(f"not a version {FORMAT_VERSION} block file (magic {magic!r}, version {version})")
        if stored_key != key:
            raise CorruptBlock(f"it holds the block {stored_key.hex()}")
        if file_size != HEADER.size + length:
            raise CorruptBlock(f"{file_size} bytes for a payload of {length}")
        payload = np.empty(length, np.uint8)
        if f.readinto(memoryview(payload)) != length:
            raise CorruptBlock("the payload ends early")
        if payload_digest(payload) != digest:
            raise CorruptBlock("the payload does not match its checksum")
        return payload

    # -- writing -----------------------------------------------------------------------------------------
    def put(self, items: Sequence[tuple[TierKey, np.ndarray]]) -> None:
        for key, payload in items:
            size = HEADER.size + payload.nbytes
            with self._lock:
                if key in self._files:
                    self._files.move_to_end(key)
                    continue
                if size > self._stats.capacity_bytes:
                    self._stats.count_error("too_large")
                    continue
            if not self._write(key, payload):
                continue
            with self._lock:
                if key in self._files:  # written by another thread meanwhile
                    self._files.move_to_end(key)
                    continue
                victims = self._evict_locked(size)
                self._files[key] = size
                self._stats.stored_bytes += size
                self._stats.stored_blocks += 1
                self._stats.stored += 1
            self._delete(victims)

    def _write(self, key: TierKey, payload: np.ndarray) -> bool:
        """Write ``key``'s file atomically; False (counted, logged once) when the disk refused."""
        data = np.ascontiguousarray(payload).view(np.uint8).reshape(-1)
        path = self.file_path(key)
        temp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        head = HEADER.pack(MAGIC, FORMAT_VERSION, 0, data.nbytes, key, payload_digest(data))
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for chunk in (memoryview(head), memoryview(data)):
                    while chunk:
                        chunk = chunk[os.write(fd, chunk):]
            finally:
                os.close(fd)
            os.replace(temp, path)
            return True
        except OSError as e:
            reason = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
                      errno.EACCES: "permission denied"}.get(e.errno, str(e))
            self._failed("write", f"writing KV blocks under {self.path} failed ({reason}); "
                                  "blocks are not kept on disk until writes succeed")
            self._delete([temp])
            return False

    def _evict_locked(self, incoming: int) -> list[str]:
        """Forget the least recently used files until ``incoming`` more bytes fit; their paths."""
        stats, victims = self._stats, []
        while self._files and stats.stored_bytes + incoming > stats.capacity_bytes:
            key, size = self._files.popitem(last=False)
            stats.stored_bytes -= size
            stats.stored_blocks -= 1
            stats.evicted += 1
            victims.append(self.file_path(key))
        return victims

    # -- bookkeeping -------------------------------------------------------------------------------------
    def _forget(self, key: TierKey) -> None:
        with self._lock:
            size = self._files.pop(key, None)
            if size is not None:
                self._stats.stored_bytes -= size
                self._stats.stored_blocks -= 1

    def _forget_if_missing(self, key: TierKey, path: str) -> None:
        """Forget ``key`` found missing, unless a put wrote it since the read looked (checked under
        the lock, which the put takes to index it)."""
        with self._lock:
            if key in self._files and not os.path.exists(path):
                size = self._files.pop(key)
                self._stats.stored_bytes -= size
                self._stats.stored_blocks -= 1

    @staticmethod
    def _delete(paths: list[str]) -> None:
        for path in paths:
            try:
                os.unlink(path)
            except OSError:  # gone already (another replica evicted it) or not ours to delete
                pass

    def _failed(self, kind: str, message: str) -> None:
        with self._lock:
            self._stats.count_error(kind)
            first = kind not in self._logged
            self._logged.add(kind)
        if first:
            logger.warning("%s (further %r errors of the disk tier are counted, not logged)", message, kind)

    def stats(self) -> TierStats:
        with self._lock:
            return self._stats.snapshot()

    def close(self) -> None:
        """Nothing runs in the background; the files stay for the next start."""
