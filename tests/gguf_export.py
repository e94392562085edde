"""Write a tiny HF checkpoint as the GGUF llama.cpp's convert_hf_to_gguf.py would (test support).

Independent of raylm's loader: tensor names come from the gguf package's own HF -> GGUF map
(``gguf.get_tensor_name_map``) and the metadata keys from its writer, per architecture as the
converter writes them (its LlamaModel for Llama and Mistral, Qwen3Model, GemmaModel,
Gemma2Model, Gemma3Model, Phi3MiniModel, GraniteModel (a LlamaModel plus its four multipliers
as keys), and for experts its LlamaModel (Mixtral), Qwen3MoeModel, OlmoeModel, Glm4MoeModel and
DeepseekV2Model (V3 too), which stack each layer's experts into one tensor): Q/K rows permuted for
llama and granite, ``1 + w`` in Gemma's norms, Phi-3's fused qkv / gate_up kept whole with its LongRoPE factors as tensors,
Llama 3's RoPE as a ``rope_freqs`` tensor. Two things the converter drops and these tests need are written
in the keys llama.cpp defines for them: a Mistral window (``attention.sliding_window``) and
a Gemma 3 layer pattern other than five-in-six (``attention.sliding_window_pattern``, one
flag per layer). A setting GGUF cannot express (Gemma's query scale other than llama.cpp's
rule, Gemma 2's RoPE base) is an error here rather than a silently different file.

The tokenizer is the checkpoint's byte-level BPE (``tokenizer.ggml.model = gpt2``), padded
to the model's vocabulary with ``[PADn]`` tokens as the converter does.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
from safetensors.numpy import load_file

from raylm.benchmarks.random_blocks import F16_SCALED_TYPES, random_blocks

_ARCHES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    "MixtralForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "OlmoeForCausalLM": "olmoe",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Glm4MoeForCausalLM": "glm4moe",
    "GraniteForCausalLM": "granite",
    "DeepseekV2ForCausalLM": "deepseek2",
    "DeepseekV3ForCausalLM": "deepseek2",
    "Llama4ForCausalLM": "llama4",
    "SmolLM3ForCausalLM": "smollm3",
    "GptOssForCausalLM": "gpt-oss",
}
# The converter's LlamaModel and its subclasses permute Q/K rows (Llama4Model, whose rows are
# interleaved already, does not: undo_permute = False); Gemma's models store norms as 1 + w.
_PERMUTED = ("llama", "granite", "smollm3")
_LLAMA_MODELS = (*_PERMUTED, "llama4")
_GEMMAS = ("gemma", "gemma2", "gemma3")
# Granite's multipliers and the keys GraniteModel writes them as (only when non-zero).
_GRANITE_SCALES = {"attention_multiplier": "add_attention_scale", "embedding_multiplier": "add_embedding_scale",
                   "residual_multiplier": "add_residual_scale", "logits_scaling": "add_logit_scale"}
# llama.cpp's fixed choice, per architecture, of renormalizing the top-k expert weights.
_NORM_TOPK = {"llama": True, "qwen3moe": True, "olmoe": False, "qwen2moe": False}
_EXPERT_RE = re.compile(r"(model\.layers\.\d+\.\w+\.experts)\.(\d+)\.(\w+)\.weight")
T = gguf.GGMLQuantizationType
# Types export_gguf quantizes with the gguf package (the others get random blocks).
_QUANTIZED = {T.Q4_0, T.Q4_1, T.Q8_0}
# A qtype for every tensor, or one per GGUF tensor name.
QTypes = T | Callable[[str], T]


def q4_k_m_types(name: str) -> T:
    """llama-quantize's Q4_K_M choice on a small model (a ``QTypes`` for ``export_gguf``): Q6_K for
    the value and down projections and the output matrix, Q4_K elsewhere (its per-layer
    alternation aside)."""
    return T.Q6_K if name.startswith("output.") or "attn_v" in name or "ffn_down" in name else T.Q4_K



def released_gpt_oss_types(name: str) -> T:
    """The types of llama.cpp's released gpt-oss files (a ``QTypes``): MXFP4 experts, Q8_0 matrices,
    F32 router (export_gguf writes vectors F32 anyway)."""
    if name.endswith("_exps.weight"):
        return T.MXFP4
    return T.Q8_0 if name.endswith(".weight") and "ffn_gate_inp" not in name else T.F32

def load_stored(hf_model: Any, path: Path) -> None:
    """Give ``hf_model`` (a dense, non-llama architecture: no Q/K permutation, no stacked
    experts) the matrices the GGUF file at ``path`` holds, as the gguf package dequantizes them,
    in place: the reference for raylm reading the file's blocks as stored."""
    import torch

    reader = gguf.GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    assert arch != "llama", "llama files permute Q/K rows; use another architecture"
    stored = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(_model_arch(arch), hf_model.config.num_hidden_layers)
    with torch.no_grad():
        for hf_name, param in hf_model.named_parameters():
            if param.ndim < 2:
                continue
            tensor = stored[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))]
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(param.shape)
            param.copy_(torch.from_numpy(np.ascontiguousarray(values, np.float32)))


def round_to_stored(hf_model: Any, qtype: gguf.GGMLQuantizationType) -> None:
    """Give ``hf_model`` the weights a GGUF file of ``qtype`` holds (every matrix quantized and
    dequantized by the gguf package; experts ``[E, out, in]`` alike), in place: the reference
    for raylm reading the file's blocks as stored."""
    import torch

    with torch.no_grad():
        for param in hf_model.parameters():
            if param.ndim >= 2:
                stored = gguf.quants.quantize(param.numpy(), qtype)
                param.copy_(torch.from_numpy(gguf.quants.dequantize(stored, qtype).reshape(param.shape)))


def export_gguf(hf_dir: Path, out: Path, qtype: QTypes = T.F32, split_kv_b: bool = True) -> Path:
    """Write ``hf_dir`` as ``out``; matrices (and stacked experts) in ``qtype`` (F32, a type the
    gguf package quantizes, or one it cannot: random blocks, see ``random_blocks``; or a type per
    tensor name, as llama-quantize mixes them), vectors F32. A DeepSeek checkpoint's kv_b_proj is
    split into attn_k_b / attn_v_b as today's converter does, or with ``split_kv_b=False`` kept
    whole as attn_kv_b with the head sizes in key_length / value_length, as converters before
    llama.cpp's MLA absorption wrote it."""
    hp = json.loads((hf_dir / "config.json").read_text())
    arch = _ARCHES[hp["architectures"][0]]
    writer = gguf.GGUFWriter(str(out), arch)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    _write_metadata(writer, arch, hp, split_kv_b)
    _write_tokenizer(writer, hf_dir, hp["vocab_size"])
    for seed, (name, array) in enumerate(_tensors(writer, arch, hp, tensors, split_kv_b)):
        array = np.ascontiguousarray(array, dtype=np.float32)
        kind = qtype(name) if callable(qtype) else qtype
        if array.ndim in (2, 3) and kind in F16_SCALED_TYPES and kind not in _QUANTIZED:
            writer.add_tensor(name, random_blocks(kind, array.shape, seed), raw_dtype=kind)
        elif array.ndim in (2, 3) and kind != T.F32:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _rope_params(hp: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, sliding) RoPE parameters of a transformers-5 config."""
    params = hp.get("rope_parameters") or {}
    if "full_attention" in params:
        return params["full_attention"], params.get("sliding_attention") or {}
    return params, {}


def _head_dim(hp: dict[str, Any]) -> int:
    return hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]


def _write_metadata(w: gguf.GGUFWriter, arch: str, hp: dict[str, Any], split_kv_b: bool = True) -> None:
    rope, local_rope = _rope_params(hp)
    # (Glm4MoeModel counts the multi-token-prediction layers as blocks; the tiny checkpoints store none.)
    nextn = (hp.get("num_nextn_predict_layers") or 0) if arch == "glm4moe" else 0
    w.add_block_count(hp["num_hidden_layers"] + nextn)
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size_mlp" if arch == "llama4" else "intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(1 if arch == "deepseek2" else hp["num_key_value_heads"])  # (its one latent)
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if arch == "deepseek2":
        _write_deepseek2(w, hp, rope, split_kv_b)
        return
    if arch == "phi3":  # Phi3MiniModel writes its own set, no scaling type
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_dimension_count(hp["hidden_size"] // hp["num_attention_heads"])
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(hp.get("sliding_window") or 0)
        scale = hp["max_position_embeddings"] / rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"])) if scale > 1 else 1.0
        )
        return
    if arch in ("gemma", "gemma2"):  # GemmaModel, Gemma2Model write no RoPE keys: llama.cpp's base 10000 applies
        assert rope.get("rope_theta", 10000.0) == 10000.0 and rope.get("rope_type", "default") == "default", rope
    else:
        kind = rope.get("rope_type", "default")
        if kind == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
        elif kind == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(rope["factor"])
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        else:
            assert kind in ("default", "llama3"), rope  # llama3: the rope_freqs tensor
        w.add_rope_freq_base(rope["rope_theta"])
        if "rope_theta" in local_rope:
            w.add_rope_freq_base_swa(local_rope["rope_theta"])
    if hp.get("head_dim") is not None:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    if arch in _LLAMA_MODELS:  # LlamaModel's own keys (GraniteModel's, Llama4Model's too)
        w.add_vocab_size(hp["vocab_size"])
        w.add_rope_dimension_count(_head_dim(hp))
        if hp.get("sliding_window"):
            w.add_sliding_window(hp["sliding_window"])
    if arch in ("gemma2", "gemma3"):
        _write_gemma(w, arch, hp)
    if arch == "granite":
        for key, add in _GRANITE_SCALES.items():
            if hp.get(key):
                getattr(w, add)(hp[key])
    if arch == "glm4moe":
        _write_glm4moe(w, hp)
        return
    if arch in ("llama4", "gpt-oss"):
        _write_llama4_or_gpt_oss(w, arch, hp)
        return
    experts = hp.get("num_local_experts") or hp.get("num_experts")
    if experts:
        _write_experts(w, arch, hp, experts)


def _write_glm4moe(w: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """Glm4MoeModel.set_gguf_parameters; and the expert groups, which it drops (GLM-4.5's own
    configs have one) and llama.cpp reads for every architecture."""
    rope, _ = _rope_params(hp)
    w.add_rope_dimension_count(int(_head_dim(hp) * rope.get("partial_rotary_factor", 0.5)))
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_expert_weights_norm(hp["norm_topk_prob"])
    w.add_nextn_predict_layers(hp.get("num_nextn_predict_layers") or 0)
    if hp.get("n_group", 1) > 1:
        w.add_expert_group_count(hp["n_group"])
        w.add_expert_group_used_count(hp["topk_group"])


def _write_deepseek2(w: gguf.GGUFWriter, hp: dict[str, Any], rope: dict[str, Any], split_kv_b: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters' keys (V3 converts as the same architecture)."""
    if not hp.get("rope_interleave", True):
        raise ValueError("rope_interleave=false: llama.cpp's deepseek2 rotates interleaved pairs")
    rank, rope_dim = hp["kv_lora_rank"], hp["qk_rope_head_dim"]
    nope, value = hp["qk_nope_head_dim"], hp["v_head_dim"]
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if split_kv_b:  # the cache's sizes (the latent and rotary key; the latent as value), then the heads'
        w.add_key_length(rank + rope_dim)
        w.add_value_length(rank)
        w.add_key_length_mla(nope + rope_dim)
        w.add_value_length_mla(value)
    else:
        w.add_key_length(nope + rope_dim)
        w.add_value_length(value)
    w.add_rope_dimension_count(rope_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_expert_count(hp["n_routed_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_expert_weights_norm(bool(hp.get("norm_topk_prob")))
    # (DeepSeek's own configs state scoring_func; transformers' drop it: HF's V3 scores by sigmoid, V2 by softmax.)
    v3 = hp["architectures"][0] == "DeepseekV3ForCausalLM"
    scoring = hp.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if scoring == "sigmoid"
                             else gguf.ExpertGatingFuncType.SOFTMAX)
    if hp.get("topk_method") == "group_limited_greedy":
        raise ValueError("topk_method=group_limited_greedy: llama.cpp scores a group by its two best experts, "
                         "HF's DeepSeek-V2 by its best one")
    if hp.get("n_group") is not None:  # (TextModel.set_gguf_parameters, for every architecture)
        w.add_expert_group_count(hp["n_group"])
    if hp.get("topk_group") is not None:
        w.add_expert_group_used_count(hp["topk_group"])
    if rope.get("rope_type", "default") == "yarn":
        if rope.get("mscale") != rope.get("mscale_all_dim"):
            raise ValueError("mscale != mscale_all_dim: llama.cpp's deepseek2 YaRN implies them equal")
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    else:
        assert rope.get("rope_type", "default") == "default", rope


def _write_llama4_or_gpt_oss(w: gguf.GGUFWriter, arch: str, hp: dict[str, Any]) -> None:
    """Llama4Model's and GptOssModel's keys: the experts (TextModel's counts, their size), Llama
    4's interleave step, gpt-oss's window. llama.cpp fixes the rest (chunks, NoPE layers and
    temperature tuning; the SwiGLU clamp): the tests build checkpoints with those values."""
    w.add_expert_count(hp["num_local_experts"])
    w.add_expert_used_count(hp["num_experts_per_tok"])
    w.add_expert_feed_forward_length(hp["intermediate_size"])
    if arch == "llama4":
        w.add_interleave_moe_layer_step(hp["interleave_moe_layer_step"])
    else:
        w.add_sliding_window(hp["sliding_window"])


def _split_experts(arch: str, hf_name: str, array: np.ndarray):
    """Llama4Model's / GptOssModel's modify_tensors for the stacked experts (inputs first in HF):
    transposed to outputs first, gate_up split into gate and up (halves for Llama 4, even and odd
    rows for gpt-oss, biases too); gpt-oss's sinks named as a weight. (name, array) pairs."""
    if hf_name.endswith("sinks"):
        yield hf_name + ".weight", array
    elif hf_name.endswith("gate_up_proj_bias"):
        yield hf_name.replace("gate_up_proj_bias", "gate_proj.bias"), array[..., ::2]
        yield hf_name.replace("gate_up_proj_bias", "up_proj.bias"), array[..., 1::2]
    elif hf_name.endswith("down_proj_bias"):
        yield hf_name.replace("down_proj_bias", "down_proj.bias"), array
    elif hf_name.endswith("experts.gate_up_proj"):
        rows = np.swapaxes(array, -1, -2)
        half = rows.shape[1] // 2
        gate, up = (rows[:, :half], rows[:, half:]) if arch == "llama4" else (rows[:, ::2], rows[:, 1::2])
        yield hf_name.replace("gate_up_proj", "gate_proj.weight"), gate
        yield hf_name.replace("gate_up_proj", "up_proj.weight"), up
    elif hf_name.endswith("experts.down_proj"):
        yield hf_name + ".weight", np.swapaxes(array, -1, -2)
    else:
        yield hf_name, array


def _write_experts(w: gguf.GGUFWriter, arch: str, hp: dict[str, Any], experts: int) -> None:
    # llama.cpp makes every layer sparse and fixes the renormalization per architecture.
    if hp.get("mlp_only_layers") or (hp.get("decoder_sparse_step") or 1) != 1:
        raise ValueError(f"a {arch} GGUF has experts on every layer; this config mixes in dense ones")
    norm = True if arch == "llama" else bool(hp.get("norm_topk_prob"))
    if norm != _NORM_TOPK[arch]:
        raise ValueError(f"norm_topk_prob={norm}: llama.cpp's {arch} implies {_NORM_TOPK[arch]}")
    w.add_expert_count(experts)
    w.add_expert_used_count(hp["num_experts_per_tok"])
    if "moe_intermediate_size" in hp:
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if hp.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(hp["shared_expert_intermediate_size"])


def _write_gemma(w: gguf.GGUFWriter, arch: str, hp: dict[str, Any]) -> None:
    layers = hp["num_hidden_layers"]
    # llama.cpp's query scale: 1/sqrt(head_dim), hidden/heads for the 27B (46 / 62 layers).
    big = layers == {"gemma2": 46, "gemma3": 62}[arch]
    scalar = hp["hidden_size"] // hp["num_attention_heads"] if big else hp["head_dim"]
    if hp.get("query_pre_attn_scalar") != scalar:
        raise ValueError(f"query_pre_attn_scalar={hp.get('query_pre_attn_scalar')}: a {arch} GGUF implies {scalar}")
    if arch == "gemma2":
        w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    elif hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    if hp.get("sliding_window"):
        w.add_sliding_window(hp["sliding_window"])
        period = 2 if arch == "gemma2" else 6
        sliding = [t == "sliding_attention" for t in hp["layer_types"]]
        if sliding != [i % period < period - 1 for i in range(layers)]:
            w.add_sliding_window_pattern(sliding)


def _tensors(w: gguf.GGUFWriter, arch: str, hp: dict[str, Any], tensors: dict[str, np.ndarray],
             split_kv_b: bool = True):
    """(GGUF name, array) pairs, as the converter's modify_tensors / generate_extra_tensors give."""
    names = gguf.get_tensor_name_map(_model_arch(arch), hp["num_hidden_layers"])
    heads, kv_heads = hp["num_attention_heads"], hp["num_key_value_heads"]
    pairs = _merged_experts(tensors).items()
    if arch in ("llama4", "gpt-oss"):
        pairs = [pair for hf_name, array in pairs for pair in _split_experts(arch, hf_name, array)]
    for hf_name, array in pairs:
        if hf_name == "lm_head.weight" and hp.get("tie_word_embeddings"):
            continue
        # (Glm4MoeModel.modify_tensors renames the correction bias for the name map.)
        name = names.get_name(hf_name.replace("e_score_correction_bias", "e_score_correction.bias"),
                              try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name} in a {arch} file")
        if arch in _PERMUTED and hf_name.endswith("q_proj.weight"):
            array = _permute(array, heads)
        elif arch in _PERMUTED and hf_name.endswith("k_proj.weight"):
            array = _permute(array, kv_heads)
        if arch in _GEMMAS and hf_name.endswith("norm.weight"):
            array = array + 1
        if arch == "deepseek2" and split_kv_b and hf_name.endswith("kv_b_proj.weight"):
            # DeepseekV2Model.modify_tensors: each head's key rows transposed, its value rows as they are.
            kv_b = array.reshape(heads, hp["qk_nope_head_dim"] + hp["v_head_dim"], -1)
            yield name.replace("attn_kv_b", "attn_k_b"), np.swapaxes(kv_b[:, : hp["qk_nope_head_dim"]], 1, 2)
            yield name.replace("attn_kv_b", "attn_v_b"), kv_b[:, hp["qk_nope_head_dim"]:]
            continue
        yield name, array
    rope, _ = _rope_params(hp)
    if arch == "phi3" and rope.get("long_factor"):
        yield "rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32)
        yield "rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32)
    if arch == "llama" and rope.get("rope_type") == "llama3":
        yield "rope_freqs.weight", _llama3_divisors(rope, _head_dim(hp))


def _model_arch(arch: str) -> gguf.MODEL_ARCH:
    """The gguf package's enum member for llama.cpp's architecture name."""
    return next(member for member, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)


def _merged_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer's per-expert matrices stacked into one ``[E, ...]`` tensor named as the
    converter names it (``...experts.gate_proj.weight``, Mixtral's ``...experts.w1.weight``)."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name, array in tensors.items():
        match = _EXPERT_RE.fullmatch(name)
        if match is None:
            out[name] = array
        else:
            stacks.setdefault(f"{match.group(1)}.{match.group(3)}.weight", {})[int(match.group(2))] = array
    for name, parts in stacks.items():
        out[name] = np.stack([parts[e] for e in range(len(parts))])
    return out


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rotate-half pairs -> interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _llama3_divisors(rope: dict[str, Any], dim: int) -> np.ndarray:
    """Per-frequency divisors of Llama 3's RoPE, as LlamaModel.generate_extra_tensors computes them."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def _write_tokenizer(w: gguf.GGUFWriter, hf_dir: Path, vocab_size: int) -> None:
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    vocab.update(special)
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [
        gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED
        for i, t in enumerate(tokens)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    settings = json.loads((hf_dir / "tokenizer_config.json").read_text())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[settings["bos_token"]])
    w.add_eos_token_id(vocab[settings["eos_token"]])
