"""A mesh over two processes on Ray: the leader (an actor, as a replica is) and one follower actor
it starts (workers/serve/multihost_actors.py), the plans relayed by actor calls, serve the greedy
tokens of HF's model at TP=2 (one CPU device each, gloo collectives), warmed up first: the warm-up's
programs run on both processes, in the leader's order."""

from __future__ import annotations

import time

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
        # Its follower goes with it (an actor's owner took it along), asynchronously.
        deadline = time.monotonic() + 30
        while _alive_followers() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive_followers()


def _alive_followers() -> list[dict]:
    import ray

    return [a for a in ray._private.state.actors().values()
            if a["ActorClassName"] == "MeshFollower" and a["State"] == "ALIVE"]


def test_a_served_replica_over_two_hosts_answers_http(serve_cluster, checkpoint):
    """The deploy path: ``workers.num_hosts: 2`` builds a replica whose actor leads a follower in
    its placement group (PACKed: the test cluster is one node); its greedy completion is the one
    process's."""
    import httpx

    from raylm.model.loaders.load import load_model
    from raylm.workers.engine.llm import LLM

    prompt = _prompts()[1]
    raw = {"name": "multihost", "model": {"name": str(checkpoint)},
           "workers": {"num_replicas": 1, "num_cpus": 1, "tensor_parallel_size": 2, "num_hosts": 2,
                       "host_placement": "PACK", "graceful_shutdown_timeout_s": 5},
           "engine": ENGINE}
    app = serve_cluster.deploy(raw, route_prefix="/multihost")
    try:
        reply = httpx.post(f"{app.base_url}/v1/completions", timeout=120, json={
            "model": app.model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        params = dict(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        from raylm.workers.core.sampling_params import SamplingParams

        (one,) = LLM(load_model(checkpoint), **ENGINE).generate([{"prompt_token_ids": prompt}], SamplingParams(**params))
        assert reply.json()["choices"][0]["text"] == one.outputs[0].text
        assert reply.json()["usage"]["completion_tokens"] == NEW_TOKENS
        assert len(_alive_followers()) == 1  # the replica's other host
    finally:
        serve_cluster.remove(app)
