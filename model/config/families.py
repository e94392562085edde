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
    # ... and with ``attention_bias`` the output projection too (gpt-oss).
    o_proj_bias: bool = False
    # A learned logit per query head joins each query's softmax denominator, with no value
    # (gpt-oss's ``sinks``: a head may attend to nothing).
    attention_sinks: bool = False
    qk_norm: bool = False  # RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3)
    # ... over the whole query and key projections instead, all heads at once (OLMoE).
    qk_norm_whole: bool = False
    # RMSNorm weights stored as ``w`` for a norm that multiplies by ``1 + w`` (Gemma 1, 2, 3).
    norm_plus_one: bool = False
    # Input embeddings times sqrt(hidden_size), rounded in the model dtype (Gemma 1, 2, 3).
    sqrt_hidden_embed_scale: bool = False
    # Norms also after attention and after the MLP, before each residual add (Gemma 2, 3).
    sandwich_norms: bool = False
    # Attention scaled by ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5`` (Gemma 2, 3).
    query_pre_attn_scalar: bool = False
    # Reads ``attn_logit_softcapping`` / ``final_logit_softcapping`` (Gemma 2, 3).
    logit_softcaps: bool = False
    # Granite's embedding, residual, attention and logit multipliers (model/config/multipliers.py).
    granite_multipliers: bool = False
    tied_by_default: bool = False  # tie_word_embeddings when config.json omits it
    default_act: str = "silu"
    # The config.json keys naming the MLP activation, first present wins (Gemma 1's modeling
    # code reads ``hidden_act`` only, Gemma 2 and 3 ``hidden_activation``).
    activation_keys: tuple[str, ...] = ("hidden_activation", "hidden_act")
    # ``gelu`` means the tanh approximation (Gemma 1's legacy configs: GemmaConfig rewrites it).
    gelu_is_tanh: bool = False
    # Sliding window from config.json's ``sliding_window`` on every layer (Mistral, Phi-3);
    # otherwise only the layers ``layer_types`` marks sliding.
    window_on_all_layers: bool = False
    # Configs without ``layer_types``: every this-many-th layer is global, the rest slide
    # (Gemma 2: 2, Gemma 3: 6, overridden by ``sliding_window_pattern``); 0: none slide.
    sliding_pattern: int = 0
    # Sparse layers: a mixture of experts in place of the MLP (model/config/moe.py).
    moe: MoeKeys | None = None
    # config.json's ``attention_bias`` switches q/k/v biases on (o_proj has none; GLM-4.5).
    reads_attention_bias: bool = False
    qk_norm_key: str | None = None  # config.json's switch for per-head q/k norms (GLM-4.5: use_qk_norm)
    # Llama 4 text: NoPE and chunked-attention layers, q/k L2 norm, attention temperature and its
    # experts (model/config/llama4.py); dense MLPs ``intermediate_size_mlp`` wide.
    llama4: bool = False
    # NoPE layers from ``no_rope_layers`` / ``no_rope_layer_interval`` (SmolLM3;
    # model/config/nope_layers.py), otherwise a Llama.
    nope_layers: bool = False
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
    # DeepSeek-style routing, shared experts and leading dense layers, as this HF family reads
    # them (a key of model/config/deepseek_routing.HF_ROUTERS).
    deepseek: str | None = None
    # gpt-oss's experts (model/config/expert_mlp.py): a router bias, biased gate/up and down,
    # gate and up interleaved, and a clamped SwiGLU (swiglu_limit, swiglu_alpha).
    gpt_oss_experts: bool = False


# What Gemma 2 and 3 share.
_GEMMA_2_AND_3 = dict(
    norm_plus_one=True, sqrt_hidden_embed_scale=True, sandwich_norms=True, query_pre_attn_scalar=True,
    logit_softcaps=True, tied_by_default=True, default_act="gelu_pytorch_tanh", activation_keys=("hidden_activation",),
)
HF_FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(window_on_all_layers=True),
    "Qwen2ForCausalLM": Family(attention_bias=True),
    "Qwen3ForCausalLM": Family(qk_norm=True),
    "GemmaForCausalLM": Family(
        norm_plus_one=True, sqrt_hidden_embed_scale=True, tied_by_default=True, default_act="gelu_pytorch_tanh",
        activation_keys=("hidden_act",), gelu_is_tanh=True,
    ),
    "Gemma2ForCausalLM": Family(**_GEMMA_2_AND_3, sliding_pattern=2),
    "Gemma3ForCausalLM": Family(qk_norm=True, **_GEMMA_2_AND_3, sliding_pattern=6),
    "GraniteForCausalLM": Family(granite_multipliers=True),
    "Llama4ForCausalLM": Family(llama4=True),
    "SmolLM3ForCausalLM": Family(nope_layers=True, tied_by_default=True),
    "Phi3ForCausalLM": Family(window_on_all_layers=True),
    "MixtralForCausalLM": Family(
        window_on_all_layers=True, moe=MoeKeys("num_local_experts", "intermediate_size", always_norm_topk=True)
    ),
    "Qwen2MoeForCausalLM": Family(
        attention_bias=True, moe=MoeKeys("num_experts", "moe_intermediate_size", sparse_step=True, shared_expert=True)
    ),
    "Qwen3MoeForCausalLM": Family(qk_norm=True, moe=MoeKeys("num_experts", "moe_intermediate_size", sparse_step=True)),
    "OlmoeForCausalLM": Family(qk_norm=True, qk_norm_whole=True, moe=MoeKeys("num_experts", "intermediate_size")),
    "Glm4MoeForCausalLM": Family(
        reads_attention_bias=True, qk_norm_key="use_qk_norm",
        moe=MoeKeys("n_routed_experts", "moe_intermediate_size", deepseek="glm4_moe"),
    ),
    # Its router's softmax over the top-k logits is the renormalized top-k of the softmax over all.
    "GptOssForCausalLM": Family(
        attention_bias=True, o_proj_bias=True, attention_sinks=True, sliding_pattern=2,
        moe=MoeKeys("num_local_experts", "intermediate_size", always_norm_topk=True, gpt_oss_experts=True),
    ),
    # Latent attention, and from first_k_dense_replace on DeepSeek-style experts: V2 softmax
    # (greedy or group_limited_greedy), V3 sigmoid with the correction bias (noaux_tc).
    "DeepseekV2ForCausalLM": Family(
        latent_attention=True, interleaved_rope=True,
        moe=MoeKeys("n_routed_experts", "moe_intermediate_size", deepseek="deepseek_v2"),
    ),
    "DeepseekV3ForCausalLM": Family(
        latent_attention=True, moe=MoeKeys("n_routed_experts", "moe_intermediate_size", deepseek="deepseek_v3")
    ),
}
# llama.cpp's architecture names -> the HF family they hold (Mistral and Mixtral convert to
# "llama": its experts are in the metadata, model/config/moe.py).
GGUF_FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "glm4moe": "Glm4MoeForCausalLM",
    "granite": "GraniteForCausalLM",
    # DeepSeek V2 and V3 alike (both rotate interleaved pairs in llama.cpp).
    "deepseek2": "DeepseekV2ForCausalLM",
    "llama4": "Llama4ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# HF's names for the same activations.
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
