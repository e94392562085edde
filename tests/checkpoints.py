"""Tiny random HF checkpoints the tests write themselves (no hub downloads).

Each builder saves a randomly initialised transformers model plus a small byte-level BPE
``tokenizer.json``, and returns the directory; the same torch model is the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TINY_VOCAB = 320

TINY_BASE: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    # Larger than HF's 0.02 default so logits are O(1-10) and a wrong weight cannot hide.
    initializer_range=0.2,
)

# name -> (config class, extra config kwargs)
TINY_VARIANTS: dict[str, tuple[type, dict[str, Any]]] = {
    "llama-gqa": (transformers.LlamaConfig, dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "llama-tied": (transformers.LlamaConfig, dict(rope_theta=10000.0, tie_word_embeddings=True)),
    "llama3-rope": (
        transformers.LlamaConfig,
        dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama-linear-rope": (
        transformers.LlamaConfig, dict(rope_theta=10000.0, rope_scaling=dict(rope_type="linear", factor=2.0))
    ),
    "mistral": (transformers.MistralConfig, dict(rope_theta=1e6, sliding_window=None, head_dim=32)),
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1e6, tie_word_embeddings=True)),
    "llama-yarn": (
        transformers.LlamaConfig,
        dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                  original_max_position_embeddings=128)),
    ),
    # head_dim independent of hidden / heads, q/k norms.
    "qwen3": (transformers.Qwen3Config, dict(head_dim=32, tie_word_embeddings=True)),
    # A 16-token window on every layer: the test prompts and generations run past it.
    "mistral-sliding": (transformers.MistralConfig, dict(head_dim=16, sliding_window=16)),
    # Soft-caps small enough to bite on random weights; query_pre_attn_scalar != head_dim;
    # sliding layers 0 and 2.
    "gemma2": (
        transformers.Gemma2Config,
        dict(head_dim=32, query_pre_attn_scalar=24, sliding_window=16, attn_logit_softcapping=5.0,
             final_logit_softcapping=8.0),
    ),
    # q/k norms, sliding layers with their own RoPE base, linear-scaled RoPE on the global one.
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(head_dim=32, sliding_window=16, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             rope_parameters=dict(sliding_attention=dict(rope_type="default", rope_theta=10000.0),
                                  full_attention=dict(rope_type="linear", rope_theta=1e6, factor=2.0))),
    ),
    # Gemma 1: 1 + w norms, sqrt(hidden) embeddings, GeGLU, tied embeddings, head_dim
    # independent of hidden / heads.
    "gemma": (transformers.GemmaConfig, dict(head_dim=32)),
    # Granite: every multiplier away from 1 (and the attention one from 1/sqrt(head_dim)).
    "granite": (
        transformers.GraniteConfig,
        dict(embedding_multiplier=4.0, residual_multiplier=0.5, attention_multiplier=0.5, logits_scaling=2.5),
    ),
    # Fused qkv / gate_up in the checkpoint, a 24-token window on every layer, LongRoPE within
    # its original context (short factors, as HF uses them for every sequence that fits).
    "phi3": (
        transformers.Phi3Config,
        dict(pad_token_id=0, eos_token_id=2, sliding_window=24, original_max_position_embeddings=1024,
             rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                  short_factor=[1.0 + 0.1 * i for i in range(8)],
                                  long_factor=[1.5 + 0.5 * i for i in range(8)])),
    ),
    # Fused qkv / gate_up in the checkpoint; LongRoPE with its long factors (the served context,
    # 512, exceeds the original 32, and the test prompts are longer than 32).
    "phi3-longrope": (
        transformers.Phi3Config,
        dict(pad_token_id=0, eos_token_id=2, original_max_position_embeddings=32,
             rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                  short_factor=[1.0 + 0.1 * i for i in range(8)],
                                  long_factor=[1.5 + 0.5 * i for i in range(8)])),
    ),
    # RoPE on the first half of each head only (partial_rotary_factor, read for every family; HF's
    # Phi-3 implements it).
    "phi3-partial-rotary": (
        transformers.Phi3Config,
        dict(pad_token_id=0, eos_token_id=2,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
    ),
    # Mixtures of experts (model/decoder/moe.py): 4-8 small experts, top-2. Mixtral renormalizes the
    # top-2; Qwen3-MoE too (norm_topk_prob) with a dense layer among the sparse ones
    # (mlp_only_layers); OLMoE does not renormalize and norms its whole q / k projections;
    # Qwen2-MoE has a gated shared expert, q/k/v biases and experts on every other layer only.
    "mixtral": (
        transformers.MixtralConfig,
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64, rope_theta=1e6),
    ),
    "qwen3-moe": (
        transformers.Qwen3MoeConfig,
        dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
             mlp_only_layers=[1]),
    ),
    "olmoe": (transformers.OlmoeConfig, dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32)),
    "qwen2-moe": (
        transformers.Qwen2MoeConfig,
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
             decoder_sparse_step=2),
    ),
    # GLM-4.5 (DeepSeek-V3's routing): sigmoid scores with a non-zero correction bias (set by
    # build_tiny_checkpoint), top-3 of the best 2 of 4 groups of 2 experts, renormalized and
    # scaled by 1.7; two shared experts' worth of an ungated MLP; layer 0 dense; RoPE on half of
    # each head; q/k/v biases and per-head q/k norms.
    "glm4-moe": (
        transformers.Glm4MoeConfig,
        dict(head_dim=32, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, n_shared_experts=2,
             n_group=4, topk_group=2, routed_scaling_factor=1.7, norm_topk_prob=True, first_k_dense_replace=1,
             attention_bias=True, use_qk_norm=True,
             rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)),
    ),
    # SmolLM3: a Llama whose second layer rotates nothing (NoPE every 2nd layer; 4th in the release).
    "smollm3": (transformers.SmolLM3Config, dict(no_rope_layer_interval=2, no_rope_layers=None, pad_token_id=0)),
    # Llama 4 text: three chunked RoPE layers (16-token chunks) with q/k L2 norms, a NoPE
    # full-attention layer with temperature tuning that bites within the prompts (floor_scale 8),
    # sigmoid top-1 experts with a shared expert on layers 1 and 3, wider dense MLPs on 0 and 2.
    "llama4": (
        transformers.Llama4TextConfig,
        dict(num_hidden_layers=4, head_dim=16, intermediate_size=32, intermediate_size_mlp=128, num_local_experts=4,
             num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=16, no_rope_layers=[1, 1, 1, 0],
             floor_scale=8, attn_scale=0.5, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    ),
    # gpt-oss: attention sinks; q/k/v/o, router and expert biases; experts with gate/up interleaved
    # and a SwiGLU clamped at a limit small enough to bite on random weights; sliding layers 0 and
    # 2 (a 16-token window); YaRN without truncation; head_dim 64, as the released models.
    "gpt-oss": (
        transformers.GptOssConfig,
        dict(head_dim=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
             swiglu_limit=1.5,
             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=128,
                                  beta_fast=32.0, beta_slow=1.0, truncate=False)),
    ),
    # DeepSeek's multi-head latent attention, with experts after a dense layer 0. V2-Lite's shape:
    # a full-rank q_proj, complex-pair RoPE, value heads narrower than the query/key heads; softmax
    # greedy top-2 of 4 experts, not renormalized, two shared experts' worth of an ungated MLP.
    "deepseek-v2-lite": (
        transformers.DeepseekV2Config,
        dict(num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=12, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=2,
             topk_method="greedy", moe_intermediate_size=32),
    ),
    # V3's shape: a low-rank query (q_a_proj, its norm, q_b_proj), interleaved rotary pairs, YaRN
    # whose mscale_all_dim scales the softmax (and mscale != mscale_all_dim the cos/sin); sigmoid
    # scores with the correction bias (set by build_tiny_checkpoint), top-3 of the best 2 of 4
    # groups of 2 experts, renormalized and scaled by 2.5, one shared expert.
    "deepseek-v3": (
        transformers.DeepseekV3Config,
        dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=16, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
             topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1,
             moe_intermediate_size=32, rope_interleave=True,
             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                                  original_max_position_embeddings=128, beta_fast=32.0, beta_slow=1.0)),
    ),
}

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "def main():\n    print('hello, world')\n",
    "Paris is the capital of France; Berlin is the capital of Germany.",
]


def tiny_tokenizer(vocab_size: int = TINY_VOCAB) -> Tokenizer:
    """A byte-level BPE trained on a few sentences, with <unk>/<s>/</s> at ids 0/1/2."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer)
    return tokenizer


def build_tiny_checkpoint(variant: str, directory: Path, seed: int = 0, **overrides: Any) -> tuple[Path, Any]:
    """Write ``variant`` as an HF checkpoint into ``directory``; return (dir, torch model)."""
    config_cls, extra = TINY_VARIANTS[variant]
    config = config_cls(**{**TINY_BASE, **extra, **overrides})
    torch.manual_seed(seed)
    model_cls = {
        transformers.LlamaConfig: transformers.LlamaForCausalLM,
        transformers.MistralConfig: transformers.MistralForCausalLM,
        transformers.Qwen2Config: transformers.Qwen2ForCausalLM,
        transformers.Qwen3Config: transformers.Qwen3ForCausalLM,
        transformers.GemmaConfig: transformers.GemmaForCausalLM,
        transformers.Gemma2Config: transformers.Gemma2ForCausalLM,
        transformers.Gemma3TextConfig: transformers.Gemma3ForCausalLM,
        transformers.Phi3Config: transformers.Phi3ForCausalLM,
        transformers.GraniteConfig: transformers.GraniteForCausalLM,
        transformers.MixtralConfig: transformers.MixtralForCausalLM,
        transformers.Qwen2MoeConfig: transformers.Qwen2MoeForCausalLM,
        transformers.Qwen3MoeConfig: transformers.Qwen3MoeForCausalLM,
        transformers.OlmoeConfig: transformers.OlmoeForCausalLM,
        transformers.Glm4MoeConfig: transformers.Glm4MoeForCausalLM,
        transformers.Llama4TextConfig: transformers.Llama4ForCausalLM,
        transformers.SmolLM3Config: transformers.SmolLM3ForCausalLM,
        transformers.GptOssConfig: transformers.GptOssForCausalLM,
        transformers.DeepseekV2Config: transformers.DeepseekV2ForCausalLM,
        transformers.DeepseekV3Config: transformers.DeepseekV3ForCausalLM,
    }[config_cls]
    config._attn_implementation = "eager"  # soft-capping and windows as the modeling code writes them
    model = model_cls(config).eval().to(torch.float32)
    # Random init leaves norms at 1 and biases (gpt-oss's experts' too) at 0; perturb them, and
    # gpt-oss's attention sinks, so loading errors show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", ".bias", "_bias", ".sinks")):
                param.add_(0.1 * torch.randn_like(param))
        for name, buffer in model.named_buffers():  # DeepSeek-style routers' bias: big enough to change choices
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tiny_tokenizer(config.vocab_size).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text('{"bos_token": "<s>", "eos_token": "</s>"}')
    return directory, model
