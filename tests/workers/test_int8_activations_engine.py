"""The integer compute mode through the engine: exact against itself.

``activation_quantization="int8"`` changes the numbers (model/kernels/int8_matmul.py); the engine must not
change them further. Batching, paging, prefix caching, chunked prefill, preemption and speculative
verification must give each prompt the greedy tokens it gets served alone (one sequence at a time,
its prompt in one step, no prefix cache). The reference is the engine alone, not the jnp
single-request loop (model.decoder.generate) that the exact mode's suite uses: that loop's attention
rounds differently from the paged kernel in the last bits, and the integer mode turns such a
difference into another int8 value wherever an activation sits at a rounding boundary (on this
model, tokens diverged within 16 steps on one prompt of eight). The engine's kernels give a row
the same bits whatever else is in the batch, so here the tokens must be equal. One engine setting
exercises every feature: a small pool (preemption), 48-token steps (chunked prefill, mixed
batches), n-gram speculation, and a second pass over the same prompts (prefix-cache hits). The
tiny model is ``int8_g32``, whose matrices run the kernel's block path (Q8_0's);
tests/model/test_int8_matmul.py checks every format.
"""

from __future__ import annotations

import numpy as np
import pytest

from raylm.model.kernels.int8_matmul import unavailable_reason
from raylm.model.loaders.load import load_model
from raylm.model.quantization.int8_panels import Int8Panels
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint
from tests.gguf_export import export_gguf, q4_k_m_types

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason="int8 kernel not built")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path, _ = build_tiny_checkpoint("llama-tied", tmp_path_factory.mktemp("int8_activations") / "m")
    return path


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


def test_greedy_equals_each_prompt_alone(tiny_path):
    model = load_model(tiny_path, quantization="int8_g32")
    rng = np.random.RandomState(3)
    prompts = [rng.randint(3, 320, size=n).tolist() for n in [1, 17, 200, 90, 33, 5]]
    alone = LLM(model, activation_quantization="int8", max_model_len=512, num_kv_blocks=64, max_num_seqs=1,
                enable_prefix_caching=False)
    params = alone.engine.runner.params
    # dense() runs the integer kernel on packed weights; the tied embedding is packed too (its
    # lookup reads the packed rows).
    assert isinstance(params.layers[0].wqkv, Int8Panels) and isinstance(params.embed, Int8Panels)
    expected = [_tokens(alone, [p])[0] for p in prompts]

    llm = LLM(model, activation_quantization="int8", max_model_len=512, num_kv_blocks=20, max_num_seqs=8,
              max_num_batched_tokens=48, speculative={"method": "ngram"})
    for _ in range(2):  # the second pass starts from cached prefixes
        assert _tokens(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.pool.prefix_hits > 0


def test_a_q4_k_m_file_runs_its_q6_k_matrices_in_integers(tmp_path_factory):
    """A Q4_K_M-style GGUF (Q6_K value and down projections and output matrix, Q4_K elsewhere):
    the integer mode packs the Q6_K matrices for the integer kernel with their int8 scales per 16
    (``sub_scale``) beside the Q4_K ones, the fused QKV (Q4_K query and key beside the Q6_K value,
    model/quantization/gguf_blocks.py ``map_rows``) with int8 offsets per 16 too, and batched,
    chunked, speculative serving gives each prompt the greedy tokens it gets alone."""
    tmp = tmp_path_factory.mktemp("q4_k_m_int8")
    directory, _ = build_tiny_checkpoint("qwen3", tmp / "hf", hidden_size=256, intermediate_size=512, head_dim=64,
                                         tie_word_embeddings=False)
    model = load_model(export_gguf(directory, tmp / "q4_k_m.gguf", q4_k_m_types), keep_blocks=True)
    rng = np.random.RandomState(5)
    prompts = [rng.randint(3, 320, size=n).tolist() for n in [1, 60, 23, 7]]
    alone = LLM(model, activation_quantization="int8", max_model_len=256, num_kv_blocks=64, max_num_seqs=1,
                enable_prefix_caching=False)
    params = alone.engine.runner.params
    for layer in params.layers:
        assert isinstance(layer.w_down, Int8Panels) and layer.w_down.sub_scale.shape[2:] == (2, 16)  # Q6_K
        assert isinstance(layer.w_gate_up, Int8Panels) and layer.w_gate_up.nibbles  # Q4_K
        assert isinstance(layer.wqkv, Int8Panels) and layer.wqkv.sub_scale.shape[2:] == (4, 16)  # scales, offsets
    assert isinstance(params.lm_head, Int8Panels) and params.lm_head.sub_scale.shape[2:] == (2, 16)
    expected = [_tokens(alone, [p])[0] for p in prompts]

    llm = LLM(model, activation_quantization="int8", max_model_len=256, num_kv_blocks=24, max_num_seqs=4,
              max_num_batched_tokens=32, speculative={"method": "ngram"})
    assert _tokens(llm, prompts) == expected


def test_a_model_without_integer_weights_is_refused(tiny_path):
    with pytest.raises(ValueError, match="has none .its matrices are float, fp8 or other block types.: serve such a .gguf"):
        LLM(tiny_path, activation_quantization="int8", max_model_len=64, num_kv_blocks=8)
    with pytest.raises(ValueError, match="activation_quantization must be one of none, int8"):
        EngineArgs(activation_quantization="int4")
