"""Expert-parallel replicas through the batching engine (chunked prompts, several sequences per
step): greedy tokens equal HF transformers' on the same weights, and the per-expert load counts
equal those HF's own routers give over the tokens the engine computed. A shared-expert family
(Qwen2-MoE: a gated shared expert, experts on every other layer) and a plain one (Mixtral) at
EP=2 over the suite's two forced host devices; Qwen3-MoE (8 experts, a dense layer among the
sparse ones) at EP=4 in a child process with four."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

from raylm.model.loaders.load import load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint
from tests.reference import hf_greedy
from tests.reruns import rerun_in_child

NEW_TOKENS = 12


def _hf_expert_load(hf_model, sequences: list[list[int]], top_k: int) -> tuple[tuple[int, ...], ...]:
    """Tokens routed to each expert of each sparse layer when HF runs ``sequences``: the top-k
    of its router logits (softmax keeps their order), counted."""
    totals = None
    with torch.no_grad():
        for ids in sequences:
            logits = hf_model(torch.tensor([ids]), output_router_logits=True).router_logits
            counts = [np.bincount(layer.topk(top_k, dim=-1).indices.numpy().ravel(), minlength=layer.shape[-1])
                      for layer in logits]
            totals = counts if totals is None else [a + b for a, b in zip(totals, counts)]
    return tuple(tuple(int(c) for c in layer) for layer in totals)


def _split_engine_equals_hf(tmp_path, family: str, ep: int) -> None:
    path, hf_model = build_tiny_checkpoint(family, tmp_path / family)
    model = load_model(path)
    rng = np.random.RandomState(5)
    prompts = [rng.randint(3, 320, size=n).tolist() for n in (1, 15, 40, 70)]
    expected = [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]
    llm = LLM(model, max_model_len=128, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=24,
              expert_parallel_size=ep)
    layer = next(lp for lp in llm.engine.runner.params.layers if lp.w_experts_gate_up is not None)
    assert layer.w_experts_gate_up.addressable_shards[0].data.shape[0] == model.config.moe.num_experts // ep
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # Every prompt token and every fed-back output token (all but the last) went through the experts once.
    computed = [p + e[:-1] for p, e in zip(prompts, expected)]
    moe = llm.engine.stats().moe
    assert moe.expert_parallel_size == ep
    assert moe.routed_tokens == _hf_expert_load(hf_model, computed, model.config.moe.top_k)


@pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 devices (XLA_FLAGS set in conftest)")
@pytest.mark.parametrize("family", ["qwen2-moe", "mixtral"])
def test_two_way_split_equals_hf(tmp_path, family):
    _split_engine_equals_hf(tmp_path, family, 2)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices: test_four_way_split_on_four_devices runs it")
def test_four_way_split_equals_hf(tmp_path):
    _split_engine_equals_hf(tmp_path, "qwen3-moe", 4)


def test_four_way_split_on_four_devices():
    """The test above in a child process with four forced host devices."""
    rerun_in_child(__file__, "test_four_way_split_equals_hf", {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
                   expected="1 passed")
