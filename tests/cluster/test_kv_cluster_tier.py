"""The cluster tier on a real local Ray cluster: blocks published by one process and fetched by
another, surviving their publisher; lost objects, evictions and a dead directory cost a miss,
never an exception. Each test has a directory of its own (a unique actor name)."""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest

from raylm.cache.offload import namespace, tier_keys
from tests.serving import RAY_ENV

SPACE = namespace("test-model", "cluster")
BLOCK = 256 << 10  # above Ray's inline limit (100 KiB): every block is an object in the shared-memory store


def payload(i: int) -> np.ndarray:
    return ((np.arange(BLOCK) * 13 + i * 101) % 253).astype(np.uint8)


def keys(n: int) -> list[bytes]:
    return tier_keys(SPACE, list(range(n)))


@pytest.fixture(scope="module")
def ray_cluster():
    """The session's Ray cluster when one is up; otherwise a small one of this module's own."""
    for key, value in RAY_ENV.items():
        os.environ.setdefault(key, value)
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def directory_name(ray_cluster):
    """A directory of this test's own, killed after it."""
    from raylm.cluster.adapter_store import NAMESPACE

    name = f"raylm-kv-directory-test-{uuid.uuid4().hex[:8]}"
    yield name
    try:
        ray_cluster.kill(ray_cluster.get_actor(name, namespace=NAMESPACE))
    except ValueError:
        pass  # never started, or killed by the test


@pytest.fixture
def make_tier(directory_name):
    from raylm.cluster.kv_cluster_tier import ClusterTier

    made = []

    def make(blocks: int = 16, **kwargs) -> ClusterTier:
        tier = ClusterTier(blocks * BLOCK, directory_name=directory_name, **kwargs)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def directory(ray_cluster, name: str):
    from raylm.cluster.adapter_store import NAMESPACE

    return ray_cluster.get_actor(name, namespace=NAMESPACE)


def wait_until_lost(ray_cluster, refs: list) -> None:
    """Until the object of ``refs[0]``, whose owner was killed, is gone: the node lets it go once it
    learns the owner died (a fetch right after the kill may still find it)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            ray_cluster.get(refs[0], timeout=5)
        except ray_cluster.exceptions.ObjectLostError:
            return
        time.sleep(0.1)
    raise AssertionError("the object outlived its owner")


def test_blocks_outlive_the_process_that_published_them(ray_cluster, directory_name, make_tier):
    from raylm.cluster.kv_cluster_tier import ClusterTier

    class Publisher:  # defined here so Ray ships it by value: test modules are not importable by workers
        def __init__(self, name: str):
            self.tier = ClusterTier(16 * BLOCK, directory_name=name)

        def publish(self, items: list[tuple[bytes, np.ndarray]]) -> int:
            self.tier.put(items)
            return self.tier.stats().stored

        def own(self) -> list:
            return [ray_cluster.put(payload(9))]  # an object this process owns, unlike its blocks

    publisher = ray_cluster.remote(num_cpus=0)(Publisher).remote(directory_name)
    k = keys(3)
    assert ray_cluster.get(publisher.publish.remote([(k[i], payload(i)) for i in range(3)])) == 3
    probe = ray_cluster.get(publisher.own.remote())
    ray_cluster.kill(publisher)
    wait_until_lost(ray_cluster, probe)  # what the publisher owned is gone now

    reader = make_tier(sync_period_s=60)  # only its first sync and refresh() update its mirror
    assert reader.contains(k) == 3
    got = reader.get(k)
    assert [p.tobytes() for p in got] == [payload(i).tobytes() for i in range(3)]
    assert not got[0].flags.writeable  # a view of the object store's shared memory, not a copy
    stats = reader.stats()
    assert (stats.hits, stats.misses, stats.errors, stats.stored_blocks) == (3, 0, {}, 3)
    assert stats.load_bytes == 3 * BLOCK


def test_mirror_follows_the_directory(make_tier):
    writer, reader = make_tier(), make_tier(sync_period_s=60)
    writer.put([(key, payload(i)) for i, key in enumerate(keys(2))])
    assert writer.contains(keys(2)) == 2  # a writer knows its own blocks at once
    assert reader.contains(keys(2)) == 0
    assert reader.refresh(timeout=10)
    assert reader.contains(keys(2)) == 2

    follower = make_tier(sync_period_s=0.05)  # the background sync, without refresh()
    writer.put([(keys(3)[2], payload(2))])
    deadline = time.monotonic() + 10
    while follower.contains(keys(3)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert follower.contains(keys(3)) == 3


_LEAVES_RAY = """
import sys, time
import numpy as np
import ray
from raylm.cluster.kv_cluster_tier import ClusterTier
ray.init(address=sys.argv[1], log_to_driver=False)
tier = ClusterTier(1 << 24, directory_name=sys.argv[2], sync_period_s=0.05)
key = bytes(32)
tier.put([(key, np.zeros(16, np.uint8))])
assert tier.contains([key]) == 1
ray.shutdown()
time.sleep(0.5)  # ten periods of the mirror's sync
assert not tier.refresh(timeout=5) and tier.get([key]) == [None] and tier.contains([key]) == 0
tier.put([(key, np.zeros(16, np.uint8))])
assert not ray.is_initialized(), "the tier started a Ray cluster of its own"
tier.close()
print("left quietly")
"""


def test_a_tier_whose_process_left_ray_misses_and_starts_no_cluster(ray_cluster, directory_name):
    """An engine not closed before ``ray.shutdown`` (an offline ``LLM``, a test): its tier's calls
    would each start a new local Ray cluster (Ray's auto-init) in that process; they miss instead."""
    import subprocess
    import sys

    address = ray_cluster.get_runtime_context().gcs_address
    run = subprocess.run([sys.executable, "-c", _LEAVES_RAY, address, directory_name], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "RAY_ENABLE_AUTO_CONNECT": "1"})
    assert run.returncode == 0 and "left quietly" in run.stdout, run.stdout[-2000:] + run.stderr[-3000:]


def test_directory_evicts_least_recently_used_by_bytes(ray_cluster, directory_name, make_tier):
    small = make_tier(blocks=2)
    tier = make_tier(blocks=3)  # the directory holds the largest capacity asked for
    k = keys(4)
    for i in range(3):
        tier.put([(k[i], payload(i))])
    assert tier.get([k[0]])[0].tobytes() == payload(0).tobytes()  # 0 is now the most recent
    tier.put([(k[3], payload(3))])  # evicts 1

    assert small.refresh(timeout=10)
    assert [small.contains([key]) for key in k] == [1, 0, 1, 1]
    assert small.get([k[1]]) == [None]
    stats = small.stats()
    assert (stats.capacity_bytes, stats.stored_bytes, stats.stored_blocks, stats.evicted) == (
        3 * BLOCK, 3 * BLOCK, 3, 1)
    assert stats.misses == 1 and stats.errors == {}


def test_lost_object_is_a_counted_miss(ray_cluster, directory_name, make_tier):
    """One block's object is owned by a process that dies (what a node failure does to a block):
    fetching it fails; the other blocks still come, and the lost one is offered no more."""
    from raylm.cluster.adapter_store import NAMESPACE
    from raylm.cluster.kv_directory import KVDirectory

    class AdoptingDirectory(KVDirectory):
        def adopt(self, key: bytes, refs: list, nbytes: int) -> None:  # a block someone else owns
            self._blocks[key] = (refs[0], nbytes)
            self._stored_bytes += nbytes
            self._record(key, added=True)

    class Owner:
        def put(self, value: np.ndarray) -> list:
            return [ray_cluster.put(value)]

    directory = ray_cluster.remote(AdoptingDirectory).options(
        name=directory_name, namespace=NAMESPACE, lifetime="detached", num_cpus=0).remote(16 * BLOCK)
    owner = ray_cluster.remote(num_cpus=0)(Owner).remote()
    tier = make_tier()
    k = keys(3)
    tier.put([(k[0], payload(0)), (k[2], payload(2))])
    probe = ray_cluster.get(owner.put.remote(payload(1)))
    ray_cluster.get(directory.adopt.remote(k[1], probe, BLOCK))
    assert tier.refresh(timeout=10) and tier.contains(k) == 3
    ray_cluster.kill(owner)
    wait_until_lost(ray_cluster, probe)

    got = tier.get(k)
    assert got[1] is None
    assert got[0].tobytes() == payload(0).tobytes() and got[2].tobytes() == payload(2).tobytes()
    assert tier.stats().errors == {"lost": 1}
    assert tier.contains(k) == 1  # no longer offered
    assert tier.refresh(timeout=10) and tier.contains(k[1:2]) == 0  # the directory forgot it too


def test_dead_directory_costs_misses_and_a_new_one_is_used(ray_cluster, directory_name, make_tier):
    tier = make_tier(sync_period_s=60)
    k = keys(2)
    tier.put([(k[0], payload(0))])
    ray_cluster.kill(directory(ray_cluster, directory_name))

    assert tier.get(k[:1]) == [None]  # no exception
    stats = tier.stats()
    assert stats.errors == {"directory": 1} and stats.misses == 1
    assert tier.contains(k) == 0  # its blocks died with it

    tier.put([(k[1], payload(1))])  # the next call finds the directory gone, starts a new one and uses it
    assert tier.contains(k[1:]) == 1
    assert tier.get(k[1:])[0].tobytes() == payload(1).tobytes()
    assert tier.refresh(timeout=10) and tier.contains(k) == 0 and tier.contains(k[1:]) == 1


def test_directory_changes_log_and_full_resyncs(ray_cluster, monkeypatch):
    """The directory's state without the actor: ordered changes since a version; every key for a
    mirror of another incarnation or one that fell behind the bounded log."""
    from raylm.cluster import kv_directory

    monkeypatch.setattr(kv_directory, "MAX_LOG_ENTRIES", 4)
    directory = kv_directory.KVDirectory(capacity_bytes=2 * BLOCK)
    k = keys(4)
    assert directory.publish(k[:2], [payload(0), payload(1)]) == (2, 2)
    assert directory.publish(k[1:3], [payload(1), payload(2)]) == (1, 2)  # 1 held already; 2 evicts 0
    reply = directory.changes(None, 0)
    assert reply["full"] == [k[1], k[2]] and reply["version"] == 4

    incarnation = reply["incarnation"]
    assert directory.changes(incarnation, 1)["changed"] == [(k[1], True), (k[0], False), (k[2], True)]
    assert directory.changes(incarnation, 4)["changed"] == []
    directory.forget([k[1]])  # version 5: the log drops version 1
    assert directory.changes(incarnation, 1)["changed"] == [(k[1], True), (k[0], False), (k[2], True), (k[1], False)]
    assert directory.changes(incarnation, 0)["full"] == [k[2]]  # behind the log
    assert directory.changes("another incarnation", 5)["full"] == [k[2]]
    assert directory.publish([k[3]], [np.zeros(3 * BLOCK, np.uint8)]) == (0, 0)  # larger than the capacity
    assert [ref is None for ref in directory.lookup(k)] == [True, True, False, True]


def test_connector_loads_from_the_cluster_into_the_host_tier(make_tier):
    from raylm.cache.offload import HostTier, KVConnector

    writer = make_tier()
    writer.put([(key, payload(i)) for i, key in enumerate(keys(2))])
    host = HostTier(8 * BLOCK)
    connector = KVConnector([host, make_tier()], SPACE, BLOCK)
    try:
        assert connector.lookup([0, 1, 2]) == 2
        ticket = connector.start_load([0, 1, 2])
        connector.wait(10)
        got = connector.poll()[ticket]
        assert [p.tobytes() for p in got] == [payload(0).tobytes(), payload(1).tobytes()]
        assert host.contains(keys(2)) == 2
    finally:
        connector.close()


def test_load_beyond_its_timeout_is_a_counted_miss(make_tier):
    writer = make_tier()
    writer.put([(keys(1)[0], payload(0))])
    impatient = make_tier(load_timeout_s=1e-6)  # no directory call answers within a microsecond
    assert impatient.contains(keys(1)) == 1
    assert impatient.get(keys(1)) == [None]
    stats = impatient.stats()
    assert stats.errors == {"timeout": 1} and stats.misses == 1
    assert impatient.contains(keys(1)) == 1  # a slow answer is no reason to forget the block

