"""A mesh over two processes on Ray: the leader (an actor, as a replica is) and one follower actor
it starts (workers/serve/multihost_actors.py), the plans relayed by actor calls, serve the greedy
tokens of HF's model at TP=2 (one CPU device each, gloo collectives), warmed up first: the warm-up's
programs run on both processes, in the leader's order."""

from __future__ import annotations

import pytest
import transformers

from tests.checkpoints import build_tiny_checkpoint
from tests.multihost_leader import CHILD_ENV, RayLeader
from tests.reference import hf_greedy
from tests.workers.test_multihost import ENGINE, NEW_TOKENS, _prompts


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("multihost-ray") / "m")
    return path


def test_tp2_over_two_ray_actors_equals_hf(serve_cluster, checkpoint):
    import ray

    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype="float32")
    expected = [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in _prompts()]
    leader = ray.remote(RayLeader).options(num_cpus=1, runtime_env={"env_vars": CHILD_ENV}).remote(
        str(checkpoint), dict(ENGINE, tensor_parallel_size=2, num_hosts=2, warmup=True))
    try:
        result = ray.get(leader.greedy.remote(_prompts(), NEW_TOKENS), timeout=180)
        assert result["tokens"] == expected
        relay_s = sorted(result["relay_s"])
        print(f"relay per step: median {relay_s[len(relay_s) // 2] * 1e3:.2f} ms, "
              f"max {relay_s[-1] * 1e3:.2f} ms; step {result['step_s'] * 1e3:.1f} ms")
    finally:
        ray.kill(leader)
