"""LoRA adapters in the engine: batches mixing adapters and base rows, more adapters than device
slots (LRU), prefix caching and n-gram speculation, each request against HF transformers with
its adapter merged into the weights."""

from __future__ import annotations

import numpy as np
import pytest

from tests.checkpoints import build_tiny_checkpoint
from tests.lora_adapters import MODULES, write_adapter
from tests.reference import hf_greedy
from workers import LLM, LoRARequest, SamplingParams

NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# (rank, alpha, targets, rsLoRA) of five adapters: one more than the replica's slots.
ADAPTERS = [
    (4, 8, list(MODULES), False),
    (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], True),
    (2, 4, ["gate_proj", "up_proj", "down_proj"], False),
    (8, 8, ["q_proj", "v_proj"], False),
    (4, 4, ["o_proj", "down_proj"], True),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-engine")
    path, hf = build_tiny_checkpoint("llama-gqa", root / "base")
    requests, references = [None], [hf]
    for i, (rank, alpha, targets, rslora) in enumerate(ADAPTERS):
        directory, merged = write_adapter(root / f"adapter{i}", hf, rank, alpha, targets, seed=i, use_rslora=rslora)
        requests.append(LoRARequest(f"adapter{i}", i + 1, str(directory)))
        references.append(merged)
    return path, requests, references


def test_mixed_adapters_lru_slots_and_prefix_cache_match_merged_hf(served):
    path, requests, references = served
    rng = np.random.RandomState(0)
    # A 40-token prompt (two full blocks: prefix-cache entries) that repeats itself (n-gram
    # guesses from the first decode on), and a short one.
    prompts = [np.tile(rng.randint(3, 320, size=8), 5).tolist(), rng.randint(3, 320, size=5).tolist()]
    expected = {(p, a): hf_greedy(references[a], prompts[p], NEW_TOKENS)
                for p in range(len(prompts)) for a in range(len(requests))}
    assert len({tuple(tokens) for (p, _), tokens in expected.items() if p == 0}) == len(requests)  # adapters matter

    llm = LLM(str(path), enable_lora=True, max_loras=4, max_lora_rank=8, max_cpu_loras=5, max_num_seqs=16,
              num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=128,
              speculative=dict(method="ngram", num_speculative_tokens=3))
    engine = llm.engine
    # Round one: every (prompt, adapter) pair at once. Four adapters fill the slots and share
    # batches with base rows; the fifth waits until a slot's requests finish, then takes it.
    # Round two, in the other order: the prompt's cached blocks are reused by its own adapter only.
    for order in (range(len(requests)), reversed(range(len(requests)))):
        pairs = [(p, a) for a in order for p in range(len(prompts))]
        outputs = llm.generate([{"prompt_token_ids": prompts[p]} for p, _ in pairs], GREEDY,
                               lora_request=[requests[a] for _, a in pairs])
        for (p, a), out in zip(pairs, outputs):
            assert out.outputs[0].token_ids == expected[p, a], (p, a)
    slots = engine.scheduler.lora_slots
    assert sum(slots.loads.values()) > 4 and sum(slots.evictions.values()) > 0
    stats = engine.stats()
    assert stats.pool.prefix_hits > 0 and stats.spec.num_drafts > 0
    assert len(stats.lora.resident) == 4 and stats.lora.loads == dict(slots.loads) and stats.lora.in_use == 0
    # Nothing leaks: no slot held, no block used.
    assert slots.num_in_use == 0 and stats.running == stats.waiting == 0
    assert stats.pool.num_used_blocks == 0 and stats.pool.num_free_blocks == stats.pool.num_usable_blocks


def test_lora_requests_are_checked_when_they_arrive(served, tmp_path):
    path, requests, _ = served
    plain = LLM(str(path), max_model_len=64, num_kv_blocks=8)
    with pytest.raises(ValueError, match="enable_lora"):
        plain.generate("hi", GREEDY, lora_request=requests[1])
    llm = LLM(str(path), enable_lora=True, max_lora_rank=4, max_model_len=64, num_kv_blocks=8)
    with pytest.raises(ValueError, match="max_lora_rank 4"):
        llm.generate("hi", GREEDY, lora_request=requests[2])  # rank 8
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.generate("hi", GREEDY, lora_request=LoRARequest("gone", 9, str(tmp_path / "nowhere")))
    llm.engine.add_request("known", [5, 6], GREEDY, lora_request=requests[1])
    with pytest.raises(ValueError, match="is taken"):
        llm.engine.add_request("clash", [5, 6], GREEDY, lora_request=LoRARequest("adapter0", 1, str(tmp_path)))
    llm.engine.abort("known")
    assert not llm.engine.has_unfinished_requests()
