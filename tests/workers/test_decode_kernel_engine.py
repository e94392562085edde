"""The engine's attention through the CPU paged kernel matches the portable jnp path.

The kernel itself is checked against ``paged_attention`` and numpy in
tests/model/test_paged_decode_kernel.py; these check it wired into the engine, for prompt
chunks (each token a query of its own) and decode tokens alike: every program of a mixed
workload (rows of different context lengths crossing block boundaries, multi-step decode,
batches that shrink, prompts split into chunks, chunks that start after a cached prefix) gives
the jnp path's greedy tokens and logprobs, and the kernel really is the one running.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import raylm.workers.runner.model_runner as runner_module
from raylm.model.kernels import paged_decode
from raylm.model.loaders.load import load_model
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint

pytestmark = pytest.mark.skipif(not paged_decode.available(), reason="the C++ decode kernel is not built here")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("kernel") / "m")
    return load_model(path)


ENGINES = {
    "one step": dict(num_scheduler_steps=1, enable_prefix_caching=False),
    "multi-step": dict(num_scheduler_steps=4, enable_prefix_caching=False),
    "chunked, cached prefixes": dict(num_scheduler_steps=1, enable_prefix_caching=True, max_num_batched_tokens=32),
    # deploy/default.yaml's shape: blocks of 64 tokens, 8 decode steps a call.
    "blocks of 64, multi-step, cached prefixes": dict(
        block_size=64, num_scheduler_steps=8, enable_prefix_caching=True, max_num_batched_tokens=64),
}


def _run(tiny, kernel: bool, monkeypatch, engine: dict) -> tuple[list, list, LLM]:
    monkeypatch.setattr(runner_module, "cpu_kernels_run", lambda mesh, kv: kernel)
    rng = np.random.RandomState(11)
    block_size = engine.get("block_size", 16)
    shared = rng.randint(3, 320, size=2 * block_size + 5).tolist()  # 2 full blocks + 5: later prompts reuse them
    # The first prompt computes the shared blocks; the last two wait for a free slot, so by
    # then those blocks are cached and their chunks start at a block boundary mid-context.
    prompts = [shared + [5]] + [rng.randint(3, 320, size=n).tolist() for n in (3, 15, 16, 17, 40, 70, 33)]
    prompts += [shared + rng.randint(3, 320, size=n).tolist() for n in (20, 45)]
    max_tokens = [5, 30, 9, 40, 17, 25, 12, 20, 14, 8]
    llm = LLM(tiny, max_model_len=256, num_kv_blocks=128, max_num_seqs=8, **engine)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[entry[t] for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    return tokens, logprobs, llm


@pytest.mark.parametrize("engine", ENGINES.values(), ids=ENGINES.keys())
def test_kernel_attention_matches_the_jnp_path(tiny, monkeypatch, engine):
    expected_tokens, expected_logprobs, reference = _run(tiny, False, monkeypatch, engine)
    tokens, logprobs, llm = _run(tiny, True, monkeypatch, engine)
    assert not reference.engine.runner.cpu_kernels and llm.engine.runner.cpu_kernels
    assert tokens == expected_tokens
    for got, want in zip(logprobs, expected_logprobs):
        np.testing.assert_allclose([_value(x) for x in got], [_value(x) for x in want], atol=2e-4)
    assert llm.engine.pool.num_used_blocks == 0  # nothing leaked on the kernel path
    if engine["enable_prefix_caching"]:
        assert llm.engine.pool.prefix_hits >= 4  # two cached blocks for each of the last two prompts


def test_kernel_programs_use_one_block_table_width(tiny):
    """The kernel's cost does not depend on the table width, so the engine compiles one."""
    llm = LLM(tiny, max_model_len=256, num_kv_blocks=96, max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.cpu_kernels
    shapes = runner.warmup_shapes(1)
    assert {dims[1] for kind, dims in shapes if kind == "decode"} == {runner.buckets.max_width}
    # Prompt chunks are packed one token per row: one program per token bucket, no width.
    assert {kind for kind, _ in shapes} == {"packed", "decode", "copy"}
    assert sorted(dims for kind, dims in shapes if kind == "packed") == [(16,), (32,), (64,), (128,), (256,), (512,)]


def test_packed_prefill_groups_fill_calls_within_the_budget(tiny):
    """A step's chunks go into as few calls as the token budget and rows per call allow, each
    with the smallest token bucket that holds its tokens and its chunks (one per 16 tokens)."""
    runner = LLM(tiny, max_model_len=256, num_kv_blocks=96, max_num_seqs=8, max_num_batched_tokens=64).engine.runner

    def plan(*sizes: int, unavailable: frozenset[int] = frozenset()) -> list[tuple[list[int], int]]:
        chunks = [SimpleNamespace(num_tokens=n) for n in sizes]
        return [([c.num_tokens for c in group], n) for group, n in runner.buckets.packed_groups(chunks, unavailable)]

    assert plan(10) == [([10], 16)]
    assert plan(5, 7) == [([5, 7], 32)]  # 12 tokens, but a 16-token call holds one chunk
    assert plan(40, 30) == [([40], 64), ([30], 32)]  # 70 tokens exceed the 64-token budget
    assert plan(20, 20, 20) == [([20, 20, 20], 64)]
    assert plan(*[1] * 9) == [([1] * 4, 64), ([1] * 4, 64), ([1], 16)]  # 4 chunks per 64-token call
    # A served engine still compiling some buckets: none in ``unavailable``, calls up to the largest left.
    assert plan(10, unavailable=frozenset({16, 64})) == [([10], 32)]
    assert plan(20, 20, unavailable=frozenset({16, 64})) == [([20], 32), ([20], 32)]


def test_packed_prefill_calls_mostly_padding_are_split(tiny):
    """Every padding token is a row of every matmul: a call whose bucket would be mostly padding
    becomes the chunks a half-size bucket holds and the rest, where that saves more than a
    call costs (``CALL_COST_TOKENS``); order and budget as above."""
    runner = LLM(tiny, max_model_len=512, num_kv_blocks=96, max_num_seqs=16, max_num_batched_tokens=512).engine.runner

    def plan(*sizes: int, unavailable: frozenset[int] = frozenset()) -> list[tuple[list[int], int]]:
        chunks = [SimpleNamespace(num_tokens=n) for n in sizes]
        return [([c.num_tokens for c in group], n) for group, n in runner.buckets.packed_groups(chunks, unavailable)]

    assert plan(*[19] * 16) == [([19] * 13, 256), ([19] * 3, 64)]  # 304 tokens: 320 rows, not 512
    assert plan(100, 100, 100) == [([100, 100], 256), ([100], 128)]
    assert plan(200, 200) == [([200, 200], 512)]  # 256 + 256 and a call cost more than 512
    assert plan(300) == [([300], 512)]  # a chunk is never split
    assert plan(20, 20, 5) == [([20, 20, 5], 64)]
    # The halves skip buckets still compiling, as one call does.
    assert plan(*[19] * 16, unavailable=frozenset({256})) == [([19] * 16, 512)]


def _value(entry) -> float:
    return float(getattr(entry, "logprob", entry))
