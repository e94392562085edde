"""llama.cpp's ``llama4`` and ``gpt-oss`` files: what llama.cpp fixes for them rather than reads
(Llama 4's chunks, NoPE layers, temperature tuning and q/k norms; gpt-oss's window pattern and
SwiGLU clamp), gpt-oss's MXFP4 experts kept as stored, and their o200k pre-tokenizer. The
logits against HF are tests/model/test_gguf_families.py's (FAMILIES)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from raylm.model.config.expert_mlp import ClampedSwiglu
from raylm.model.config.llama4 import AttnTemperature
from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.errors import UnsupportedModelError
from raylm.model.loaders.gguf_file import GGUFFile
from raylm.model.loaders.load import load_checkpoint
from raylm.model.quantization.gguf_blocks import GgufBlocks
from raylm.model.text.tokenizer import _gguf_pre_tokenizer
from tests.checkpoints import build_tiny_checkpoint
from tests.gguf_export import export_gguf
from tests.reference import hf_greedy

T = gguf.GGMLQuantizationType
_GPT_OSS = dict(swiglu_limit=7.0, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                       original_max_position_embeddings=128, truncate=True))


def _llama4_fields(**extra) -> dict:
    fields = {"general.architecture": "llama4", "llama4.block_count": 8, "llama4.embedding_length": 64,
              "llama4.attention.head_count": 4, "llama4.attention.head_count_kv": 2, "llama4.feed_forward_length": 128,
              "llama4.expert_count": 16, "llama4.expert_used_count": 1, "llama4.expert_feed_forward_length": 32,
              "llama4.interleave_moe_layer_step": 2, "llama4.vocab_size": 320}
    return {**fields, **extra}


def test_llama4_file_runs_as_llama_cpp_fixes_it():
    config = ModelConfig.from_gguf_fields(_llama4_fields(), "scout.gguf")
    assert config.nope_layers == (False, False, False, True) * 2
    assert config.layer_chunks == (8192, 8192, 8192, None) * 2
    assert config.attn_temperature == AttnTemperature(8192.0, 0.1) and config.l2_qk_norm
    assert config.moe.sparse_layers == (False, True) * 4 and config.moe.sigmoid_scales_input
    assert config.moe.shared_expert_size == 32 and not config.moe.shared_expert_gated and config.intermediate_size == 128
    # The 128-expert model (Maverick) has no q/k norms; every layer sparse with step 1.
    maverick = ModelConfig.from_gguf_fields(
        _llama4_fields(**{"llama4.expert_count": 128, "llama4.interleave_moe_layer_step": 1}), "maverick.gguf")
    assert not maverick.l2_qk_norm and maverick.moe.sparse_layers == (True,) * 8
    with pytest.raises(UnsupportedModelError, match="sliding_window"):
        ModelConfig.from_gguf_fields(_llama4_fields(**{"llama4.attention.sliding_window": 0}), "mobilellm.gguf")


def test_gpt_oss_file_config(tmp_path):
    directory, _ = build_tiny_checkpoint("gpt-oss", tmp_path / "hf", **_GPT_OSS)
    config = GGUFFile(export_gguf(directory, tmp_path / "g.gguf")).config()
    hf = ModelConfig.from_hf_dir(directory)
    assert config.layer_windows == hf.layer_windows == (16, None, 16)
    assert config.attention_sinks and config.o_proj_bias and config.attention_bias
    assert config.moe.clamped_swiglu == ClampedSwiglu(7.0, 1.702) and config.moe.router_bias and config.moe.expert_bias
    assert config.moe.norm_topk_prob and config.moe.sparse_layers == (True,) * 3


def _mxfp4_experts(name: str) -> T:
    return T.MXFP4 if "_exps.weight" in name else T.F32


@pytest.mark.parametrize("keep_blocks", [True, False], ids=["kept", "expanded"])
def test_gpt_oss_mxfp4_experts_give_hf_logits_on_the_stored_weights(tmp_path, keep_blocks):
    directory, hf_model = build_tiny_checkpoint("gpt-oss", tmp_path / "hf", **_GPT_OSS)
    path = export_gguf(directory, tmp_path / "g.gguf", _mxfp4_experts)
    reader = gguf.GGUFReader(str(path))
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors if "_exps.weight" in t.name}
    with torch.no_grad():  # HF's experts := the file's, in HF's layout (inputs first, gate/up interleaved)
        for i, layer in enumerate(hf_model.model.layers):
            gate, up = stored[f"blk.{i}.ffn_gate_exps.weight"], stored[f"blk.{i}.ffn_up_exps.weight"]
            gate_up = np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, gate.shape[2]).transpose(0, 2, 1)
            layer.mlp.experts.gate_up_proj.copy_(torch.from_numpy(np.ascontiguousarray(gate_up)))
            down = stored[f"blk.{i}.ffn_down_exps.weight"].transpose(0, 2, 1)
            layer.mlp.experts.down_proj.copy_(torch.from_numpy(np.ascontiguousarray(down)))
    config, params = load_checkpoint(path, keep_blocks=keep_blocks)
    assert isinstance(params.layers[0].w_experts_gate_up, GgufBlocks) == keep_blocks
    assert isinstance(params.layers[0].w_experts_down, GgufBlocks) == keep_blocks
    generator = SingleSequenceGenerator(config, params)
    ids = np.random.RandomState(2).randint(3, 320, size=40).tolist()
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(generator.prompt_logits(ids), reference, atol=1e-4, rtol=1e-4)
    assert list(generator.generate(ids, 12)) == hf_greedy(hf_model, ids, 12)


@pytest.mark.parametrize("pre", ["gpt-4o", "llama4"])
def test_o200k_pre_tokenizer_splits_as_llama_cpp_gpt4o(pre):
    """Hand-checked pieces where o200k differs from Llama 3's split: case changes start a word
    (and a contraction stays on it), digits in threes."""
    pieces = [p for p, _ in _gguf_pre_tokenizer(pre).pre_tokenize_str("HelloWorld's ABCdef 12345 x/\n")]
    assert pieces == ["Hello", "World's", "ĠABCdef", "Ġ", "123", "45", "Ġx", "/Ċ"]
    llama3 = [p for p, _ in _gguf_pre_tokenizer("llama-bpe").pre_tokenize_str("HelloWorld's")]
    assert llama3 == ["HelloWorld", "'s"]
