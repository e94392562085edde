"""KV offload without Ray: a block's payload layout, the host and disk tiers, and the connector over
real tiers. References are hand-built: payload bytes concatenated slice by slice, LRU orders
worked out by hand, files edited byte by byte."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from raylm.cache.offload import BlockLayout, DiskTier, HostTier, KVConnector, namespace, tier_keys
from raylm.cache.offload import connector as connector_module
from raylm.cache.offload.disk_tier import HEADER

SPACE = namespace("test-model", "bs=4")
BLOCK = 64  # payload bytes per block in the tier tests


def payload(i: int, nbytes: int = BLOCK) -> np.ndarray:
    """A block payload whose bytes say which block it is."""
    return ((np.arange(nbytes) * 7 + i * 31) % 251).astype(np.uint8)


def keys(n: int, first: int = 0) -> list[bytes]:
    return tier_keys(SPACE, list(range(first, first + n)))


# -- BlockLayout ---------------------------------------------------------------------------------------------
def pool_arrays(rng: np.random.Generator, layers: int, num_blocks: int, block_size: int) -> list[np.ndarray]:
    """K and V in float32, bfloat16 and float8, an int8 pool with float32 scales per (token, head)."""
    shape = (layers, num_blocks, block_size, 3, 8)
    return [
        rng.standard_normal(shape).astype(np.float32),
        rng.standard_normal(shape).astype(ml_dtypes.bfloat16),
        rng.integers(-128, 128, shape, dtype=np.int8),
        rng.standard_normal(shape[:-1]).astype(np.float32),  # the int8 pool's scales
        rng.standard_normal(shape).astype(ml_dtypes.float8_e4m3fn),
    ]


def test_block_layout_round_trip_is_bit_exact_over_dtypes():
    rng = np.random.default_rng(0)
    arrays = pool_arrays(rng, layers=2, num_blocks=6, block_size=4)
    layout = BlockLayout.of(arrays)
    block_ids = [4, 1, 5]
    gathered = [a[:, block_ids] for a in arrays]

    payloads = layout.encode(arrays, block_ids)
    assert layout.encode(gathered, range(3)).tobytes() == payloads.tobytes()  # from blocks gathered first

    # Reference: block b's payload is each array's [:, b] slice, bytes in C order, one after another.
    expected_nbytes = sum(a[:, 0].nbytes for a in arrays)
    assert layout.nbytes == expected_nbytes
    assert payloads.dtype == np.uint8 and payloads.shape == (3, expected_nbytes)
    for row, b in enumerate(block_ids):
        assert payloads[row].tobytes() == b"".join(np.ascontiguousarray(a[:, b]).tobytes() for a in arrays)

    decoded = [np.moveaxis(blocks, 0, 1) for blocks in layout.decode(payloads)]  # block-major back to [L, n, ...]
    for original, back in zip(gathered, decoded):
        assert back.dtype == original.dtype and back.shape == original.shape
        assert back.tobytes() == original.tobytes()  # bit for bit, NaNs and -0.0 included


def test_block_layout_refuses_mismatched_arrays():
    arrays = pool_arrays(np.random.default_rng(1), layers=1, num_blocks=3, block_size=2)
    layout = BlockLayout.of(arrays)
    with pytest.raises(ValueError, match="1 arrays for a layout of 5"):
        layout.encode([arrays[0]], [0])
    with pytest.raises(ValueError, match="uint8"):
        layout.decode(np.zeros((1, layout.nbytes), np.int8))


# -- HostTier and DiskTier: the same contract ---------------------------------------------------------------
def make_tier(kind: str, tmp_path, blocks: int):
    """A tier with room for exactly ``blocks`` blocks of ``BLOCK`` bytes."""
    if kind == "host":
        return HostTier(blocks * BLOCK)
    return DiskTier(tmp_path / "kv", blocks * (HEADER.size + BLOCK))


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_tier_evicts_least_recently_used_within_its_bytes(kind, tmp_path):
    tier = make_tier(kind, tmp_path, blocks=3)
    k = keys(5)
    tier.put([(k[0], payload(0)), (k[1], payload(1)), (k[2], payload(2))])
    assert tier.contains(k[:3]) == 3
    assert [p.tobytes() for p in tier.get([k[0]])] == [payload(0).tobytes()]  # 0 is now the most recent

    tier.put([(k[3], payload(3))])  # evicts 1, the least recently used
    assert [tier.contains([key]) for key in k[:4]] == [1, 0, 1, 1]
    tier.put([(k[2], payload(2))])  # already held: refreshed, nothing written or evicted
    tier.put([(k[4], payload(4))])  # evicts 0 (2 was refreshed after it)
    assert [tier.contains([key]) for key in k] == [0, 0, 1, 1, 1]

    got = tier.get([k[2], k[1], k[4]])
    assert got[0].tobytes() == payload(2).tobytes() and got[1] is None and got[2].tobytes() == payload(4).tobytes()
    stats = tier.stats()
    assert (stats.hits, stats.misses, stats.stored, stats.evicted, stats.stored_blocks) == (3, 1, 5, 2, 3)
    per_block = BLOCK if kind == "host" else HEADER.size + BLOCK
    assert stats.stored_bytes == 3 * per_block and stats.load_bytes == 3 * BLOCK
    assert stats.loads == 2 and len(stats.recent_load_seconds) == 2
    assert tier.stats().recent_load_seconds == stats.recent_load_seconds  # every reader sees them
    if kind == "disk":
        files = sorted(p.name for p in (tmp_path / "kv").rglob("*.kvb"))
        assert files == sorted(key.hex() + ".kvb" for key in (k[2], k[3], k[4]))


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_tier_contains_counts_the_leading_run(kind, tmp_path):
    tier = make_tier(kind, tmp_path, blocks=4)
    k = keys(4)
    tier.put([(k[0], payload(0)), (k[1], payload(1)), (k[3], payload(3))])
    assert tier.contains(k) == 2
    assert tier.contains(k[1:]) == 1
    assert tier.contains(k[2:]) == 0
    assert tier.contains([]) == 0


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_tier_refuses_a_block_larger_than_its_capacity(kind, tmp_path):
    tier = make_tier(kind, tmp_path, blocks=1)
    tier.put([(keys(1)[0], payload(0, BLOCK + 1))])
    assert tier.contains(keys(1)) == 0 and tier.stats().errors == {"too_large": 1}


# -- DiskTier: files, restarts, corruption, failing disks ---------------------------------------------------
def test_disk_restart_finds_its_blocks_with_identical_bytes_in_lru_order(tmp_path):
    k = keys(4)
    first = DiskTier(tmp_path, 3 * (HEADER.size + BLOCK))
    for i in range(3):
        first.put([(k[i], payload(i))])
        time.sleep(0.02)  # distinct modification times
    first.get([k[0]])  # touched: now the most recent on disk too
    first.close()

    second = DiskTier(tmp_path, 3 * (HEADER.size + BLOCK))
    assert second.contains(k[:3]) == 3
    assert second.stats().stored_bytes == 3 * (HEADER.size + BLOCK)
    assert [p.tobytes() for p in second.get(k[:3])] == [payload(i).tobytes() for i in range(3)]
    time.sleep(0.02)
    second.get([k[1], k[0]])  # order now 2, 1, 0
    third = DiskTier(tmp_path, 3 * (HEADER.size + BLOCK))
    third.put([(k[3], payload(3))])
    assert [third.contains([key]) for key in k] == [1, 1, 0, 1]


def test_disk_restart_with_less_room_keeps_the_most_recent(tmp_path):
    k = keys(3)
    first = DiskTier(tmp_path, 3 * (HEADER.size + BLOCK))
    for i in range(3):
        first.put([(k[i], payload(i))])
        time.sleep(0.02)
    smaller = DiskTier(tmp_path, 2 * (HEADER.size + BLOCK))
    assert [smaller.contains([key]) for key in k] == [0, 1, 1]
    assert not os.path.exists(smaller.file_path(k[0]))


def test_disk_ignores_files_it_does_not_recognise(tmp_path):
    k = keys(2)
    tier = DiskTier(tmp_path, 10 * (HEADER.size + BLOCK))
    tier.put([(k[0], payload(0))])
    strangers = [tmp_path / "notes.txt", tmp_path / "zz" / (k[1].hex() + ".kvb"),
                 tmp_path / k[1].hex()[:2] / (k[1].hex() + ".kvb.123.tmp"),  # a crashed writer's temp file
                 tmp_path / k[1].hex()[:2] / (k[1].hex() + ".kvb")]  # the right name, another format
    for path in strangers:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"XXXX" + bytes(HEADER.size + BLOCK))

    restarted = DiskTier(tmp_path, 10 * (HEADER.size + BLOCK))
    assert restarted.contains([k[0]]) == 1 and restarted.contains([k[1]]) == 0
    assert restarted.stats().stored_blocks == 1
    assert all(path.exists() for path in strangers)


def corrupt_and_read(tmp_path, damage) -> tuple[DiskTier, list, str]:
    """Three blocks stored; ``damage(path)`` edits block 1's file; a fresh tier reads all three."""
    k = keys(3)
    DiskTier(tmp_path, 10 * (HEADER.size + BLOCK)).put([(k[i], payload(i)) for i in range(3)])
    tier = DiskTier(tmp_path, 10 * (HEADER.size + BLOCK))
    path = tier.file_path(k[1])
    damage(tier, path)
    return tier, tier.get(k), path


def flip_payload_bit(tier: DiskTier, path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[HEADER.size + 10] ^= 0x04
    open(path, "wb").write(bytes(data))


def truncate(tier: DiskTier, path: str) -> None:
    os.truncate(path, HEADER.size + BLOCK // 2)


def truncate_header(tier: DiskTier, path: str) -> None:
    os.truncate(path, HEADER.size - 1)


def bad_magic(tier: DiskTier, path: str) -> None:
    data = bytearray(open(path, "rb").read())
    data[0:4] = b"NOPE"
    open(path, "wb").write(bytes(data))


def swap_for_another_block(tier: DiskTier, path: str) -> None:
    """The file of block 2 moved under block 1's name: a sound file under the wrong name."""
    os.replace(tier.file_path(keys(3)[2]), path)


@pytest.mark.parametrize("damage", [flip_payload_bit, truncate, truncate_header, bad_magic, swap_for_another_block])
def test_disk_corrupt_block_is_none_counted_and_deleted(tmp_path, damage):
    tier, got, path = corrupt_and_read(tmp_path, damage)
    assert got[1] is None
    assert got[0].tobytes() == payload(0).tobytes()
    if damage is not swap_for_another_block:
        assert got[2].tobytes() == payload(2).tobytes()
    stats = tier.stats()
    assert stats.errors == {"corrupt": 1}
    assert not os.path.exists(path)
    assert tier.contains(keys(3)[1:2]) == 0


@pytest.mark.parametrize("refusal", [
    ("write", errno.ENOSPC),  # the disk fills up mid-file
    ("open", errno.EROFS),  # a read-only file system
    ("open", errno.EACCES),  # a directory this process may not write (what chmod does to a non-root user)
])
def test_disk_write_failures_are_counted_once_logged_and_never_raised(tmp_path, monkeypatch, caplog, refusal):
    function, code = refusal
    real = getattr(os, function)
    tier = DiskTier(tmp_path, 10 * (HEADER.size + BLOCK))
    k = keys(3)
    tier.put([(k[0], payload(0))])

    def refuse(*args, **kwargs):
        if function == "open" and not str(args[0]).endswith(".tmp"):
            return real(*args, **kwargs)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, function, refuse)
    with caplog.at_level(logging.WARNING, logger="raylm.cache.offload.disk_tier"):
        tier.put([(k[1], payload(1)), (k[2], payload(2))])
    monkeypatch.undo()

    stats = tier.stats()
    assert stats.errors == {"write": 2} and stats.stored == 1
    assert tier.contains(k) == 1
    assert len([r for r in caplog.records if "writing KV blocks" in r.getMessage()]) == 1
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [k[0].hex() + ".kvb"]  # no temp file left

    tier.put([(k[1], payload(1))])  # the disk has room again
    assert tier.contains(k) == 2 and tier.get([k[1]])[0].tobytes() == payload(1).tobytes()


def test_disk_read_only_directory_still_serves_its_blocks(tmp_path, monkeypatch):
    k = keys(1)
    DiskTier(tmp_path, 10 * (HEADER.size + BLOCK)).put([(k[0], payload(0))])
    tier = DiskTier(tmp_path, 10 * (HEADER.size + BLOCK))

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(os, "utime", refuse)  # a read cannot mark its file recently used
    assert tier.get(k)[0].tobytes() == payload(0).tobytes()
    assert tier.stats().errors == {}


def test_disk_shared_by_two_tiers(tmp_path):
    k = keys(3)
    a = DiskTier(tmp_path, 10 * (HEADER.size + BLOCK))
    b = DiskTier(tmp_path, 10 * (HEADER.size + BLOCK))
    a.put([(k[0], payload(0)), (k[1], payload(1))])
    b.put([(k[0], payload(0))])  # both write the same key: both succeed
    assert a.stats().errors == {} and b.stats().errors == {}
    assert b.get([k[0]])[0].tobytes() == payload(0).tobytes()
    assert b.get([k[1]])[0].tobytes() == payload(1).tobytes()  # written by the other tier

    c = DiskTier(tmp_path, 10 * (HEADER.size + BLOCK))  # a replica started later sees both
    assert c.contains(k) == 2
    os.unlink(a.file_path(k[1]))  # the other replica evicts block 1 after c answered contains
    assert c.get(k[:2])[1] is None
    stats = c.stats()
    assert stats.errors == {} and stats.misses == 1 and stats.stored_blocks == 1
    assert c.contains(k) == 1


def test_disk_concurrent_puts_and_gets(tmp_path):
    tier = DiskTier(tmp_path, 8 * (HEADER.size + BLOCK))
    k = keys(32)
    failures: list[str] = []

    def writer() -> None:
        for i in range(32):
            tier.put([(k[i], payload(i))])

    def reader() -> None:
        for _ in range(4):
            for i, got in enumerate(tier.get(k)):
                if got is not None and got.tobytes() != payload(i).tobytes():
                    failures.append(f"block {i}")

    threads = [threading.Thread(target=writer), threading.Thread(target=reader), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = tier.stats()
    assert failures == [] and stats.errors == {}
    assert stats.stored_blocks == 8 and len(list(tmp_path.rglob("*.kvb"))) == 8
    # Which 8 stay depends on the readers' touches (a read block is recently used); the last one
    # written always does (nothing was put after it).
    assert sum(tier.contains([key]) for key in k) == 8 and tier.contains(k[31:]) == 1


# -- KVConnector over real tiers ----------------------------------------------------------------------------
@pytest.fixture
def tiers(tmp_path):
    host, disk = HostTier(10 * BLOCK), DiskTier(tmp_path, 10 * (HEADER.size + BLOCK))
    connector = KVConnector([host, disk], SPACE, BLOCK)
    yield host, disk, connector
    connector.close()


def load(connector: KVConnector, hashes: list[int]) -> list[np.ndarray]:
    ticket = connector.start_load(hashes)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        connector.wait(0.5)
        finished = connector.poll()
        if ticket in finished:
            return finished[ticket]
    raise AssertionError("the load never finished")


def test_connector_lookup_and_load_take_the_leading_run_across_tiers(tiers):
    host, disk, connector = tiers
    k = keys(5)
    host.put([(k[0], payload(0)), (k[2], payload(2))])
    disk.put([(k[1], payload(1)), (k[2], payload(2)), (k[4], payload(4))])  # block 3 is nowhere

    assert connector.lookup([0, 1, 2, 3, 4]) == 3
    assert connector.lookup([1, 2]) == 2 and connector.lookup([3, 4]) == 0

    got = load(connector, [0, 1, 2, 3, 4])
    assert [p.tobytes() for p in got] == [payload(i).tobytes() for i in range(3)]
    assert host.contains([k[1]]) == 1  # promoted: the next load finds it nearest
    assert disk.stats().hits == 2 and connector.loads_in_flight == 0  # blocks 1 and 2: host had no run there


def test_connector_corrupt_middle_block_ends_the_run(tiers, tmp_path):
    host, disk, connector = tiers
    k = keys(3)
    disk.put([(k[i], payload(i)) for i in range(3)])
    flip_payload_bit(disk, disk.file_path(k[1]))
    assert connector.lookup([0, 1, 2]) == 3  # the index cannot know before reading

    got = load(connector, [0, 1, 2])
    assert [p.tobytes() for p in got] == [payload(0).tobytes()]
    assert disk.stats().errors == {"corrupt": 1}
    assert connector.lookup([0, 1, 2]) == 1  # block 0 (now in host too); block 1 is gone everywhere


def test_connector_cancelled_load_is_never_reported(tiers):
    host, _, connector = tiers
    host.put([(keys(1)[0], payload(0))])
    ticket = connector.start_load([0])
    connector.cancel(ticket)
    assert connector.loads_in_flight == 0
    connector.wait(0.2)
    assert ticket not in connector.poll()
    assert load(connector, [0])[0].tobytes() == payload(0).tobytes()  # the connector still works


def test_connector_publish_reaches_every_tier_after_flush(tiers):
    host, disk, connector = tiers
    assert connector.wants([0, 1]) == [True, True]
    connector.publish([0, 1], np.stack([payload(0), payload(1)]))
    assert host.contains(keys(2)) == 2  # the host tier takes them at once
    connector.flush(timeout=10)
    assert disk.contains(keys(2)) == 2
    assert disk.get(keys(2, 1))[0].tobytes() == payload(1).tobytes()
    assert connector.wants([0, 1, 2]) == [False, False, True]


class BlockedTier(HostTier):
    """A remote tier whose writes wait until released: the publisher thread is busy."""

    name = "cluster"

    def __init__(self):
        super().__init__(100 * BLOCK)
        self.release = threading.Event()

    def put(self, items):
        self.release.wait(10)
        super().put(items)


def test_connector_drops_publishes_beyond_its_backlog(monkeypatch):
    monkeypatch.setattr(connector_module, "MAX_PUBLISH_BACKLOG_BYTES", 3 * BLOCK)
    host, remote = HostTier(100 * BLOCK), BlockedTier()
    connector = KVConnector([host, remote], SPACE, BLOCK)
    try:
        connector.publish([0, 1], np.stack([payload(0), payload(1)]))  # 2 blocks waiting
        connector.publish([2, 3], np.stack([payload(2), payload(3)]))  # 4 > 3: dropped for the remote tier
        connector.publish([4], payload(4)[None])  # 3 fits
        assert connector.dropped_publishes == 2
        remote.release.set()
        connector.flush(timeout=10)
        assert [remote.contains([key]) for key in keys(5)] == [1, 1, 0, 0, 1]
        assert host.contains(keys(5)) == 5  # the host tier is never behind the backlog
    finally:
        remote.release.set()
        connector.close()
