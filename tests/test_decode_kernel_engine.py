"""The engine's decode steps through the CPU paged kernel match the portable jnp path.

The kernel itself is checked against ``paged_attention`` and numpy in test_paged_decode_kernel;
these check it wired into the engine: every decode program of a mixed workload (rows of
different context lengths crossing block boundaries, multi-step decode, batches that shrink)
gives the jnp path's greedy tokens and logprobs, and the kernel really is the one running.
"""

from __future__ import annotations

import numpy as np
import pytest

import workers.runner as runner_module
from model import load_model, paged_decode
from tests.checkpoints import build_tiny_checkpoint
from workers import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not paged_decode.available(), reason="the C++ decode kernel is not built here")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("kernel") / "m")
    return load_model(path)


def _run(tiny, kernel: bool, monkeypatch, num_scheduler_steps: int) -> tuple[list, list, LLM]:
    monkeypatch.setattr(runner_module, "_decode_kernel_runs", lambda mesh, kv: kernel)
    rng = np.random.RandomState(11)
    prompts = [rng.randint(3, 320, size=n).tolist() for n in (3, 15, 16, 17, 40, 70, 1, 33)]
    max_tokens = [30, 9, 40, 17, 25, 12, 33, 20]
    llm = LLM(tiny, max_model_len=256, num_kv_blocks=96, max_num_seqs=8, num_scheduler_steps=num_scheduler_steps,
              enable_prefix_caching=False)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens = [o.outputs[0].token_ids for o in outputs]
    logprobs = [[entry[t] for entry, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    return tokens, logprobs, llm


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_kernel_decode_matches_the_jnp_path(tiny, monkeypatch, num_scheduler_steps):
    expected_tokens, expected_logprobs, reference = _run(tiny, False, monkeypatch, num_scheduler_steps)
    tokens, logprobs, llm = _run(tiny, True, monkeypatch, num_scheduler_steps)
    assert not reference.engine.runner.decode_kernel and llm.engine.runner.decode_kernel
    assert tokens == expected_tokens
    for got, want in zip(logprobs, expected_logprobs):
        np.testing.assert_allclose([_value(x) for x in got], [_value(x) for x in want], atol=2e-4)
    assert llm.engine.pool.num_used_blocks == 0  # nothing leaked on the kernel path


def test_kernel_decode_uses_one_block_table_width(tiny):
    """The kernel's cost does not depend on the table width, so the engine compiles one."""
    llm = LLM(tiny, max_model_len=256, num_kv_blocks=96, max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.decode_kernel
    decode_widths = {dims[1] for kind, dims in runner.warmup_shapes(1) if kind == "decode"}
    assert decode_widths == {runner.max_width}


def _value(entry) -> float:
    return float(getattr(entry, "logprob", entry))
