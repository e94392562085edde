"""What works for Llama keeps working for the newer families: 8-bit weights and KV pools,
hidden states, embeddings and constrained output on Qwen3 (q/k norms, head_dim apart from
hidden/heads) and Gemma 2 (sandwich norms, (1 + w) norms, embedding scale, soft-caps, local
windows on some layers). The families' float32 forward is checked against HF in
tests/model/test_model_vs_hf.py and through every engine setting in
test_model_families_engine.py; this file crosses them with the features that sit on top."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.loaders.load import load_model
from raylm.workers.core.grammar import StructuredOutput
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint

FAMILIES = ["qwen3", "gemma2"]
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """name -> (checkpoint path, HF model, prompts), each family built once."""

    @functools.cache
    def build(name: str):
        path, hf_model = build_tiny_checkpoint(name, tmp_path_factory.mktemp(name) / "m")
        rng = np.random.RandomState(3)
        prompts = [rng.randint(3, 320, size=n).tolist() for n in (1, 17, 40, 90)]
        return path, hf_model, prompts

    return build


def _tokens(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.parametrize("name", FAMILIES)
def test_int8_weights_and_kv_equal_the_reference_loop_through_chunks_preemption_and_the_prefix_cache(family, name):
    path, _, prompts = family(name)
    model = load_model(path, quantization="int8")
    reference = SingleSequenceGenerator(model.config, model.params, kv_dtype=np.int8)
    expected = [list(reference.generate(p, NEW_TOKENS)) for p in prompts]
    llm = LLM(model, kv_cache_dtype="int8", max_model_len=256, num_kv_blocks=14, max_num_seqs=4,
              max_num_batched_tokens=32)
    assert _tokens(llm, prompts) == expected
    assert _tokens(llm, prompts) == expected  # again, partly from cached blocks
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.pool.prefix_hits > 0
    assert stats.pool.num_used_blocks == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_hidden_states_and_embeddings_equal_hf(family, name):
    path, hf_model, prompts = family(name)
    model = load_model(path)
    L = model.config.num_layers
    llm = LLM(model, max_model_len=256, num_kv_blocks=100, hidden_state_slots=2, hidden_state_max_tokens=160)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                            return_hidden_states=list(range(L + 1)), hidden_states_include_prompt=True)
    for out, prompt in zip(llm.generate([{"prompt_token_ids": p} for p in prompts[1:3]], params), prompts[1:3]):
        ids = prompt + out.outputs[0].token_ids
        with torch.no_grad():
            hf = hf_model(torch.tensor([ids[:-1]]), output_hidden_states=True).hidden_states
        np.testing.assert_allclose(out.outputs[0].hidden_states, np.stack([h[0].numpy() for h in hf]),
                                   atol=2e-4, rtol=2e-4)
    embeddings = np.array(llm.embed([{"prompt_token_ids": p} for p in prompts]))
    with torch.no_grad():
        pooled = [hf_model.model(torch.tensor([p])).last_hidden_state[0].double().numpy().mean(0) for p in prompts]
    np.testing.assert_allclose(embeddings, [p / np.linalg.norm(p) for p in pooled], atol=2e-4)


@pytest.mark.parametrize("name", FAMILIES)
def test_constrained_output_follows_its_grammar_beside_free_rows(family, name):
    path, _, prompts = family(name)
    llm = LLM(load_model(path), max_model_len=256, num_kv_blocks=100)
    free = _tokens(llm, prompts[:2])
    choice = SamplingParams(max_tokens=8, temperature=0, structured_output=StructuredOutput.choice(["yes", "no"]))
    digits = SamplingParams(max_tokens=12, temperature=0, structured_output=StructuredOutput("regex", r"[0-9]{3}-[0-9]{4}"))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:2] + prompts[2:]], [GREEDY, GREEDY, choice, digits])
    assert [o.outputs[0].token_ids for o in outs[:2]] == free  # constrained rows do not change free ones
    assert outs[2].outputs[0].text in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outs[3].outputs[0].text)
