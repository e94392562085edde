"""The KV cluster tier across nodes, on one machine.

Run as ``python -m tests.kv_cluster_scenario`` (``tests/cluster/test_kv_cluster_tier.py`` does). It
starts its own two-node Ray cluster (``ray.cluster_utils.Cluster``: two raylets, each with its own
object store) under a private temp dir (``RAY_TMPDIR``, so no other cluster on the machine is
touched or found), with the KV directory on node A, and checks that

* blocks published by an actor on node A are fetched, bit for bit, by a replica's tier on node B
  (Ray's object transfer) and by one on node A (the store's shared memory: read-only views).

(That blocks outlive their publisher is tested in-process, where the test can wait until what the
publisher owned is gone.)

It prints one JSON line with its findings (and the cross-node fetch rate, for information) and
always tears the cluster down.
"""

from __future__ import annotations

import os
import tempfile

_TEMP_DIR = tempfile.mkdtemp(prefix="rkv", dir="/tmp")  # short: Ray's socket paths live under it
os.environ["RAY_TMPDIR"] = _TEMP_DIR

from raylm.cluster.local_ray import apply_local_ray_env  # noqa: E402

apply_local_ray_env()  # before ray is imported

import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from raylm.cache.offload import namespace, tier_keys  # noqa: E402
from raylm.cluster.adapter_store import NAMESPACE  # noqa: E402
from raylm.cluster.kv_cluster_tier import ClusterTier  # noqa: E402
from raylm.cluster.kv_directory import DIRECTORY_NAME, KVDirectory  # noqa: E402
from tests.multinode_scenario import tear_down_private_cluster  # noqa: E402

MIB = 1 << 20
BLOCK = 1 * MIB
NUM_BLOCKS = 16
KEYS = tier_keys(namespace("kv-cluster-scenario"), list(range(NUM_BLOCKS)))


def payload(i: int) -> np.ndarray:
    return ((np.arange(BLOCK, dtype=np.int64) * 7 + i * 13) % 251).astype(np.uint8)


class Replica:
    """A replica's cluster tier in a process pinned to one node."""

    def __init__(self) -> None:
        self.tier = ClusterTier(64 * MIB, load_timeout_s=30.0)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def publish(self, first: int, count: int) -> int:
        self.tier.put([(KEYS[i], payload(i)) for i in range(first, first + count)])
        return self.tier.stats().stored

    def fetch(self) -> dict[str, Any]:
        """Which blocks came back equal to what was published, read-only, and how fast."""
        self.tier.refresh(10)
        start = time.perf_counter()
        got = self.tier.get(KEYS)
        seconds = time.perf_counter() - start
        return {
            "contains": self.tier.contains(KEYS),
            "equal": [p is not None and np.array_equal(p, payload(i)) for i, p in enumerate(got)],
            "read_only": [p is not None and not p.flags.writeable for p in got],
            "gb_per_s": NUM_BLOCKS * BLOCK / seconds / 1e9,
            "errors": self.tier.stats().errors,
        }


def on_node(resource: str):
    return ray.remote(Replica).options(num_cpus=0, resources={resource: 0.01})


def run() -> dict[str, Any]:
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 1}, "object_store_memory": 200 * MIB, "include_dashboard": False})
    result: dict[str, Any] = {"ok": False}
    try:
        cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=200 * MIB)
        ray.init(address=cluster.address, log_to_driver=False)
        directory = ray.remote(KVDirectory).options(
            name=DIRECTORY_NAME, namespace=NAMESPACE, lifetime="detached", num_cpus=0,
            resources={"node_a": 0.01}).remote(64 * MIB)
        ray.get(directory.reserve.remote(0))

        publisher, reader_b, reader_a = on_node("node_a").remote(), on_node("node_b").remote(), on_node("node_a").remote()
        result["nodes"] = {"publisher": ray.get(publisher.node.remote()), "reader_b": ray.get(reader_b.node.remote()),
                           "reader_a": ray.get(reader_a.node.remote())}
        result["stored"] = ray.get(publisher.publish.remote(0, NUM_BLOCKS))
        result["cross_node"] = ray.get(reader_b.fetch.remote())
        result["same_node"] = ray.get(reader_a.fetch.remote())
        result["ok"] = True
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        result["leftover_pids"] = tear_down_private_cluster(cluster, _TEMP_DIR)
    return result


if __name__ == "__main__":
    print(json.dumps(run()), flush=True)
