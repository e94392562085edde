"""Load a llama.cpp GGUF file: metadata -> ModelConfig, tensors -> ModelParams.

Every tensor type the ``gguf`` package can dequantize is accepted. With ``keep_blocks``,
block-quantized matrices (Q4_0 .. Q8_0, the K-quants, IQ4) stay in their blocks (model/quantization/gguf_blocks.py: the same float32
numbers from a sixth of the bytes); everything else is dequantized to float32 here.
llama.cpp's converter permutes the Q/K projection rows of llama-arch models (and Granite's,
a LlamaModel subclass there) for its interleaved RoPE; we undo that here so the same
rotate-half RoPE serves HF and GGUF checkpoints. Tensor names are llama.cpp's (gguf.constants.TENSOR_NAMES), mapped to HF's
per architecture; Gemma's norms are stored as ``1 + w`` already, so they load as they are.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.params import ModelParams
from raylm.model.errors import UnsupportedModelError
from raylm.model.loaders.gguf_file import GGUFFile
from raylm.model.loaders.gguf_gpt_oss import gpt_oss_experts
from raylm.model.loaders.hf_tensors import PrepareLayer, build_params
from raylm.model.quantization.gguf_blocks import GgufBlocks, map_rows

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Sparse layers: the router, the experts stacked [E, ...] (kept whole as the file stores
    # them), Qwen2-MoE's shared expert and its gate.
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",  # DeepSeek-style routing's correction bias
}
# What an architecture names differently (None: the file has no such tensor). Gemma's HF
# "post_attention" norm follows attention (llama.cpp's post_attention_norm) and its norm
# before the MLP is "pre_feedforward" (llama.cpp's ffn_norm). Phi-3 keeps HF's fused Q/K/V
# as attn_qkv and gate/up (gate first) as ffn_up.
_GEMMA_NAMES = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_ARCH_LAYER_NAMES: dict[str, dict[str, str | None]] = {
    "glm4moe": {"post_attention_layernorm.weight": "post_attention_norm.weight"},  # (before the MLP)
    "gemma2": _GEMMA_NAMES,
    "gemma3": _GEMMA_NAMES,
    "phi3": {
        "self_attn.qkv_proj.weight": "attn_qkv.weight",
        "mlp.gate_up_proj.weight": "ffn_up.weight",
        "mlp.up_proj.weight": None,
    },
    # DeepSeek's latent attention. Newer converters split kv_b_proj into attn_k_b (each head's
    # key part, transposed) and attn_v_b: ``_joined_kv_b`` puts them back together.
    "deepseek2": {
        "self_attn.q_a_proj.weight": "attn_q_a.weight",
        "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
        "self_attn.q_b_proj.weight": "attn_q_b.weight",
        "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
        "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
        "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    },
}
_ARCH_LAYER_NAMES["gpt-oss"] = {  # (its experts: model/loaders/gguf_gpt_oss.py)
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Architectures whose Q/K rows rotate as interleaved pairs in the file: permuted by llama.cpp's
# converter (its LlamaModel and subclasses), or so in the checkpoint already (Llama 4's, which
# that converter leaves as they are).
PERMUTED_QK_ARCHES = ("llama", "granite", "smollm3", "llama4")


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str | None:
    """The GGUF name of the tensor HF calls ``hf_name`` in a file of llama.cpp architecture
    ``arch`` (None if GGUF has no equivalent)."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER_RE.fullmatch(hf_name)
    if match is None:
        return None
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    name = names.get(match.group(2))
    return None if name is None else f"blk.{match.group(1)}.{name}"


def _prediction_layer(name: str, decoder_layers: int, blocks: int) -> bool:
    """Whether tensor ``name`` belongs to a multi-token-prediction layer, a block the file counts
    after the decoder's (GLM-4.5's nextn layers: llama.cpp skips them too)."""
    match = re.fullmatch(r"blk\.(\d+)\..+", name)
    return match is not None and decoder_layers <= int(match.group(1)) < blocks


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's ``permute`` of Q/K rows (interleaved pairs -> rotate-half halves)."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _joined_kv_b(file: GGUFFile, kv_b_name: str) -> np.ndarray | None:
    """HF's ``kv_b_proj`` ``[H * (nope + v), kv_lora_rank]`` from a file that holds it split, as
    llama.cpp's converter splits it: ``attn_k_b`` ``[H, kv_lora_rank, nope]`` (each head's key
    rows, transposed) and ``attn_v_b`` ``[H, v, kv_lora_rank]``; dequantized (transposing
    blocks is no rearrangement of whole rows)."""
    k_b = file.tensor(kv_b_name.replace("attn_kv_b", "attn_k_b"), False)
    v_b = file.tensor(kv_b_name.replace("attn_kv_b", "attn_v_b"), False)
    if k_b is None or v_b is None:
        return None
    heads, rank, _ = k_b.shape
    return np.concatenate([np.swapaxes(k_b, 1, 2), v_b], axis=1).reshape(-1, rank)


def load_gguf_checkpoint(
    path: str | Path | GGUFFile, dtype: jnp.dtype = jnp.float32, keep_blocks: bool = False,
    layers: range | None = None, mesh: Mesh | None = None,
    prepare_layer: PrepareLayer | None = None,
) -> tuple[ModelConfig, ModelParams]:
    """Read config and weights of a GGUF file (a path or an open one) of an architecture in
    ``SUPPORTED_GGUF_ARCHITECTURES``: dequantized, or with ``keep_blocks`` (float32 models
    only) its block-quantized matrices as stored. A tensor the file holds and the model
    does not read is a load error (it belongs to a variant raylm does not implement).
    ``layers``: a pipeline stage's alone (``build_params``; only their tensors are read, so the
    unread-tensor check is the whole model's loader's). ``mesh``, ``prepare_layer``: ``build_params``'s."""
    file = path if isinstance(path, GGUFFile) else GGUFFile(path)
    config = file.config()
    permuted = config.architecture in PERMUTED_QK_ARCHES

    def get(hf_name: str) -> np.ndarray | GgufBlocks | None:
        if config.architecture == "gpt-oss":
            experts = gpt_oss_experts(hf_name, lambda name: file.tensor(name, keep_blocks))
            if experts is not False:
                return experts
        name = gguf_tensor_name(hf_name, config.architecture)
        array = None if name is None else file.tensor(name, keep_blocks)
        if array is None and config.mla is not None and hf_name.endswith("self_attn.kv_b_proj.weight"):
            array = _joined_kv_b(file, name)
        if array is not None and permuted:
            if hf_name.endswith("q_proj.weight"):
                array = map_rows(lambda a: unpermute_qk(a, config.num_heads), array)
            elif hf_name.endswith("k_proj.weight"):
                array = map_rows(lambda a: unpermute_qk(a, config.num_kv_heads), array)
        return array

    params = build_params(config, get, str(file.path), dtype, layers=layers, mesh=mesh,
                          prepare_layer=prepare_layer)
    if layers is not None:
        return config, params
    blocks = int(file.fields[f"{config.architecture}.block_count"])
    unread = sorted(name for name in set(file.tensor_names) - file.read
                    if not _prediction_layer(name, config.num_layers, blocks))
    if unread:
        raise UnsupportedModelError(
            f"{file.path}: tensors raylm does not use for a {config.architecture} model: {', '.join(unread[:8])}"
            + (f" and {len(unread) - 8} more" if len(unread) > 8 else "")
        )
    return config, params
