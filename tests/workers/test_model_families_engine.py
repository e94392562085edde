"""Every model family through the batching engine: greedy tokens equal HF transformers' own
greedy decoding on the same weights, with batching, paging, prefix caching, chunked prefill and
preemption, tensor parallelism and speculative decoding (sliding windows, soft-caps, q/k norms,
sandwich norms, Granite's multipliers, fused checkpoints, mixtures of experts included; for
these also n-gram speculation and structured output in one engine, and their per-expert load
counts). Where the
C++ CPU kernels are built the single-device engine runs them (decode and packed prompt attention
by the paged kernel, windows and soft-caps included), so this checks them against HF too."""

from __future__ import annotations

import functools
import re

import pytest

from raylm.model.kernels import paged_decode
from raylm.model.loaders.load import load_model
from raylm.workers.core.grammar import StructuredOutput
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.reference import family_cases

# (phi3-longrope switches RoPE factors at 32 tokens in HF, mid-sequence; raylm picks them by the
# served context: model/decoder/layers.py. Its prompt-level match is in tests/model/test_model_vs_hf.py.)
# (DeepSeek: V3's latent attention, its low-rank query and YaRN, and its experts (sigmoid, grouped,
# biased routing; a shared expert; a dense first layer); V2-Lite's differences are in the projections
# and its softmax routing, which tests/model/test_model_vs_hf.py checks.)
FAMILIES = ["qwen3", "mistral-sliding", "gemma", "gemma2", "gemma3", "phi3", "granite", "deepseek-v3"]
NEW_TOKENS = 20
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# Each setting is one of the ways a sequence's K/V reach attention differently; every family
# runs the first (a small pool: batching, paging, chunked prompts, preemption and, on a second
# pass, prefix-cache hits in one engine), tensor parallelism and speculation one family each
# (the suite's time).
ENGINE_SETTINGS = {
    "chunked-preempted-prefix-cached": dict(num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=24),
    # The same with n-gram speculation (its guesses scored through the experts too).
    "ngram-chunked-preempted-prefix-cached": dict(
        num_kv_blocks=12, max_num_seqs=4, max_num_batched_tokens=24,
        speculative=dict(method="ngram", num_speculative_tokens=3, ngram={"min": 1, "max": 3})),
    "tensor-parallel-2": dict(num_kv_blocks=400, tensor_parallel_size=2),
    "draft-speculation": dict(num_kv_blocks=400, speculative=dict(method="draft", num_layers=1, num_speculative_tokens=3)),
    "expert-parallel-2": dict(num_kv_blocks=400, expert_parallel_size=2),
}
# Mixtures of experts, one setting each (their routing and experts are the difference).
MOE_FAMILIES = ["mixtral", "qwen3-moe", "olmoe", "glm4-moe"]  # (qwen2-moe: tests/model/test_model_vs_hf.py)
# gpt-oss: attention sinks in the paged kernel, sliding and full layers, biased clamped experts;
# under tensor parallelism its sinks split with the heads.
CASES = [(f, "chunked-preempted-prefix-cached")
         for f in FAMILIES + ["qwen3-moe", "olmoe", "glm4-moe", "llama4", "gpt-oss"]] + [
    ("mixtral", "ngram-chunked-preempted-prefix-cached"),
    ("gemma3", "tensor-parallel-2"), ("gemma2", "draft-speculation"), ("olmoe", "expert-parallel-2"),
    ("gpt-oss", "tensor-parallel-2"),
    # latent attention: query heads split, the latent pool replicated; the shared expert split too
    ("deepseek-v3", "tensor-parallel-2"),
]  # (glm4-moe's TP=2 and EP=2: tests/model/test_tensor_parallel.py)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """name -> (loaded model, prompts, HF's greedy continuations), each family built once."""
    return functools.cache(lambda name: _family(name, tmp_path_factory))


def _family(name, tmp_path_factory):
    path, prompts, expected = family_cases(name, tmp_path_factory.mktemp(name) / "m", NEW_TOKENS)
    return load_model(path), prompts, expected


@pytest.mark.parametrize("name, setting", CASES)
def test_engine_greedy_equals_hf(families, name, setting):
    model, prompts, expected = families(name)
    settings = ENGINE_SETTINGS[setting]
    small_pool = setting.endswith("chunked-preempted-prefix-cached")
    if small_pool and model.config.max_window is not None:
        # Every layer slides: blocks behind the window go back to the pool, so it takes a smaller
        # pool (a few windows) to make the sequences preempt each other.
        settings = {**settings, "num_kv_blocks": 6}
    llm = LLM(model, max_model_len=256, **settings)
    if "parallel" not in setting:  # (a sharded program keeps the jnp path)
        assert llm.engine.runner.cpu_kernels == paged_decode.available()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if small_pool:
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0
        # Again, last first: the blocks freed last are still cached, so those prompts hit (where
        # no layer slides: a windowed sequence released its first blocks, and this small pool
        # evicts them; test_sliding_window_engine.py checks windowed prefix hits).
        hits = stats.pool.prefix_hits
        again = llm.generate([{"prompt_token_ids": p} for p in prompts[::-1]], GREEDY)
        assert [o.outputs[0].token_ids for o in again] == expected[::-1]
        assert model.config.max_window is not None or llm.engine.stats().pool.prefix_hits > hits
    if model.config.moe is not None and small_pool:
        if "speculative" in settings:  # (one MoE family: n-gram guesses and grammars through the experts)
            _constrained_rows_beside_a_free_one(llm, prompts, expected)
        _every_layer_counted_every_token(llm)
    stats = llm.engine.stats()
    assert stats.pool.num_used_blocks == 0 and stats.running == 0 and stats.waiting == 0


def _constrained_rows_beside_a_free_one(llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> None:
    """Structured output rows follow their grammars and the free row keeps HF's tokens, with the
    n-gram guesses scored (rejected ones too) by the experts."""
    choice = SamplingParams(max_tokens=8, temperature=0, structured_output=StructuredOutput.choice(["yes", "no"]))
    digits = SamplingParams(max_tokens=12, temperature=0, structured_output=StructuredOutput("regex", r"[0-9]{3}-[0-9]{4}"))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], [GREEDY, choice, digits])
    assert outs[0].outputs[0].token_ids == expected[0]
    assert outs[1].outputs[0].text in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outs[2].outputs[0].text)
    assert llm.engine.stats().spec.num_drafts > 0


def _every_layer_counted_every_token(llm: LLM) -> None:
    """The expert-load counts: every sparse layer saw the same tokens, each routed top_k times."""
    moe, config = llm.engine.stats().moe, llm.engine.config.moe
    assert (moe.expert_parallel_size, moe.num_experts) == (1, config.num_experts)
    assert all(len(layer) == config.num_experts and min(layer) >= 0 for layer in moe.routed_tokens)
    totals = {sum(layer) for layer in moe.routed_tokens}
    assert len(totals) == 1
    total = totals.pop()
    assert total > 0 and total % config.top_k == 0
