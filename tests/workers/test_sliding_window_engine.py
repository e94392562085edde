"""A long generation of a model whose every layer slides (the tiny "mistral-sliding", a 16-token
window) through the engine: greedy tokens equal HF's, and the blocks the window left behind go
back to the pool, so the pool's used blocks stay bounded by the window where full attention (the
same weights without the window) fills the pool. Prefix caching and chunked prefill on; a pool
smaller than one sequence's whole context forces preemptions; forks (n = 2) and a windowed
draft model share the block tables; beam search reuses released prefixes from the cache."""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np
import pytest
import torch

from raylm.model.loaders.load import load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.beam_search import BeamSearchParams
from raylm.workers.engine.llm import LLM
from raylm.workers.engine.llm_engine import LLMEngine
from tests.checkpoints import build_tiny_checkpoint
from tests.reference import hf_greedy_choices
from tests.workers.test_beam_search import _naive_beam_search

WINDOW = 16  # the "mistral-sliding" variant's
BLOCK = 8
BUDGET = 32  # max_num_batched_tokens: the longest prompt chunk
NEW_TOKENS = 300
# Every block a sequence's next step can touch: the window's keys before its first position and
# the step's tokens, at any alignment to block edges (and one position of draft-model lag).
HELD_IN_PREFILL = math.ceil((WINDOW + BUDGET) / BLOCK) + 1
HELD_IN_DECODE = math.ceil((WINDOW + 1) / BLOCK) + 1
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(windowed model, its HF model, prompts, the same weights without a window)."""
    root = tmp_path_factory.mktemp("sliding")
    path, hf_model = build_tiny_checkpoint("mistral-sliding", root / "window")
    full_path, _ = build_tiny_checkpoint("mistral-sliding", root / "full", sliding_window=None)
    rng = np.random.RandomState(3)
    first = rng.randint(3, 320, size=40).tolist()
    # The second extends the first: admitted after the first's first chunk is computed, it reuses
    # blocks of it that the first has already released (they stay in the prefix cache).
    prompts = [first, first + rng.randint(3, 320, size=17).tolist(), rng.randint(3, 320, size=23).tolist()]
    return load_model(path), hf_model, prompts, load_model(full_path)


def _assert_hf_greedy(hf_model, prompts: list[list[int]], completions: list[list[int]], n: int = NEW_TOKENS) -> None:
    for prompt, tokens in zip(prompts, completions):
        assert len(tokens) == n and tokens == hf_greedy_choices(hf_model, prompt, tokens)


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams,
         measure: Callable[[LLMEngine], Any] = lambda engine: engine.pool.num_used_blocks) -> tuple[list, list]:
    """Every request to the end; (each request's completions' tokens, ``measure`` (used blocks)
    after every step)."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    final, used = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = [c.token_ids for c in out.outputs]
        used.append(measure(engine))
    return [final[str(i)] for i in range(len(prompts))], used


def test_windowed_generation_equals_hf_and_its_blocks_stay_bounded_where_full_attention_fills_the_pool(checkpoints):
    model, hf_model, prompts, full_model = checkpoints
    settings = dict(block_size=BLOCK, num_kv_blocks=61, max_num_batched_tokens=BUDGET, max_model_len=512)
    llm = LLM(model, **settings)
    outputs, used = _run(llm, prompts, GREEDY)
    _assert_hf_greedy(hf_model, prompts, [o[0] for o in outputs])
    stats = llm.engine.stats()
    # (in tokens) the first's first chunk: 4 blocks, 2 of them released by then
    assert stats.pool.prefix_hits == 4 * BLOCK
    assert max(used) <= len(prompts) * HELD_IN_PREFILL < 60 // 2
    assert max(used[-NEW_TOKENS // 2:]) <= len(prompts) * HELD_IN_DECODE  # decoding only
    assert stats.pool.num_used_blocks == 0

    full = LLM(full_model, **settings)
    _, full_used = _run(full, prompts, GREEDY)
    assert max(full_used) >= 60 - 2  # a sequence of 357 tokens alone wants 45 blocks


def test_a_pool_smaller_than_one_context_preempts_and_still_equals_hf(checkpoints):
    """357 tokens are 45 blocks; the pool has 8. Without the window these requests would be cut to
    the pool ("length" after 8 to 42 tokens); with it the sequences preempt each other while their
    prompts compete, then decode in their windows."""
    model, hf_model, prompts, _ = checkpoints
    llm = LLM(model, block_size=BLOCK, num_kv_blocks=9, max_num_batched_tokens=BUDGET, max_model_len=512)
    outputs, used = _run(llm, prompts, GREEDY)
    _assert_hf_greedy(hf_model, prompts, [o[0] for o in outputs])
    assert llm.engine.stats().num_preemptions > 0 and max(used) <= 8


def test_forks_and_a_windowed_draft_model_share_the_released_tables(checkpoints):
    """n = 2 greedy completions (the second forked from the first's prompt blocks, copy-on-write)
    with the model itself as its draft guessing 3 tokens a step: every guess is right, so the
    draft is always one token behind (it recomputes that token, reading one position further
    back): a block released too early would make it guess wrong."""
    model, hf_model, prompts, _ = checkpoints
    new_tokens = 160
    llm = LLM(model, block_size=BLOCK, num_kv_blocks=61, max_num_batched_tokens=BUDGET, max_model_len=512,
              speculative=dict(method="draft", num_layers=3, num_speculative_tokens=3))
    params = SamplingParams(n=2, max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs, used = _run(llm, prompts[1:], params)
    assert all(a == b for a, b in outputs)
    _assert_hf_greedy(hf_model, prompts[1:], [a for a, _ in outputs], new_tokens)
    spec = llm.engine.stats().spec
    assert spec.num_accepted_tokens == spec.num_draft_tokens > 0
    held_in_spec = math.ceil((WINDOW + 1 + 3) / BLOCK) + 1
    assert max(used[-new_tokens // 8:]) <= 2 * len(prompts[1:]) * held_in_spec


def test_blocks_are_released_only_when_the_draft_model_slides_too(checkpoints):
    model, _, _, full_model = checkpoints
    assert model.first_layers(2).config.layer_windows == (WINDOW, WINDOW)
    for draft, window in [(dict(num_layers=2), WINDOW), (dict(model=full_model), None)]:
        llm = LLM(model, num_kv_blocks=8, speculative=dict(method="draft", **draft))
        assert llm.engine.blocks.window == window


class _HFLogits:
    """HF's logits of a whole sequence, as the naive beam search asks for them."""

    def __init__(self, hf_model):
        self.hf_model = hf_model

    def prompt_logits(self, ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return self.hf_model(torch.tensor([ids])).logits[0].numpy()


def test_beam_search_over_released_and_evicted_prefixes_equals_a_naive_one(checkpoints):
    """Every beam step is a new request for its beam's tokens: its prefix comes from the cache
    only through blocks still there (released ones evicted by the small pool are recomputed)."""
    model, hf_model, prompts, _ = checkpoints
    llm = LLM(model, block_size=BLOCK, num_kv_blocks=16, max_num_batched_tokens=BUDGET, max_model_len=512)
    params = BeamSearchParams(beam_width=3, max_tokens=12)
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts[1:]], params)
    for prompt, beams in zip(prompts[1:], results):
        expected = _naive_beam_search(_HFLogits(hf_model), prompt, 3, 12, frozenset(model.config.eos_token_ids), 1.0)
        assert [b.token_ids for b in beams] == [tokens for tokens, _ in expected]
        np.testing.assert_allclose([b.cumulative_logprob for b in beams], [cum for _, cum in expected], atol=2e-4)
    assert llm.engine.stats().pool.prefix_hits > 0
