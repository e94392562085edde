"""Decode batches of one and two sequences run in 1- and 2-row buckets, with the reference's tokens.

A single stream used to be padded to 4 rows (and paid for 4); these check that the small
buckets are really used and stay exact against the single-request reference loop.
"""

from __future__ import annotations

import numpy as np
import pytest

import raylm.workers.runner.model_runner as runner_module
from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM


@pytest.fixture
def decode_rows(monkeypatch):
    """Row counts (bucketed batch sizes) of every decode program the runner calls."""
    rows: list[int] = []
    program = runner_module.decode_program

    def spy(params, kv, tokens, *args, **kwargs):
        rows.append(int(tokens.shape[0]))
        return program(params, kv, tokens, *args, **kwargs)

    monkeypatch.setattr(runner_module, "decode_program", spy)
    return rows


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_batches_of_one_and_two_match_reference(tiny_gqa_model, decode_rows, num_scheduler_steps):
    rng = np.random.RandomState(7)
    prompts = [rng.randint(3, 320, size=n).tolist() for n in (5, 40, 23)]
    max_tokens = [6, 14, 22]  # the batch shrinks 3 -> 2 -> 1 as requests finish
    reference = SingleSequenceGenerator(tiny_gqa_model.config, tiny_gqa_model.params)
    expected = [list(reference.generate(p, n)) for p, n in zip(prompts, max_tokens)]

    llm = LLM(tiny_gqa_model, max_model_len=256, num_kv_blocks=64, num_scheduler_steps=num_scheduler_steps)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)

    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert {1, 2} <= set(decode_rows) and max(decode_rows) == 4


def test_single_stream_decodes_one_row(tiny_gqa_model, decode_rows):
    prompt = np.random.RandomState(8).randint(3, 320, size=33).tolist()
    expected = list(SingleSequenceGenerator(tiny_gqa_model.config, tiny_gqa_model.params).generate(prompt, 20))
    llm = LLM(tiny_gqa_model, max_model_len=256, num_kv_blocks=64)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == expected
    assert set(decode_rows) == {1}
