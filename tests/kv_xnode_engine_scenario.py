"""Engines on two nodes sharing prefixes through the KV cluster tier, on one machine.

Run as ``python -m tests.kv_xnode_engine_scenario`` (``tests/cluster/test_kv_xnode_engine.py`` does).
It starts its own two-node Ray cluster (``ray.cluster_utils.Cluster``: the head with resource
``node_a``, a second raylet with ``node_b``, each with its own object store) under a private temp
dir (``RAY_TMPDIR``: no other cluster on the machine is touched or found). The KV directory is
started on the head, node A: every published block's primary copy lives in A's object store, so
what node B loads crosses raylets (Ray's object transfer). Then:

* replica A (an engine on node A, cluster tier only: no host tier, so nothing is served from
  its own memory) runs prompts of 1..5 full 16-token blocks and more, greedy, and flushes what
  it published;
* replica B (an engine on node B, same checkpoint and settings) refreshes its tier and runs the
  same prompts: it loads their prefixes from the cluster tier;
* A runs a second set of prompts, flushes, and is killed (``ray.kill``); B, its pool's prefix
  cache emptied, runs them and still loads what the dead replica published;
* a third engine with offload off, on node B, computes the reference tokens of both sets.

The checkpoint is written once, to a temp dir both nodes read, before any actor starts. It prints
one JSON line with its findings (and how long it took) and always tears the cluster down.
"""

from __future__ import annotations

import os
import tempfile

_TEMP_DIR = tempfile.mkdtemp(prefix="rkvx", dir="/tmp")  # short: Ray's socket paths live under it
os.environ["RAY_TMPDIR"] = _TEMP_DIR

from raylm.cluster.local_ray import apply_local_ray_env  # noqa: E402

apply_local_ray_env()  # before ray is imported

import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from raylm.cluster.adapter_store import NAMESPACE  # noqa: E402
from raylm.cluster.kv_directory import DIRECTORY_NAME, KVDirectory  # noqa: E402
from tests.checkpoints import build_tiny_checkpoint  # noqa: E402
from tests.multinode_scenario import tear_down_private_cluster  # noqa: E402

MIB = 1 << 20
BLOCK_SIZE = 16
NEW_TOKENS = 6
CLUSTER_ONLY = {"cluster_bytes": 64 * MIB, "load_timeout_s": 30.0}
# The three engines compile the same programs: the persistent XLA cache lets the later ones reuse them.
ENGINE: dict[str, Any] = {"num_kv_blocks": 96, "max_model_len": 256, "max_num_seqs": 4, "max_num_batched_tokens": 128,
                          "compilation_cache_dir": "~/.cache/raylm/jax"}


def prompt_sets() -> tuple[list[list[int]], list[list[int]]]:
    """Two sets of prompts of 1 to 5 full blocks and a tail, and one shorter than a block (nothing
    to load); three prompts (two in the first set, one in the second) share a 40-token prefix."""
    rng = np.random.RandomState(7)
    shared = rng.randint(3, 320, size=40).tolist()

    def one_set() -> list[list[int]]:
        lengths = [17, 40, 57, 75, 88]
        prompts = [rng.randint(3, 320, size=n).tolist() for n in lengths]
        return prompts + [shared + rng.randint(3, 320, size=30).tolist(), rng.randint(3, 320, size=9).tolist()]

    first = one_set() + [shared + rng.randint(3, 320, size=25).tolist()]
    return first, one_set()


class EngineReplica:
    """One engine (``raylm.workers.engine.llm.LLM``) in a process pinned to one node."""

    def __init__(self, checkpoint: str, kv_offload: dict[str, Any] | None):
        from raylm.workers.core.sampling_params import SamplingParams
        from raylm.workers.engine.llm import LLM

        self.llm = LLM(checkpoint, kv_offload=kv_offload, **ENGINE)
        self.params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def generate(self, prompts: list[list[int]]) -> list[list[int]]:
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params)
        return [list(o.outputs[0].token_ids) for o in outputs]

    def flush(self) -> None:
        self.llm.engine.flush_kv_publish(30.0)

    def refresh(self) -> None:
        self.llm.engine.refresh_kv_tiers(10.0)

    def empty_prefix_cache(self) -> None:
        """Forget the pool's cached prefixes, so the next prompts load them again."""
        self.llm.engine.pool.reset_prefix_cache()

    def counters(self) -> dict[str, Any]:
        stats = self.llm.engine.stats()
        tiers = [dataclasses.asdict(t) for t in stats.kv_offload] if stats.kv_offload is not None else None
        return {"loaded_tokens": self.llm.engine.scheduler.loads.num_loaded_tokens, "tiers": tiers,
                "prefix_hits": stats.pool.prefix_hits, "used_blocks": stats.pool.num_used_blocks}


class NodeDirectory(KVDirectory):
    """The KV directory, able to say which node it runs on."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def on_node(cls: type, resource: str):
    return ray.remote(cls).options(num_cpus=0, resources={resource: 0.01})


def run() -> dict[str, Any]:
    started = time.perf_counter()
    result: dict[str, Any] = {"ok": False}
    checkpoint_dir = Path(_TEMP_DIR) / "checkpoint"
    checkpoint, _ = build_tiny_checkpoint("llama-gqa", checkpoint_dir)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 1}, "object_store_memory": 200 * MIB, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=200 * MIB)
        ray.init(address=cluster.address, log_to_driver=False)
        directory = ray.remote(NodeDirectory).options(
            name=DIRECTORY_NAME, namespace=NAMESPACE, lifetime="detached", num_cpus=0,
            resources={"node_a": 0.01}).remote(64 * MIB)
        first, second = prompt_sets()
        result["prompt_lengths"] = [[len(p) for p in first], [len(p) for p in second]]

        a = on_node(EngineReplica, "node_a").remote(str(checkpoint), CLUSTER_ONLY)
        b = on_node(EngineReplica, "node_b").remote(str(checkpoint), CLUSTER_ONLY)
        reference = on_node(EngineReplica, "node_b").remote(str(checkpoint), None)
        result["nodes"] = {"directory": ray.get(directory.node.remote()), "a": ray.get(a.node.remote()),
                           "b": ray.get(b.node.remote()), "head": ray.get_runtime_context().get_node_id()}
        result["reference"] = ray.get(reference.generate.remote(first + second))
        result["started_s"] = round(time.perf_counter() - started, 1)

        # Both alive: A computes and publishes, B loads.
        result["a_tokens"] = ray.get(a.generate.remote(first))
        ray.get(a.flush.remote())
        result["a_after_first"] = ray.get(a.counters.remote())
        ray.get(b.refresh.remote())
        result["b_tokens"] = ray.get(b.generate.remote(first))
        result["b_after_first"] = ray.get(b.counters.remote())

        # A publishes the second set and dies; B loads what it left.
        result["a_second_tokens"] = ray.get(a.generate.remote(second))
        ray.get(a.flush.remote())
        result["a_after_second"] = ray.get(a.counters.remote())
        ray.kill(a)
        result["a_killed"] = False
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # ray.kill is asynchronous: a call may still be answered
            try:
                ray.get(a.node.remote(), timeout=5)
            except ray.exceptions.RayActorError:
                result["a_killed"] = True
                break
            time.sleep(0.2)
        ray.get(b.empty_prefix_cache.remote())
        ray.get(b.refresh.remote())
        result["b_second_tokens"] = ray.get(b.generate.remote(second))
        result["b_after_second"] = ray.get(b.counters.remote())
        result["directory_blocks"] = ray.get(directory.changes.remote(None, 0))["stored_blocks"]
        result["ok"] = True
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        result["leftover_pids"] = tear_down_private_cluster(cluster, _TEMP_DIR)
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


if __name__ == "__main__":
    print(json.dumps(run()), flush=True)
