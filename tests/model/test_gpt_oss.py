"""gpt-oss's declared differences from Llama, each shown to be read: set back to Llama's, the
logits move. (Its logits and greedy tokens against HF are tests/model/test_model_vs_hf.py's
"gpt-oss" variant; through the engine, tests/workers/test_model_families_engine.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from raylm.model.config.expert_mlp import ClampedSwiglu
from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.decoder.params import ModelParams
from raylm.model.errors import UnsupportedModelError
from raylm.model.loaders.load import load_checkpoint
from tests.checkpoints import build_tiny_checkpoint

PROMPT = np.random.RandomState(5).randint(3, 320, size=40).tolist()  # past the 16-token window


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """The tiny gpt-oss checkpoint's config, params, and its prompt logits."""
    path, _ = build_tiny_checkpoint("gpt-oss", tmp_path_factory.mktemp("gpt-oss") / "m")
    config, params = load_checkpoint(path)
    return config, params, SingleSequenceGenerator(config, params).prompt_logits(PROMPT)


def _without(params: ModelParams, *fields: str) -> ModelParams:
    """``params`` with each layer's ``fields`` dropped (the decoder then skips them, as for Llama)."""
    layers = tuple(dataclasses.replace(lp, **dict.fromkeys(fields)) for lp in params.layers)
    return dataclasses.replace(params, layers=layers)


def _moe(config: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(config, moe=dataclasses.replace(config.moe, **changes))


def _rope(config: ModelConfig, **changes) -> ModelConfig:
    return dataclasses.replace(config, rope_scaling=dataclasses.replace(config.rope_scaling, **changes))


# difference -> (config, params) with it set back to Llama's (or Mixtral's, for the experts).
LLAMA_LIKE = {
    "attention_sinks": lambda c, p: (dataclasses.replace(c, attention_sinks=False), _without(p, "sinks")),
    "o_proj_bias": lambda c, p: (dataclasses.replace(c, o_proj_bias=False), _without(p, "bo")),
    "qkv_bias": lambda c, p: (dataclasses.replace(c, attention_bias=False), _without(p, "bqkv")),
    "router_bias": lambda c, p: (_moe(c, router_bias=False), _without(p, "router_bias")),
    "expert_gate_up_bias": lambda c, p: (c, _without(p, "b_experts_gate_up")),
    "expert_down_bias": lambda c, p: (c, _without(p, "b_experts_down")),
    "clamped_swiglu": lambda c, p: (_moe(c, clamped_swiglu=None), p),
    "swiglu_limit": lambda c, p: (_moe(c, clamped_swiglu=ClampedSwiglu(1e9, c.moe.clamped_swiglu.alpha)), p),
    "softmax_over_top_k": lambda c, p: (_moe(c, norm_topk_prob=False), p),
    "sliding_layers": lambda c, p: (dataclasses.replace(c, layer_windows=()), p),
    "yarn_rope": lambda c, p: (dataclasses.replace(c, rope_scaling=None), p),
    # ... and YaRN's details as gpt-oss sets them: no truncation, the default attention factor.
    "yarn_truncate": lambda c, p: (_rope(c, truncate=True), p),
    "yarn_attention_factor": lambda c, p: (_rope(c, attention_factor=1.0), p),
}


@pytest.mark.parametrize("difference", sorted(LLAMA_LIKE))
def test_each_difference_moves_the_logits(gpt_oss, difference):
    config, params, logits = gpt_oss
    changed = SingleSequenceGenerator(*LLAMA_LIKE[difference](config, params)).prompt_logits(PROMPT)
    assert np.abs(changed - logits).max() > 1e-2, difference


def test_config_reads_the_differences(gpt_oss):
    config, params, _ = gpt_oss
    assert config.attention_sinks and config.o_proj_bias and config.attention_bias
    assert config.layer_windows == (16, None, 16) and config.rope_scaling.rope_type == "yarn"
    assert not config.rope_scaling.truncate
    moe = config.moe
    assert (moe.num_experts, moe.top_k, moe.expert_size, moe.norm_topk_prob) == (4, 2, 32, True)
    assert moe.router_bias and moe.expert_bias and (moe.clamped_swiglu.limit, moe.clamped_swiglu.alpha) == (1.5, 1.702)
    layer = params.layers[0]
    assert layer.sinks.shape == (4,) and layer.bo.shape == (64,) and layer.router_bias.shape == (4,)
    assert layer.b_experts_gate_up.shape == (4, 2, 32) and layer.b_experts_down.shape == (4, 64)


def _raw(**changes) -> dict:
    raw = dict(architectures=["GptOssForCausalLM"], vocab_size=320, hidden_size=64, intermediate_size=32,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_local_experts=4, num_experts_per_tok=2, sliding_window=8)
    return {**raw, **changes}


def test_config_defaults_follow_hf():
    """Without layer_types even layers slide (HF's default); attention_bias=false drops all four
    biases; the clamped SwiGLU takes HF's defaults."""
    config = ModelConfig.from_hf_dict(_raw(num_hidden_layers=4))
    assert config.layer_windows == (8, None, 8, None)
    assert config.moe.clamped_swiglu.limit == 7.0 and config.moe.clamped_swiglu.alpha == 1.702
    off = ModelConfig.from_hf_dict(_raw(attention_bias=False))
    assert not off.attention_bias and not off.o_proj_bias
    with pytest.raises(UnsupportedModelError, match="swiglu_limit"):
        ModelConfig.from_hf_dict(_raw(swiglu_limit=0))


def test_release_config_parses():
    """openai/gpt-oss-20b's config.json as released (older rope_scaling / rope_theta keys, the
    MXFP4 quantization_config beside): every difference read as HF reads it."""
    raw = dict(
        architectures=["GptOssForCausalLM"], attention_bias=True, attention_dropout=0.0, eos_token_id=200002,
        experts_per_token=4, head_dim=64, hidden_act="silu", hidden_size=2880, initial_context_length=4096,
        initializer_range=0.02, intermediate_size=2880, layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072, model_type="gpt_oss", num_attention_heads=64, num_experts_per_tok=4,
        num_hidden_layers=24, num_key_value_heads=8, num_local_experts=32, output_router_logits=False,
        pad_token_id=199999, rms_norm_eps=1e-05,
        quantization_config=dict(modules_to_not_convert=["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                         "model.embed_tokens", "lm_head"], quant_method="mxfp4"),
        rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=32.0, original_max_position_embeddings=4096,
                          rope_type="yarn", truncate=False),
        rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False,
        use_cache=True, vocab_size=201088)
    config = ModelConfig.from_hf_dict(raw)
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.rope_theta) == (64, 8, 64, 150000.0)
    assert config.layer_windows == (128, None) * 12 and config.attention_sinks and config.o_proj_bias
    scaling = config.rope_scaling
    assert (scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings, scaling.truncate) == (
        "yarn", 32.0, 4096, False)
    assert (config.moe.num_experts, config.moe.top_k, config.moe.expert_size) == (32, 4, 2880)
    assert config.moe.clamped_swiglu == ClampedSwiglu(7.0, 1.702)
