"""Custom logits processors (workers/core/logits_processors.py) through the engine: they see the
right tokens, rewrite the logits each token is sampled from (prompt chunks and decode steps,
alone and batched, with multi-step decode and chunked prompts), leave other requests
untouched, keep seeded sampling reproducible, and a failing one ends only its request."""

from __future__ import annotations

import numpy as np
import pytest

from raylm.workers.core.sampling_params import SamplingParams, SamplingParamsError
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from raylm.model.loaders.load import load_model

    path, _ = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("processors") / "m")
    return load_model(path)


def _prompts() -> list[dict]:
    rng = np.random.RandomState(3)
    return [{"prompt_token_ids": rng.randint(3, 320, size=n).tolist()} for n in (5, 40, 70)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _force(token: int):
    def force(output_ids: list[int], logits: np.ndarray) -> np.ndarray:
        return np.where(np.arange(logits.shape[0]) == token, 0.0, -np.inf).astype(np.float32)
    return force


ENGINES = {
    "default": dict(),
    "multi-step, chunked": dict(num_scheduler_steps=4, max_num_batched_tokens=32),
    "tensor-parallel-2": dict(tensor_parallel_size=2),
}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_processors_see_the_tokens_and_shape_what_is_sampled(tiny, engine):
    # No prefix cache: the second run computes the long prompt in chunks again.
    llm = LLM(tiny, max_model_len=256, num_kv_blocks=100, enable_prefix_caching=False, **ENGINES[engine])
    prompts = _prompts()
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    plain = _tokens(llm.generate(prompts, greedy))

    calls: list[tuple[list[int], list[int]]] = []

    def identity(prompt_ids: list[int], output_ids: list[int], logits: np.ndarray) -> np.ndarray:
        calls.append((prompt_ids, output_ids))
        return logits

    params = [greedy,
              SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logits_processors=[_force(7)],
                             logprobs=1),
              SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logits_processors=[identity])]
    outs = llm.generate(prompts, params)
    assert _tokens(outs)[0] == plain[0] and _tokens(outs)[2] == plain[2]  # others untouched
    assert _tokens(outs)[1] == [7] * NEW_TOKENS
    assert all(entry[7] == 0.0 for entry in outs[1].outputs[0].logprobs)  # the processed distribution
    # Called once per sampled token (not for the 70-token prompt's chunks that sample nothing),
    # with the prompt and the tokens so far.
    assert calls == [(prompts[2]["prompt_token_ids"], plain[2][:i]) for i in range(NEW_TOKENS)]


def test_seeded_sampling_with_a_processor_is_reproducible(tiny):
    llm = LLM(tiny, max_model_len=256, num_kv_blocks=100)
    banned = set(range(0, 200))

    def ban(output_ids: list[int], logits: np.ndarray) -> np.ndarray:
        logits[list(banned)] = -np.inf
        return logits

    params = SamplingParams(n=2, max_tokens=NEW_TOKENS, temperature=1.0, seed=5, ignore_eos=True,
                            logits_processors=[ban])
    first = llm.generate(_prompts()[1:2], params)[0]
    again = llm.generate(_prompts()[1:2], params)[0]
    tokens = [c.token_ids for c in first.outputs]
    assert tokens == [c.token_ids for c in again.outputs]
    assert not banned & {t for seq in tokens for t in seq}


def test_a_failing_processor_aborts_only_its_request(tiny, caplog):
    llm = LLM(tiny, max_model_len=256, num_kv_blocks=100, num_scheduler_steps=4)
    count = {"n": 0}

    def breaks_on_the_third_token(output_ids: list[int], logits: np.ndarray) -> np.ndarray:
        count["n"] += 1
        if len(output_ids) == 2:
            raise RuntimeError("boom")
        return logits

    def wrong_shape(output_ids: list[int], logits: np.ndarray) -> np.ndarray:
        return logits[:10]

    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    prompts = _prompts()
    plain = _tokens(llm.generate(prompts[2:], greedy))
    outs = llm.generate(prompts, [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logits_processors=[breaks_on_the_third_token]),
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logits_processors=[wrong_shape]),
        greedy])
    assert [o.outputs[0].finish_reason for o in outs] == ["abort", "abort", "length"]
    assert len(outs[0].outputs[0].token_ids) == 2 and outs[1].outputs[0].token_ids == []
    assert _tokens(outs)[2] == plain[0]
    assert "boom" in caplog.text and "returned shape (10,)" in caplog.text
    stats = llm.engine.stats()
    assert stats.pool.num_used_blocks == 0 and stats.running == stats.waiting == 0


def test_processors_are_checked_up_front(tiny):
    with pytest.raises(SamplingParamsError, match="callables"):
        SamplingParams(logits_processors=["not a function"])
    with pytest.raises(SamplingParamsError, match="takes 1 arguments"):
        SamplingParams(logits_processors=[lambda logits: logits])
    llm = LLM(tiny, max_model_len=256, num_kv_blocks=64, speculative={"method": "ngram"})
    with pytest.raises(ValueError, match="speculative"):
        llm.generate(_prompts()[:1], SamplingParams(logits_processors=[_force(3)]))
