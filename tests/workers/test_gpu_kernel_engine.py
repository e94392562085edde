"""The engine with its attention through the Pallas GPU kernel (run in interpret mode on the
CPU) gives the jnp path's greedy tokens and logprobs.

The kernel itself is checked in tests/model/test_pallas_paged_attention.py; here it is wired into
whole prompt and decode programs as a GPU replica runs them (``gpu_kernels``), for the attention
kinds models bring: GQA, sliding windows beside full layers (their own KV groups) with
soft-caps, sink logits, an 8-bit pool, multi-step decode, speculation (the target verifies
through the kernel), prompts split into chunks and chunks after a cached prefix, tensor parallelism; and the experts of MoE layers through the grouped kernel.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import raylm.workers.runner.model_runner as runner_module
from raylm.model.decoder.kv_pool import KVCache
from raylm.model.kernels import grouped_matmul as grouped
from raylm.model.kernels import interpreting_gpu_kernels
from raylm.model.kernels.pallas import paged_attention as pallas
from raylm.model.loaders.load import load_model
from raylm.model.runtime.sharding import make_mesh
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from raylm.workers.runner import platform_kernels
from tests.checkpoints import build_tiny_checkpoint

CASES = {
    "llama-gqa": ("llama-gqa", dict(num_scheduler_steps=4, max_num_batched_tokens=32)),
    # The target as its own draft: its guesses are accepted, so verification accepts and rejects.
    "llama-gqa-int8-kv-speculation": ("llama-gqa", dict(kv_cache_dtype="int8", speculative="self-draft")),
    "gemma2-sliding-softcap": ("gemma2", {}),
    "gpt-oss-sinks-experts": ("gpt-oss", {}),
    "qwen3-moe-experts": ("qwen3-moe", dict(num_scheduler_steps=2)),
    # Each device's KV heads and their query heads (and sinks) through a shard_map over tp.
    "gpt-oss-tensor-parallel-2": ("gpt-oss", dict(tensor_parallel_size=2)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-kernel")
    return {name: load_model(build_tiny_checkpoint(name, root / name)[0]) for name in {m for m, _ in CASES.values()}}


def _generate(model, gpu: bool, monkeypatch, engine: dict) -> tuple[list, list, LLM]:
    monkeypatch.setattr(runner_module, "cpu_kernels_run", lambda mesh, kv: False)
    monkeypatch.setattr(runner_module, "gpu_kernels_run", lambda mesh, kv, config, choice: gpu)
    rng = np.random.RandomState(5)
    shared = rng.randint(3, 120, size=37).tolist()  # the last prompt's first two blocks come cached
    prompts = [shared + [4, 5]] + [rng.randint(3, 120, size=n).tolist() for n in (3, 17, 40)] + [shared + [9] * 6]
    max_tokens = [30, 12, 26, 20, 10]  # contexts past the 16-token windows and across block ends
    if engine.get("speculative") == "self-draft":
        engine = dict(engine, speculative={"method": "draft", "model": model, "num_speculative_tokens": 3})
    llm = LLM(model, max_model_len=128, num_kv_blocks=48, max_num_seqs=4, **engine)  # the last prompt waits
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[float(getattr(entry[t], "logprob", entry[t]))
                 for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in outputs]
    return tokens, logprobs, llm


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_attention_through_the_pallas_kernel_matches_the_jnp_path(models, monkeypatch, case):
    name, engine = case
    want_tokens, want_logprobs, reference = _generate(models[name], False, monkeypatch, engine)
    calls = []
    traced = pallas.pallas_paged_attention
    monkeypatch.setattr(pallas, "pallas_paged_attention",
                        lambda q, *a, **k: calls.append(q.shape[1]) or traced(q, *a, **k))
    expert_calls = []
    experts = grouped.pallas_grouped_matmul
    monkeypatch.setattr(grouped, "pallas_grouped_matmul", lambda *a, **k: expert_calls.append(1) or experts(*a, **k))
    with interpreting_gpu_kernels():
        tokens, logprobs, llm = _generate(models[name], True, monkeypatch, engine)
    assert llm.engine.runner.gpu_kernels and not reference.engine.runner.gpu_kernels
    assert 1 in calls and max(calls) > 1, "prompt and decode programs both trace the Pallas kernel"
    assert bool(expert_calls) == bool(models[name].config.moe_layers), "MoE layers trace the grouped kernel"
    assert tokens == want_tokens
    for got, want in zip(logprobs, want_logprobs):
        np.testing.assert_allclose(got, want, atol=2e-4)
    assert llm.engine.pool.num_used_blocks == 0
    assert llm.engine.pool.prefix_hits >= 2
    if "speculative" in engine:  # guesses were verified, and some accepted
        assert llm.engine.scheduler.spec_stats.num_accepted_tokens > 0


def test_a_gpu_replica_takes_the_kernels_where_it_can(models, monkeypatch, caplog):
    """The choice (workers/runner/platform_kernels.py): on a GPU, sharded or not, unless
    ``gpu_attention: jnp``; never on a CPU. Attention the kernel cannot read is logged with the
    reason (its layers take the jnp path; the experts still take their kernel)."""
    config = models["llama-gqa"].config
    kv, one = KVCache.create(config, 8, 16, jnp.bfloat16, make_mesh(1)), make_mesh(1)
    assert not platform_kernels.gpu_kernels_run(one, kv, config, "pallas")  # this CPU
    monkeypatch.setattr(platform_kernels.jax, "default_backend", lambda: "gpu")
    with caplog.at_level("INFO", logger=platform_kernels.__name__):
        assert platform_kernels.gpu_kernels_run(one, kv, config, "pallas")
        assert not caplog.text
        assert not platform_kernels.gpu_kernels_run(one, kv, config, "jnp")
        assert platform_kernels.gpu_kernels_run(make_mesh(2), kv, config, "pallas")  # 2 KV heads over tp=2
        assert not caplog.text
        assert platform_kernels.gpu_kernels_run(make_mesh(2), kv, dataclasses.replace(config, num_kv_heads=1),
                                                "pallas")
        assert "does not divide the 1 KV heads" in caplog.text
        assert platform_kernels.gpu_kernels_run(one, kv, dataclasses.replace(config, head_dim=24), "pallas")
    assert "head size 24 is not a power of two" in caplog.text
    with pytest.raises(ValueError, match="gpu_attention must be one of"):
        platform_kernels.gpu_kernels_run(one, kv, config, "triton")
