"""The integer mode's packing done while the model loads, layer by layer.

Packed after the whole load, every stored matrix and its packed copy were held at once (an 8B
Q4_K_M peaked at twice its resident size). ``load_model(..., activation_quantization="int8")``
packs each decoder layer as soon as it is read, and the engine's own loads do so; these tests
check that it gives exactly the params that packing the loaded model gives, that a layer's stored
form is gone before the next layer is read, and that every way an engine loads (one process,
pipeline stages, a model quantized at load, a draft cut from the target) serves the tokens that
packing after the load serves.
"""

from __future__ import annotations

import gc
import weakref

import jax
import numpy as np
import pytest

from raylm.model.kernels.int8_matmul import unavailable_reason
from raylm.model.loaders.load import load_model
from raylm.model.quantization import activations
from raylm.model.quantization.activations import with_int8_activations
from raylm.model.quantization.gguf_blocks import GgufBlocks
from raylm.model.quantization.int8_panels import Int8Panels
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint
from tests.gguf_export import export_gguf, q4_k_m_types

pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason="int8 kernel not built")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 200, 31, 7], list(range(3, 40)), [300, 2, 2, 17]]
ENGINE = dict(max_model_len=128, num_kv_blocks=32, max_num_seqs=4, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory):
    """A Q4_K_M-style GGUF of four layers (Q4_K and Q6_K matrices, an untied Q6_K head)."""
    tmp = tmp_path_factory.mktemp("int8_at_load")
    directory, _ = build_tiny_checkpoint("qwen3", tmp / "hf", hidden_size=256, intermediate_size=512, head_dim=64,
                                         num_hidden_layers=4, tie_word_embeddings=False)
    return export_gguf(directory, tmp / "q4_k_m.gguf", q4_k_m_types)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)]


def _assert_same_params(a, b) -> None:
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_packing_while_loading_gives_the_params_packing_after_gives(q4_k_m_file):
    packed = load_model(q4_k_m_file, keep_blocks=True, activation_quantization="int8")
    assert packed.activation_quantization == "int8"
    assert all(isinstance(layer.w_down, Int8Panels) for layer in packed.params.layers)
    assert isinstance(packed.params.lm_head, Int8Panels)
    stored = load_model(q4_k_m_file, keep_blocks=True)
    _assert_same_params(packed.params, with_int8_activations(stored.params, stored.name))
    with pytest.raises(ValueError, match="loaded packed for activation_quantization int8; it cannot be quantized"):
        packed.quantized("int8")


def test_a_layers_stored_form_is_gone_before_the_next_layer_is_read(q4_k_m_file, monkeypatch):
    """The loader holds one layer's stored matrices at a time: when layer ``i`` reaches the
    packer, no stored matrix of an earlier layer is alive."""
    handed: list[list[weakref.ref]] = []
    pack_layer = activations.Int8Packer.layer

    def watched(self, lp):
        gc.collect()
        for i, earlier in enumerate(handed):
            alive = [ref for ref in earlier if ref() is not None]
            assert not alive, f"layer {i}'s stored matrices are still held while layer {len(handed)} loads"
        matrices = [getattr(lp, f) for f in ("wqkv", "wo", "w_gate_up", "w_down")]
        assert all(isinstance(m, GgufBlocks) for m in matrices)
        handed.append([weakref.ref(m.q) for m in matrices])
        return pack_layer(self, lp)

    monkeypatch.setattr(activations.Int8Packer, "layer", watched)
    model = load_model(q4_k_m_file, keep_blocks=True, activation_quantization="int8")
    assert len(handed) == model.config.num_layers == 4


def test_every_way_an_engine_loads_serves_the_tokens_of_packing_after_the_load(q4_k_m_file, tmp_path):
    expected = _tokens(LLM(load_model(q4_k_m_file, keep_blocks=True), activation_quantization="int8", **ENGINE))
    served = LLM(str(q4_k_m_file), activation_quantization="int8", gguf_blocks="keep", **ENGINE)
    assert served.engine.model.activation_quantization == "int8"
    assert _tokens(served) == expected
    stages = LLM(str(q4_k_m_file), activation_quantization="int8", gguf_blocks="keep", pipeline_parallel_size=2,
                 pipeline_placement="local", **ENGINE)
    assert _tokens(stages) == expected

    # A draft cut from the target keeps its exact sums: the target is packed after the cut.
    drafted = LLM(str(q4_k_m_file), activation_quantization="int8", gguf_blocks="keep",
                  speculative={"method": "draft", "num_layers": 1, "num_speculative_tokens": 2}, **ENGINE)
    assert isinstance(drafted.engine.model.params.layers[0].w_down, Int8Panels)
    assert isinstance(drafted.engine.draft_model.params.layers[0].w_down, GgufBlocks)
    assert _tokens(drafted) == expected

    # A float checkpoint quantized at load is packed after quantizing.
    directory, _ = build_tiny_checkpoint("llama-tied", tmp_path / "m")
    after = LLM(load_model(directory, quantization="int8_g32"), activation_quantization="int8", **ENGINE)
    during = LLM(str(directory), quantization="int8_g32", activation_quantization="int8", **ENGINE)
    assert during.engine.model.activation_quantization == "int8"
    assert _tokens(during) == _tokens(after)


def test_a_packed_model_is_refused_by_an_engine_of_exact_sums(q4_k_m_file):
    packed = load_model(q4_k_m_file, keep_blocks=True, activation_quantization="int8")
    with pytest.raises(ValueError, match="is packed for activation_quantization int8; it cannot be served with "
                                         "activation_quantization none"):
        LLM(packed, **ENGINE)
