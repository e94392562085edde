"""After warm-up, serving traffic never compiles: every shape falls into a precompiled bucket."""

from __future__ import annotations

import numpy as np
import pytest

from model import load_model
from tests.checkpoints import build_tiny_checkpoint
from workers import LLM, SamplingParams


def test_no_compilation_after_warmup(tmp_path, compilations):
    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path / "m")
    llm = LLM(load_model(path), max_model_len=256, num_kv_blocks=120, max_num_seqs=8,
              max_num_batched_tokens=64, warmup=True)
    assert compilations, "warm-up compiled nothing?"
    compilations.clear()

    rng = np.random.RandomState(0)
    prompts = [{"prompt_token_ids": rng.randint(3, 320, size=n).tolist()} for n in (1, 5, 17, 60, 130, 200, 31, 2)]
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, ignore_eos=True)
    llm.generate(prompts, [greedy, sampled] * 4)
    llm.generate(prompts[:3], SamplingParams(n=3, max_tokens=10, temperature=0.7, ignore_eos=True))
    llm.generate(prompts[:1], greedy)  # 1-row decode bucket
    llm.generate(prompts[1:3], greedy)  # 2-row decode bucket
    assert compilations == []
