"""The integer compute mode on a mixture of experts through the engine: exact against itself.

A tiny MoE GGUF file served with ``activation_quantization="int8"`` packs its stacked experts for
the integer kernel's grouped form (model/kernels/int8_matmul.py ``int8_grouped_matmul``) beside its
dense matrices, and batched, chunked, speculative serving gives each prompt the greedy tokens it
gets served alone, as tests/workers/test_int8_activations_engine.py checks for dense models (its
docstring says why the reference is the engine alone). Two files: gpt-oss's layout (MXFP4 experts
with biases and a clamped SwiGLU, Q8_0 matrices, as llama.cpp's released files hold them) and a
Qwen3-MoE in Q4_0 throughout. The integer mode is approximate: how many tokens agree with the
exact mode's is printed (``-s``), not asserted.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from raylm.model.kernels.int8_matmul import unavailable_reason
from raylm.model.loaders.load import load_model
from raylm.model.quantization.int8_panels import Int8Panels
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint
from tests.gguf_export import export_gguf, released_gpt_oss_types

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason="int8 kernel not built")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


FILES = {  # variant: (types per tensor, checkpoint overrides)
    "gpt-oss": (released_gpt_oss_types, dict(num_hidden_layers=2, vocab_size=256)),
    "qwen3-moe": (lambda name: T.Q4_0 if name.endswith(".weight") and "ffn_gate_inp" not in name else T.F32,
                  dict(vocab_size=256, mlp_only_layers=[])),
}


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


@pytest.mark.parametrize("variant", list(FILES))
def test_moe_greedy_equals_each_prompt_alone(variant, tmp_path):
    types, overrides = FILES[variant]
    directory, _ = build_tiny_checkpoint(variant, tmp_path / "hf", **overrides)
    model = load_model(export_gguf(directory, tmp_path / f"{variant}.gguf", types), keep_blocks=True)
    rng = np.random.RandomState(4)
    prompts = [rng.randint(3, 250, size=n).tolist() for n in [1, 40, 9, 23]]
    alone = LLM(model, activation_quantization="int8", max_model_len=128, num_kv_blocks=64, max_num_seqs=1,
                enable_prefix_caching=False)
    sparse = [layer for layer in alone.engine.runner.params.layers if layer.w_experts_gate_up is not None]
    assert sparse
    for layer in sparse:
        for stack in (layer.w_experts_gate_up, layer.w_experts_down):
            assert isinstance(stack, Int8Panels) and stack.experts == model.config.moe.num_experts
            if variant == "gpt-oss":  # MXFP4 experts stay 4-bit codes with their codebook
                assert stack.q.shape[3] == 4 and stack.codebook.shape == (stack.experts, 16)
    expected = [_tokens(alone, [p])[0] for p in prompts]

    llm = LLM(model, activation_quantization="int8", max_model_len=128, num_kv_blocks=16, max_num_seqs=4,
              max_num_batched_tokens=16, speculative={"method": "ngram"})
    assert _tokens(llm, prompts) == expected

    exact = _tokens(LLM(model, max_model_len=128, num_kv_blocks=64, max_num_seqs=4), prompts)
    same = sum(a == b for got, want in zip(expected, exact) for a, b in zip(got, want))
    print(f"{variant}: integer mode agrees with the exact mode on {same} of {sum(map(len, exact))} greedy tokens")
