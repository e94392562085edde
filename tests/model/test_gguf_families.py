"""GGUF files of the new families load to the logits of the HF checkpoint they were made from.

Each tiny HF checkpoint is written as llama.cpp's converter writes its architecture
(tests/gguf_export.py, names and keys from the gguf package), loaded by raylm, and compared
with HF transformers on the same weights: logits within 1e-4 over a prompt that runs past
the 16-token windows, and 16 greedy tokens. One quantized export per block type checks
that matrices kept as GGUF blocks give HF's logits on the dequantized weights.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch

from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.errors import ModelLoadError, UnsupportedModelError
from raylm.model.loaders.gguf_file import GGUFFile
from raylm.model.loaders.load import load_checkpoint, load_model
from tests.checkpoints import build_tiny_checkpoint
from tests.gguf_export import export_gguf, round_to_stored
from tests.reference import hf_greedy

PROMPT_LEN = 45
GREEDY = 16  # decode steps: the forward pass is test_model_vs_hf's; this checks what the file loads
# Gemma GGUFs imply llama.cpp's query scale 1/sqrt(head_dim): the checkpoints are built so.
# Phi-3 gets a window (on every layer, as HF applies it) shorter than the prompt.
_OVERRIDES = {
    "gemma2": dict(query_pre_attn_scalar=32),
    "gemma3": dict(query_pre_attn_scalar=32),
    "phi3-longrope": dict(sliding_window=24),
    # llama.cpp's deepseek2 YaRN has one mscale (rope.scaling.yarn_log_multiplier): HF's two equal.
    "deepseek-v3": dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.8,
                                             mscale_all_dim=0.8, original_max_position_embeddings=128)),
    # What llama.cpp fixes for these architectures: Llama 4's 8192-token chunks and temperature
    # tuning (floor 8192, scale 0.1; NoPE on the fourth layer, as the tiny one has it), gpt-oss's
    # SwiGLU clamp at 7 and YaRN's truncated correction range.
    "llama4": dict(attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1),
    "smollm3": dict(num_hidden_layers=4, no_rope_layer_interval=4),  # (llama.cpp: NoPE every 4th layer)
    "gpt-oss": dict(swiglu_limit=7.0, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                           original_max_position_embeddings=128, beta_fast=32.0,
                                                           beta_slow=1.0, truncate=True)),
}
FAMILIES = ["qwen3", "gemma", "gemma2", "gemma3", "granite", "phi3-longrope", "mistral-sliding", "llama3-rope",
            "llama-yarn", "qwen2", "mixtral", "olmoe", "glm4-moe",  # (qwen3moe's keys: the refusal test below)
            "deepseek-v2-lite", "deepseek-v3", "llama4", "gpt-oss", "smollm3"]


def _prompt(length: int = PROMPT_LEN) -> list[int]:
    return np.random.RandomState(0).randint(3, 320, size=length).tolist()


def _export(variant: str, tmp_path, qtype=gguf.GGMLQuantizationType.F32):
    directory, hf_model = build_tiny_checkpoint(variant, tmp_path / variant, **_OVERRIDES.get(variant, {}))
    return export_gguf(directory, tmp_path / f"{variant}.gguf", qtype), hf_model


def _assert_matches_hf(config, params, hf_model) -> None:
    generator = SingleSequenceGenerator(config, params)
    ids = _prompt()
    with torch.no_grad():
        reference = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(generator.prompt_logits(ids), reference, atol=1e-4, rtol=1e-4)
    assert list(generator.generate(ids, GREEDY)) == hf_greedy(hf_model, ids, GREEDY)


@pytest.mark.parametrize("variant", FAMILIES)
def test_gguf_logits_and_greedy_match_hf(variant, tmp_path):
    path, hf_model = _export(variant, tmp_path)
    config, params = load_checkpoint(path)
    _assert_matches_hf(config, params, hf_model)


@pytest.mark.parametrize(
    "variant,qtype",
    [("phi3-longrope", gguf.GGMLQuantizationType.Q8_0), ("gemma3", gguf.GGMLQuantizationType.Q4_0),
     ("mixtral", gguf.GGMLQuantizationType.Q4_0)],
    ids=["phi3-Q8_0", "gemma3-Q4_0", "mixtral-Q4_0"],
)
def test_blocks_kept_as_stored_match_hf_on_the_dequantized_weights(variant, qtype, tmp_path):
    path, hf_model = _export(variant, tmp_path, qtype)
    round_to_stored(hf_model, qtype)  # the reference: HF on the weights the file holds
    model = load_model(path, keep_blocks=True)
    layer = model.params.layers[0]
    assert type(layer.wqkv).__name__ == "GgufBlocks"
    _assert_matches_hf(model.config, model.params, hf_model)
    if model.config.moe is not None:  # the stacked experts too (their kernel: tests/model/test_grouped_kernel.py)
        assert type(layer.w_experts_gate_up).__name__ == type(layer.w_experts_down).__name__ == "GgufBlocks"


def test_deepseek2_with_kv_b_whole_loads_as_with_it_split(tmp_path):
    """Files converted before llama.cpp split kv_b_proj (attn_kv_b, the heads' sizes in key_length /
    value_length) load to HF's logits too; the split ones (FAMILIES above) hold attn_k_b / attn_v_b."""
    directory, hf_model = build_tiny_checkpoint("deepseek-v2-lite", tmp_path / "ds")
    whole = GGUFFile(export_gguf(directory, tmp_path / "whole.gguf", split_kv_b=False))
    split = GGUFFile(export_gguf(directory, tmp_path / "split.gguf"))
    assert "blk.0.attn_kv_b.weight" in whole.tensor_names and "blk.0.attn_k_b.weight" in split.tensor_names
    assert whole.config() == split.config()
    _assert_matches_hf(*load_checkpoint(whole.path), hf_model)


def test_config_follows_llama_cpp_conventions(tmp_path):
    path, _ = _export("gemma2", tmp_path)
    config = GGUFFile(path).config()
    # Every other layer slides (llama.cpp's pattern 2), soft-caps from the file, 1/sqrt(head_dim).
    assert config.layer_windows == (16, None, 16)
    assert (config.attn_softcap, config.final_softcap, config.query_scale) == (5.0, 8.0, 32**-0.5)
    assert config.embed_scale == pytest.approx(8.0) and config.sandwich_norms and config.tie_word_embeddings
    path, _ = _export("gemma3", tmp_path)
    config = GGUFFile(path).config()
    assert config.local_rope_theta == 10000.0 and config.rope_theta == 1e6
    assert config.rope_scaling.rope_type == "linear" and config.rope_scaling.factor == 2.0
    path, _ = _export("gemma", tmp_path)
    config = GGUFFile(path).config()  # Gemma 1: none of Gemma 2's sandwich norms, caps or query scalar
    assert config.embed_scale == pytest.approx(8.0) and config.tie_word_embeddings and config.activation == "gelu_tanh"
    assert not config.sandwich_norms and (config.attn_softcap, config.final_softcap, config.query_scale) == (None,) * 3
    path, _ = _export("granite", tmp_path)
    config = GGUFFile(path).config()  # the multipliers from granite.* keys
    assert (config.embedding_multiplier, config.residual_multiplier, config.query_scale,
            config.logits_divisor) == (4.0, 0.5, 0.5, 2.5)
    path, _ = _export("phi3-longrope", tmp_path)
    config = GGUFFile(path).config()
    assert config.layer_windows == (24, 24, 24) and config.rope_scaling.rope_type == "longrope"
    assert config.rope_scaling.long_factor[-1] == 5.0 and config.rope_scaling.original_max_position_embeddings == 32


def test_moe_config_follows_llama_cpp_conventions(tmp_path):
    from raylm.model.config.moe import MoeConfig

    path, _ = _export("olmoe", tmp_path)
    config = GGUFFile(path).config()  # OLMoE: no renormalization, whole-projection q/k norms
    assert config.moe == MoeConfig(8, 2, 32, False, (True,) * 3) and config.qk_norm_whole
    path, _ = _export("mixtral", tmp_path)
    config = GGUFFile(path).config()  # a "llama" file with experts: Mixtral's renormalized top-2
    assert config.architecture == "llama" and config.moe == MoeConfig(4, 2, 64, True, (True,) * 3)
    directory, _ = build_tiny_checkpoint("qwen2-moe", tmp_path / "q2m", decoder_sparse_step=1)
    file = GGUFFile(export_gguf(directory, tmp_path / "q2m.gguf"))  # shared expert: its size and tensors
    assert file.config().moe == MoeConfig(4, 2, 32, False, (True,) * 3, shared_expert_size=64)
    assert {"blk.0.ffn_gate_inp_shexp.weight", "blk.0.ffn_up_shexp.weight"} <= set(file.tensor_names)


def test_glm4moe_config_follows_llama_cpp_conventions(tmp_path):
    """GLM-4.5's file: partial rotary from rope.dimension_count, biases and q/k norms from the tensors
    it has, the routing from the expert keys (the groups from expert_group_count, which llama.cpp
    reads for every architecture), the nextn layer counted in block_count but not a decoder layer."""
    from raylm.model.config.model_config import ModelConfig

    path, _ = _export("glm4-moe", tmp_path)
    file = GGUFFile(path)
    config, hf = file.config(), ModelConfig.from_hf_dir(path.parent / "glm4-moe")
    assert file.fields["glm4moe.block_count"] == 4 and config.num_layers == 3
    assert (config.rotary_dim, config.attention_bias, config.qk_norm) == (16, True, True)
    routing = config.moe.deepseek
    assert routing.scaling_factor == pytest.approx(1.7)  # (a float32 in the file)
    assert dataclasses.replace(config.moe, deepseek=dataclasses.replace(routing, scaling_factor=1.7)) == hf.moe
    directory, _ = build_tiny_checkpoint("glm4-moe", tmp_path / "plain", n_group=1, topk_group=1, attention_bias=False,
                                         use_qk_norm=False)
    plain = GGUFFile(export_gguf(directory, tmp_path / "plain.gguf")).config()
    assert plain.moe.deepseek.num_groups == 1 and not plain.attention_bias and not plain.qk_norm


def test_deepseek2_config_follows_llama_cpp_conventions(tmp_path):
    """DeepSeek's files: the routing from the expert keys (V2's softmax, V3's sigmoid and groups),
    the correction bias where the file holds exp_probs_b (V3's), the shared experts from
    expert_shared_count; files without expert_gating_func (V2's before the key) score by softmax;
    leading_dense_block_count covering every layer leaves no experts."""
    from raylm.model.config.model_config import ModelConfig

    for variant in ("deepseek-v2-lite", "deepseek-v3"):
        path, _ = _export(variant, tmp_path)
        file = GGUFFile(path)
        hf = ModelConfig.from_hf_dir(path.parent / variant)
        routing = hf.moe.deepseek  # (llama.cpp scores groups by their two best; with one group, moot)
        if routing.num_groups == 1:
            routing = dataclasses.replace(routing, group_score="top2_sum")
        assert file.config().moe == dataclasses.replace(hf.moe, deepseek=routing), variant
        assert ("blk.1.exp_probs_b.bias" in file.tensor_names) == hf.moe.deepseek.score_correction
    old = ModelConfig.from_gguf_fields(_deepseek2(), "old.gguf").moe
    assert old.deepseek.scoring == "softmax" and old.sparse_layers == (False, True, True)
    assert ModelConfig.from_gguf_fields(_deepseek2(**{"deepseek2.leading_dense_block_count": 3}), "d.gguf").moe is None


def _rewritten(path, out, extra: dict[str, np.ndarray]):
    """The GGUF at ``path`` written again to ``out`` with the tensors ``extra`` added."""
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(out), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            value = field.contents()
            kind = field.types[0]
            sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, value, kind, sub_type=sub)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensor.data).reshape(tuple(reversed(tensor.shape.tolist()))))
    for name, array in extra.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def test_glm4moe_prediction_layer_tensors_are_skipped_as_llama_cpp_skips_them(tmp_path):
    path, _ = _export("glm4-moe", tmp_path)
    nextn = _rewritten(path, tmp_path / "nextn.gguf", {"blk.3.nextn.eh_proj.weight": np.zeros((64, 128), np.float32)})
    assert load_checkpoint(nextn)[0].num_layers == 3
    beyond = _rewritten(path, tmp_path / "beyond.gguf", {"blk.4.attn_norm.weight": np.ones(64, np.float32)})
    with pytest.raises(UnsupportedModelError, match="blk.4.attn_norm.weight"):
        load_checkpoint(beyond)


def _fields(**extra):
    base = {
        "general.architecture": "gemma2", "gemma2.embedding_length": 4608, "gemma2.attention.head_count": 32,
        "gemma2.attention.key_length": 128, "gemma2.block_count": 46, "gemma2.feed_forward_length": 36864,
        "tokenizer.ggml.tokens": ["a"] * 8,
    }
    return {**base, **extra}


def _granite(**extra):
    fields = {k.replace("gemma2", "granite"): v for k, v in _fields(**{"gemma2.logit_scale": 8.0}).items()}
    return {k: v for k, v in {**fields, "general.architecture": "granite", **extra}.items() if v is not None}


def test_granite_keys_are_read_as_llama_cpp_reads_them():
    from raylm.model.config.model_config import ModelConfig

    # 0 (or absent) means none for the embedding and residual scales, 1/sqrt(head_dim) for attention's.
    config = ModelConfig.from_gguf_fields(_granite(**{"granite.embedding_scale": 0.0, "granite.residual_scale": 0.25}),
                                          "g.gguf")
    assert (config.embedding_multiplier, config.residual_multiplier, config.query_scale,
            config.logits_divisor) == (None, 0.25, None, 8.0)
    with pytest.raises(ModelLoadError, match="granite.logit_scale"):  # llama.cpp requires it
        ModelConfig.from_gguf_fields(_granite(**{"granite.logit_scale": None}), "g.gguf")
    with pytest.raises(UnsupportedModelError, match="granite.rope.scaling.finetuned"):  # no RoPE at all
        ModelConfig.from_gguf_fields(_granite(**{"granite.rope.scaling.finetuned": False}), "g.gguf")


def test_gemma_defaults_and_27b_query_scale_are_llama_cpps():
    from raylm.model.config.model_config import ModelConfig

    config = ModelConfig.from_gguf_fields(_fields(), "27b.gguf")
    assert config.query_scale == 144**-0.5  # hidden / heads, not head_dim, for the 27B
    assert (config.attn_softcap, config.final_softcap) == (50.0, 30.0)
    assert config.layer_windows[:3] == (4096, None, 4096)
    config = ModelConfig.from_gguf_fields(_fields(**{"gemma2.block_count": 42}), "9b.gguf")
    assert config.query_scale == 128**-0.5
    gemma3 = {k.replace("gemma2", "gemma3"): v for k, v in _fields(**{"gemma2.attention.sliding_window": 512}).items()}
    gemma3["general.architecture"] = "gemma3"
    config = ModelConfig.from_gguf_fields(gemma3, "g3.gguf")
    assert config.layer_windows[:6] == (512,) * 5 + (None,) and config.local_rope_theta == 10000.0
    config = ModelConfig.from_gguf_fields({**gemma3, "gemma3.attention.sliding_window_pattern": 3}, "g3.gguf")
    assert config.layer_windows[:3] == (512, 512, None)


def _glm4moe(**extra):
    base = {"general.architecture": "glm4moe", "glm4moe.embedding_length": 64, "glm4moe.attention.head_count": 4,
            "glm4moe.attention.key_length": 32, "glm4moe.block_count": 3, "glm4moe.feed_forward_length": 128,
            "glm4moe.expert_count": 8, "glm4moe.expert_used_count": 2, "glm4moe.expert_feed_forward_length": 32}
    return {**base, **extra}


def _deepseek2(**extra):
    base = {"general.architecture": "deepseek2", "deepseek2.embedding_length": 64, "deepseek2.attention.head_count": 4,
            "deepseek2.block_count": 3, "deepseek2.feed_forward_length": 128, "deepseek2.attention.kv_lora_rank": 32,
            "deepseek2.rope.dimension_count": 8, "deepseek2.attention.key_length": 24,
            "deepseek2.attention.value_length": 16, "deepseek2.expert_count": 4, "deepseek2.expert_used_count": 2,
            "deepseek2.expert_feed_forward_length": 32, "deepseek2.leading_dense_block_count": 1}
    return {**base, **extra}


@pytest.mark.parametrize(
    "extra,match",
    [
        ({"gemma2.rope.scaling.type": "dynamic"}, r"rope.scaling.type='dynamic'"),
        ({"general.architecture": "qwen3", "qwen3.embedding_length": 64, "qwen3.attention.head_count": 4,
          "qwen3.block_count": 2, "qwen3.feed_forward_length": 128, "qwen3.final_logit_softcapping": 30.0},
         "qwen3.final_logit_softcapping"),
        ({"gemma2.expert_count": 8}, "gemma2.expert_count"),
        ({"general.architecture": "qwen3moe", "qwen3moe.embedding_length": 64, "qwen3moe.attention.head_count": 4,
          "qwen3moe.block_count": 2, "qwen3moe.feed_forward_length": 128, "qwen3moe.expert_count": 8,
          "qwen3moe.expert_used_count": 2, "qwen3moe.expert_gating_func": 2}, "qwen3moe.expert_gating_func"),
        ({"gemma2.rope.dimension_count": 64}, "gemma2.rope.dimension_count"),
        ({"gemma2.rope.scaling.type": "linear", "gemma2.rope.scaling.factor": 2.0,
          "gemma2.rope.scaling.attn_factor": 0.5}, "gemma2.rope.scaling.attn_factor"),
        ({"gemma2.attention.head_count_kv": [8, 16]}, "per layer"),
        ({"general.architecture": "qwen3moe", "qwen3moe.embedding_length": 64, "qwen3moe.attention.head_count": 4,
          "qwen3moe.block_count": 2, "qwen3moe.feed_forward_length": 128, "qwen3moe.expert_count": 8,
          "qwen3moe.expert_used_count": 2, "qwen3moe.expert_shared_count": 1}, "qwen3moe.expert_shared_count"),
        ({"gemma2.nextn_predict_layers": 1}, "gemma2.nextn_predict_layers"),
        (_glm4moe(**{"glm4moe.expert_gating_func": 3}), "glm4moe.expert_gating_func"),
        (_glm4moe(**{"glm4moe.rope.dimension_count": 15}), "glm4moe.rope.dimension_count"),
        (_glm4moe(**{"glm4moe.expert_group_count": 3}), "n_group=3"),
        ({"gemma2.logit_scale": 2.0}, "gemma2.logit_scale"),  # Granite's keys on another architecture
        ({"gemma2.attention.scale": 0.5}, "gemma2.attention.scale"),
        ({**{k.replace("gemma2", "gemma"): v for k, v in _fields().items()}, "general.architecture": "gemma",
          "gemma.final_logit_softcapping": 30.0}, "gemma.final_logit_softcapping"),
        (_deepseek2(**{"deepseek2.expert_gating_func": 3}), "deepseek2.expert_gating_func"),
        (_deepseek2(**{"deepseek2.expert_group_count": 3}), "n_group=3"),
    ],
)
def test_metadata_raylm_does_not_implement_is_a_load_error(extra, match):
    from raylm.model.config.model_config import ModelConfig

    with pytest.raises(UnsupportedModelError, match=match):
        ModelConfig.from_gguf_fields(_fields(**extra), "bad.gguf")


def test_a_tensor_the_model_does_not_read_is_a_load_error(tmp_path):
    path, _ = _export("qwen3", tmp_path)
    extra = _rewritten(path, tmp_path / "extra.gguf", {"blk.0.attn_q.bias": np.zeros(128, np.float32)})
    with pytest.raises(UnsupportedModelError, match="blk.0.attn_q.bias"):
        load_checkpoint(extra)
