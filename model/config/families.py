"""What each supported architecture changes in the one decoder (model/decoder/forward.py).

Families are data, not copies of the forward pass: a ``Family`` declares the differences a
checkpoint's architecture name implies; config.json / GGUF metadata supply the numbers
(windows, soft-caps, scales). ``model.config.model_config`` reads both.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Family:
    """The declared differences of one architecture from Llama."""

    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3)
    # ... over the whole query and key projections instead, all heads at once (OLMoE).
    qk_norm_whole: bool = False
    # Gemma: norms also after attention and after the MLP (before each residual add), RMSNorm
    # weights stored as ``w`` for ``1 + w``, embeddings scaled by sqrt(hidden), attention
    # scaled by ``query_pre_attn_scalar``, GeGLU by default.
    gemma: bool = False
    default_act: str = "silu"
    # Sliding window from config.json's ``sliding_window`` on every layer (Mistral, Phi-3);
    # otherwise only the layers ``layer_types`` marks sliding.
    window_on_all_layers: bool = False
    # Configs without ``layer_types``: every this-many-th layer is global, the rest slide
    # (Gemma 2: 2, Gemma 3: 6, overridden by ``sliding_window_pattern``); 0: none slide.
    sliding_pattern: int = 0
    # Sparse layers: a mixture of experts in place of the MLP (model/config/moe.py).
    moe: MoeKeys | None = None
    # DeepSeek's multi-head latent attention (model/config/latent_attention.py) in place of GQA;
    # ``interleaved_rope``: its rotary dims are always interleaved pairs (V2), else config.json's
    # ``rope_interleave`` says (V3).
    latent_attention: bool = False
    interleaved_rope: bool = False


@dataclasses.dataclass(frozen=True)
class MoeKeys:
    """Where an MoE family's config.json states its experts."""

    count: str  # number of experts
    size: str  # each expert's intermediate size
    sparse_step: bool = False  # reads decoder_sparse_step / mlp_only_layers (Qwen-MoE)
    always_norm_topk: bool = False  # renormalizes the top-k whatever norm_topk_prob says (Mixtral)
    shared_expert: bool = False  # a gated dense MLP beside the experts (Qwen2-MoE)


HF_FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(window_on_all_layers=True),
    "Qwen2ForCausalLM": Family(attention_bias=True),
    "Qwen3ForCausalLM": Family(qk_norm=True),
    "Gemma2ForCausalLM": Family(gemma=True, default_act="gelu_pytorch_tanh", sliding_pattern=2),
    "Gemma3ForCausalLM": Family(qk_norm=True, gemma=True, default_act="gelu_pytorch_tanh", sliding_pattern=6),
    "Phi3ForCausalLM": Family(window_on_all_layers=True),
    "MixtralForCausalLM": Family(
        window_on_all_layers=True, moe=MoeKeys("num_local_experts", "intermediate_size", always_norm_topk=True)
    ),
    "Qwen2MoeForCausalLM": Family(
        attention_bias=True, moe=MoeKeys("num_experts", "moe_intermediate_size", sparse_step=True, shared_expert=True)
    ),
    "Qwen3MoeForCausalLM": Family(qk_norm=True, moe=MoeKeys("num_experts", "moe_intermediate_size", sparse_step=True)),
    "OlmoeForCausalLM": Family(qk_norm=True, qk_norm_whole=True, moe=MoeKeys("num_experts", "intermediate_size")),
    # Dense layers only for now (model/config/latent_attention.py refuses their MoE layers).
    "DeepseekV2ForCausalLM": Family(latent_attention=True, interleaved_rope=True),
    "DeepseekV3ForCausalLM": Family(latent_attention=True),
}
# llama.cpp's architecture names -> the HF family they hold (Mistral and Mixtral convert to
# "llama": its experts are in the metadata, model/config/moe.py).
GGUF_FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    # DeepSeek V2 and V3 alike (both rotate interleaved pairs in llama.cpp).
    "deepseek2": "DeepseekV2ForCausalLM",
}
# HF's names for the same activations.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
