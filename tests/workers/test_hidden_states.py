"""Hidden-state extraction (workers/core/hidden_states.py) against HF transformers'
``output_hidden_states`` on the same tiny checkpoint, through the engine: every layer index
(embeddings .. final norm), with and without the prompt, alone and batched with other
requests, chunked, multi-step decode, preempted, from the prefix cache; fixed program shapes;
requests that cannot be served are refused, and slots are given back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, hf_model = build_tiny_checkpoint("llama-gqa", tmp_path_factory.mktemp("hidden") / "m")
    from raylm.model.loaders.load import load_model

    return load_model(path), hf_model


def _hf_hidden(hf_model, ids: list[int]) -> np.ndarray:
    """HF's hidden states of every position of ``ids``: ``[L + 1, len(ids), D]``."""
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
    return np.stack([h[0].numpy() for h in out.hidden_states])


def _prompts() -> list[list[int]]:
    rng = np.random.RandomState(4)
    return [rng.randint(3, 320, size=n).tolist() for n in (1, 17, 45, 120)]


ENGINES = {
    "default": dict(),
    "chunked, multi-step": dict(max_num_batched_tokens=32, num_scheduler_steps=4),
    "preemption": dict(num_kv_blocks=12, max_num_batched_tokens=64),
    "tensor-parallel-2": dict(tensor_parallel_size=2),  # the jnp programs, sharded
}


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_hidden_states_equal_hf_for_every_token(tiny, engine):
    model, hf_model = tiny
    L = model.config.num_layers
    llm = LLM(model, max_model_len=256, hidden_state_slots=2, hidden_state_max_tokens=160,
              **{"num_kv_blocks": 100, **ENGINES[engine]})
    prompts = _prompts()
    layers = list(range(L + 1))
    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, return_hidden_states=layers,
                             hidden_states_include_prompt=i % 2 == 1) for i in range(len(prompts))]
    plain = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    # Two slots for four capturing requests: the others wait; a free request runs beside them.
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts + [prompts[2]]], params + [plain])
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        completion = out.outputs[0]
        ids = prompt + completion.token_ids
        reference = _hf_hidden(hf_model, ids[:-1])  # the last token is never fed back
        start = 0 if i % 2 == 1 else len(prompt) - 1
        assert completion.hidden_states.shape == (L + 1, len(ids) - 1 - start, model.config.hidden_size)
        np.testing.assert_allclose(completion.hidden_states, reference[:, start:], atol=2e-4, rtol=2e-4)
    assert outs[-1].outputs[0].hidden_states is None
    assert outs[-1].outputs[0].token_ids == outs[2].outputs[0].token_ids  # capturing does not change tokens
    if engine == "preemption":
        assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.scheduler.hidden_slots.num_free == 2
    # Again from the prefix cache: layers picked, the same numbers (to rounding: the last prompt
    # token is now computed in another batch, whose matmuls may sum in another order).
    again = llm.generate([{"prompt_token_ids": prompts[2]}],
                         SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                                        return_hidden_states=[L, 0, 2]))[0].outputs[0]
    np.testing.assert_allclose(again.hidden_states, outs[2].outputs[0].hidden_states[[L, 0, 2]], atol=1e-4, rtol=1e-4)


def test_requests_the_buffers_cannot_serve_are_refused(tiny):
    model, _ = tiny
    L = model.config.num_layers
    llm = LLM(model, max_model_len=256, num_kv_blocks=64, hidden_state_slots=1, hidden_state_max_tokens=40)
    prompt = {"prompt_token_ids": list(range(3, 33))}
    with pytest.raises(ValueError, match="do not fit the replica's buffers of 40"):
        llm.generate([prompt], SamplingParams(max_tokens=20, return_hidden_states=[1],
                                              hidden_states_include_prompt=True))
    with pytest.raises(ValueError, match=rf"distinct layer indices in \[0, {L}\]"):
        llm.generate([prompt], SamplingParams(max_tokens=4, return_hidden_states=[L + 1]))
    with pytest.raises(ValueError, match="one sequence"):
        llm.generate([prompt], SamplingParams(max_tokens=4, n=2, return_hidden_states=[1]))
    off = LLM(model, max_model_len=256, num_kv_blocks=64)
    with pytest.raises(ValueError, match="hidden_state_slots"):
        off.generate([prompt], SamplingParams(max_tokens=4, return_hidden_states=[1]))
    with pytest.raises(ValueError, match="speculative"):
        LLM(model, num_kv_blocks=64, hidden_state_slots=1, speculative={"method": "ngram"})
    # What fits is served, and the slot comes back.
    out = llm.generate([prompt], SamplingParams(max_tokens=20, return_hidden_states=[1, L]))[0].outputs[0]
    assert out.hidden_states.shape[:2] == (2, len(out.token_ids))
    assert llm.engine.scheduler.hidden_slots.num_free == 1
    stats = llm.engine.stats()
    assert stats.pool.num_used_blocks == 0 and stats.running == stats.waiting == 0


def test_an_aborted_capture_gives_its_slot_back(tiny):
    model, _ = tiny
    llm = LLM(model, max_model_len=256, num_kv_blocks=64, hidden_state_slots=1, hidden_state_max_tokens=64)
    engine = llm.engine
    engine.add_request("a", list(range(3, 20)), SamplingParams(max_tokens=30, return_hidden_states=[0]))
    engine.step()
    assert engine.scheduler.hidden_slots.num_free == 0
    engine.abort("a")
    assert engine.scheduler.hidden_slots.num_free == 1


def test_capturing_requests_of_the_same_buckets_compile_nothing_new(tiny, compilations):
    """Buffers and programs have fixed shapes: once one capturing request ran, another of the
    same buckets (other layers, slot, lengths, with or without the prompt) compiles nothing."""
    model, _ = tiny
    llm = LLM(model, max_model_len=256, num_kv_blocks=64, hidden_state_slots=2, hidden_state_max_tokens=64,
              num_scheduler_steps=4)
    def run(first: int, prompt_len: int, layers: list[int], include_prompt: bool) -> None:
        params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, return_hidden_states=layers,
                                hidden_states_include_prompt=include_prompt)
        llm.generate([{"prompt_token_ids": list(range(first, first + prompt_len))}], params)

    # Distinct prompts (a prefix-cache hit would compute a shorter chunk, another bucket).
    run(5, 20, [0, 1], False)
    run(40, 20, [2, 3], True)
    compilations.clear()
    run(80, 25, [1, 3], True)
    run(120, 22, [3, 0], False)
    assert compilations == []
