"""Every model family through the batching engine: greedy tokens equal HF transformers' own
greedy decoding on the same weights, with batching, paging, prefix caching, chunked prefill and
preemption (sliding windows, soft-caps, q/k norms, sandwich norms, fused checkpoints included).
Where the C++ CPU kernels are built the engine runs them (decode and packed prompt attention
by the paged kernel, windows and soft-caps included), so this checks them against HF too."""

from __future__ import annotations

import numpy as np
import pytest

from model import load_model, paged_decode
from tests.checkpoints import build_tiny_checkpoint
from tests.reference import hf_greedy
from workers import LLM, SamplingParams

FAMILIES = ["qwen3", "mistral-sliding", "gemma2", "gemma3", "phi3-longrope"]
NEW_TOKENS = 20
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# Each setting is one of the ways a sequence's K/V reach attention differently.
ENGINE_SETTINGS = {
    "batched-paged-prefix-cached": dict(num_kv_blocks=400),
    "chunked-small-batches": dict(num_kv_blocks=400, max_num_seqs=3, max_num_batched_tokens=24),
    "preempted": dict(num_kv_blocks=24, max_num_batched_tokens=32),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(loaded model, prompts, HF's greedy continuations) for one family."""
    path, hf_model = build_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "m")
    rng = np.random.RandomState(1)
    lengths = [1, 15, 17, 40, 90] + rng.randint(2, 120, size=3).tolist()
    prompts = [rng.randint(3, 320, size=n).tolist() for n in lengths]
    return load_model(path), prompts, [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("setting", sorted(ENGINE_SETTINGS))
def test_engine_greedy_equals_hf(family, setting):
    model, prompts, expected = family
    llm = LLM(model, max_model_len=256, **ENGINE_SETTINGS[setting])
    assert llm.engine.runner.cpu_kernels == paged_decode.available()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    stats = llm.engine.stats()
    if setting == "preempted":
        assert stats.num_preemptions > 0
    if setting == "batched-paged-prefix-cached":  # the same prompts again come from the prefix cache
        hits = stats.pool.prefix_hits
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert llm.engine.stats().pool.prefix_hits > hits
    stats = llm.engine.stats()
    assert stats.pool.num_used_blocks == 0 and stats.running == 0 and stats.waiting == 0
