"""Models that interleave sliding and full-attention layers (the tiny "gemma2" and "gemma3",
sliding layers 0 and 2 with a 16-token window, layer 1 full; the tiny "llama4", layers 0-2
attending within 16-token chunks, layer 3 full) through the engine: the sliding (chunked)
layers keep a KV group of their own, whose blocks go back to its pool behind the window while
the full-attention group keeps every block. Generations past the window equal HF's greedy
tokens; the sliding group's used blocks stay bounded while the full group's grow. A pool smaller
than the sequences' contexts preempts, with prefix caching, chunked prefill, forks (n = 2) and a
draft model (the first two layers, reading the full group's table) all on."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raylm.model.loaders.load import load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from raylm.workers.engine.llm_engine import LLMEngine
from tests.checkpoints import build_tiny_checkpoint
from tests.workers.test_sliding_window_engine import _assert_hf_greedy, _run

WINDOW = 16  # the variants' sliding window (llama4: its attention chunk)
BLOCK = 8
BUDGET = 32  # max_num_batched_tokens: the longest prompt chunk
NEW_TOKENS = 100
HELD_IN_PREFILL = math.ceil((WINDOW + BUDGET) / BLOCK) + 1  # as in test_sliding_window_engine.py
HELD_IN_DECODE = math.ceil((WINDOW + 1) / BLOCK) + 1
# Each variant's KV group per layer: 1 for the layers whose blocks go back behind their span.
GROUPS = {"gemma2": [1, 0, 1], "gemma3": [1, 0, 1], "llama4": [1, 1, 1, 0]}
VARIANTS = tuple(GROUPS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per variant, built once: (engine model, HF model)."""
    return {variant: build_tiny_checkpoint(variant, tmp_path_factory.mktemp(variant)) for variant in VARIANTS}


def _checkpoint(checkpoints, variant: str):
    """(engine model, HF model, prompts: the second extends the first, so it hits the cache)."""
    path, hf_model = checkpoints[variant]
    rng = np.random.RandomState(5)
    first = rng.randint(3, 320, size=40).tolist()
    prompts = [first, first + rng.randint(3, 320, size=17).tolist(), rng.randint(3, 320, size=23).tolist()]
    return load_model(path), hf_model, prompts


def _used(engine: LLMEngine) -> tuple[int, int]:
    """(full, sliding) group's blocks in use."""
    return engine.pool.num_used_blocks, engine.blocks.sliding.num_used_blocks


@pytest.mark.parametrize("variant", VARIANTS)
def test_generation_past_the_window_equals_hf_and_only_the_sliding_group_stays_bounded(checkpoints, variant):
    model, hf_model, prompts = _checkpoint(checkpoints, variant)
    assert [model.config.kv_group(i) for i in range(model.config.num_layers)] == GROUPS[variant]
    llm = LLM(model, block_size=BLOCK, num_kv_blocks=61, max_num_batched_tokens=BUDGET, max_model_len=512)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs, used = _run(llm, prompts, params, _used)
    _assert_hf_greedy(hf_model, prompts, [o[0] for o in outputs], NEW_TOKENS)
    full, sliding = zip(*used)
    contexts = sum(math.ceil((len(p) + NEW_TOKENS - 1) / BLOCK) for p in prompts)  # 54 blocks at the end
    assert max(full) >= contexts - 8  # the full group holds every block (4 of the first's shared)
    assert max(sliding) <= len(prompts) * HELD_IN_PREFILL
    assert max(sliding[-NEW_TOKENS // 2:]) <= len(prompts) * HELD_IN_DECODE  # 12 while decoding
    stats = llm.engine.stats()
    assert stats.pool.prefix_hits > 0 and stats.num_preemptions == 0
    assert used[-1] == (0, 0)


def test_preemption_prefix_caching_forks_and_a_draft_model_still_equal_hf(checkpoints):
    """Two completions each of the last two prompts of Gemma 3 (forked from their prompt's
    blocks) with a 2-layer draft guessing 3 tokens a step, in a pool of 24 blocks per group where
    they want about 35: they preempt each other and recompute from the prefix cache."""
    model, hf_model, prompts = _checkpoint(checkpoints, "gemma3")
    new_tokens = 48
    llm = LLM(model, block_size=BLOCK, num_kv_blocks=25, max_num_batched_tokens=BUDGET, max_model_len=512,
              speculative=dict(method="draft", num_layers=2, num_speculative_tokens=3))
    params = SamplingParams(n=2, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs, used = _run(llm, prompts[1:], params, _used)
    assert all(a == b for a, b in outputs)
    _assert_hf_greedy(hf_model, prompts[1:], [a for a, _ in outputs], new_tokens)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec.num_draft_tokens > 0
    assert used[-1] == (0, 0)


def test_a_memory_budget_sizes_the_sliding_group_for_its_windows_and_gives_the_full_group_the_rest(checkpoints):
    """Gemma 2's tiny variant: 2 sliding layers, 1 full. The sliding group gets what 4 sequences
    can hold at once (each its window and a decode step, a chunk on top, a block of misalignment
    each), the full group everything else: far more blocks than one count for all layers."""
    model, _, _ = _checkpoint(checkpoints, "gemma2")
    c = model.config
    layer_block = 2 * BLOCK * c.num_kv_heads * c.head_dim * 4  # K+V of one layer's block, float32
    budget = 1000 * c.num_layers * layer_block  # 1000 blocks of every layer
    engine = LLM(model, block_size=BLOCK, kv_cache_memory_bytes=budget, max_num_seqs=4, num_scheduler_steps=4,
                 max_num_batched_tokens=BUDGET, max_model_len=512, dtype="float32").engine
    sliding = 4 * (math.ceil((WINDOW + 4) / BLOCK) + 2) + BUDGET // BLOCK + 1  # 25
    full = (budget - sliding * 2 * layer_block) // layer_block  # 2950
    assert (engine.pool.num_blocks, engine.blocks.sliding.num_blocks) == (full, sliding)
    kv = engine.runner.kv
    assert kv.full.k.shape[:2] == (1, full) and kv.sliding.k.shape[:2] == (2, sliding)
