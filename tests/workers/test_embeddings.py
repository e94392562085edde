"""Embedding requests through the engine: the pooled, normalised final hidden states equal HF
transformers' on the same weights, and the same alone, batched with completions, in chunks,
after a preemption and (last-token pooling) from the prefix cache, with no block leaked."""

from __future__ import annotations

import numpy as np
import pytest

from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM

pytestmark = pytest.mark.usefixtures("optimized_xla")  # runtime-heavy: see tests/conftest.py

TEXTS = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Quarterly revenue grew by twelve percent.",
         "x", "Embeddings pool every prompt token. " * 12]


def _hf_embeddings(hf_model, ids_list: list[list[int]], pooling: str) -> np.ndarray:
    import torch

    out = []
    with torch.no_grad():
        for ids in ids_list:
            hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()  # after the final norm
            pooled = hidden.mean(0) if pooling == "mean" else hidden[-1]
            out.append(pooled / np.linalg.norm(pooled))
    return np.array(out)


@pytest.fixture(scope="module")
def ids(bundled_model) -> list[list[int]]:
    return [bundled_model.tokenizer.encode(t) for t in TEXTS]


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_equal_hf_transformers(bundled_model, hf_bundled_model, ids, pooling):
    llm = LLM(bundled_model, max_model_len=512, num_kv_blocks=200, embedding_pooling=pooling)
    ours = np.array(llm.embed([{"prompt_token_ids": i} for i in ids]))
    reference = _hf_embeddings(hf_bundled_model, ids, pooling)
    assert ours.shape == (len(TEXTS), bundled_model.config.hidden_size)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(ours, reference, atol=2e-4)
    similarity = ours @ ours.T
    assert similarity[0, 1] > similarity[0, 2]  # the two cat sentences are closer than cat and revenue


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_are_the_same_however_they_are_scheduled(bundled_model, ids, pooling):
    prompts = [{"prompt_token_ids": i} for i in ids]
    reference_llm = LLM(bundled_model, max_model_len=512, num_kv_blocks=200, embedding_pooling=pooling)
    alone = [reference_llm.embed([p])[0] for p in prompts]
    # Chunks of 32 tokens, a pool small enough to preempt, completions in the same steps.
    llm = LLM(bundled_model, max_model_len=512, num_kv_blocks=10, max_num_batched_tokens=32,
              embedding_pooling=pooling)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"e{i}", p["prompt_token_ids"], SamplingParams(max_tokens=1), embed=True)
        engine.add_request(f"g{i}", p["prompt_token_ids"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert engine.stats().num_preemptions > 0
    for i in range(len(prompts)):
        np.testing.assert_allclose(final[f"e{i}"].embedding, alone[i], atol=2e-5)
        assert final[f"e{i}"].outputs[0].token_ids == [] and final[f"e{i}"].outputs[0].finish_reason == "stop"
        assert len(final[f"g{i}"].outputs[0].token_ids) == 24
    again = llm.embed(prompts)  # the prompts' blocks are cached now
    np.testing.assert_allclose(np.array(again), np.array(alone), atol=2e-5)
    stats = engine.stats()
    assert stats.pool.num_used_blocks == 0 and stats.running == stats.waiting == 0


def test_an_embedding_request_takes_one_sequence(bundled_model):
    llm = LLM(bundled_model, max_model_len=128, num_kv_blocks=32)
    with pytest.raises(ValueError, match="one sequence"):
        llm.engine.add_request("e", [1, 2, 3], SamplingParams(n=2), embed=True)
    with pytest.raises(ValueError, match="embedding pooling must be one of mean, last"):
        LLM(bundled_model, embedding_pooling="max")
