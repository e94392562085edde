"""DeepSeek-style routing (model/config/deepseek_routing.py, model/decoder/deepseek_routing.py)
against HF's own MoE modules on the same random weights: DeepseekV2Moe (greedy and
group-limited), DeepseekV3MoE and Glm4MoeMoE (sigmoid scores, a non-zero correction bias,
groups), each with its shared experts; the chosen experts and their weights, and the block's
output. Random float32 scores leave no ties. Then the configs raylm refuses."""

from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE

from raylm.model.config.families import Family, MoeKeys
from raylm.model.config.model_config import ModelConfig
from raylm.model.config.moe import moe_from_hf
from raylm.model.decoder.deepseek_routing import deepseek_route
from raylm.model.decoder.moe import moe_block
from raylm.model.errors import UnsupportedModelError

D, I, E, T = 32, 16, 16, 24
_BASE = dict(hidden_size=D, moe_intermediate_size=I, n_routed_experts=E, hidden_act="silu", num_hidden_layers=4)
# (HF family, its config and MoE module, config values)
CASES = {
    "v2-greedy": ("deepseek_v2", transformers.DeepseekV2Config, DeepseekV2Moe,
                  dict(num_experts_per_tok=3, topk_method="greedy", n_shared_experts=2, routed_scaling_factor=1.5)),
    "v2-group-limited": ("deepseek_v2", transformers.DeepseekV2Config, DeepseekV2Moe,
                         dict(num_experts_per_tok=3, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              n_shared_experts=1, routed_scaling_factor=2.0)),
    "v3": ("deepseek_v3", transformers.DeepseekV3Config, DeepseekV3MoE,
           dict(num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                norm_topk_prob=True)),
    "v3-one-group-unnormalized": ("deepseek_v3", transformers.DeepseekV3Config, DeepseekV3MoE,
                                  dict(num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=2,
                                       routed_scaling_factor=0.5, norm_topk_prob=False)),
    "glm4-moe": ("glm4_moe", transformers.Glm4MoeConfig, Glm4MoeMoE,
                 dict(num_experts_per_tok=3, n_group=8, topk_group=3, n_shared_experts=1, routed_scaling_factor=1.7,
                      norm_topk_prob=True)),
}


def _hf_block(case: str):
    """(HF's MoE module with random weights, raylm's MoeConfig read from the same config, raylm's layer)."""
    router, config_cls, module_cls, values = CASES[case]
    config = config_cls(**_BASE, **values)
    torch.manual_seed(0)
    module = module_cls(config).eval()
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(0.3 * torch.randn_like(param))
        if hasattr(module.gate, "e_score_correction_bias"):
            module.gate.e_score_correction_bias.copy_(0.2 * torch.randn(E))
    moe = moe_from_hf(config.to_dict(), Family(moe=MoeKeys("n_routed_experts", "moe_intermediate_size",
                                                           deepseek=router)), 4, case)
    bias = getattr(module.gate, "e_score_correction_bias", None)
    shared = module.shared_experts
    layer = types.SimpleNamespace(
        router=jnp.asarray(module.gate.weight.detach().numpy()),
        router_score_bias=None if bias is None else jnp.asarray(bias.numpy()),
        w_experts_gate_up=jnp.asarray(module.experts.gate_up_proj.detach().numpy().reshape(E, 2, I, D)),
        w_experts_down=jnp.asarray(module.experts.down_proj.detach().numpy()),
        w_shared_gate_up=jnp.asarray(np.stack([shared.gate_proj.weight.detach().numpy(),
                                               shared.up_proj.weight.detach().numpy()])),
        w_shared_down=jnp.asarray(shared.down_proj.weight.detach().numpy()),
        shared_gate=None,
        b_experts_gate_up=None,  # (gpt-oss's expert biases: none here)
        b_experts_down=None,
    )
    return module, moe, layer


@pytest.mark.parametrize("case", sorted(CASES))
def test_routing_and_block_equal_hf(case):
    module, moe, layer = _hf_block(case)
    assert moe.sparse_layers == tuple(i >= module.config.first_k_dense_replace for i in range(4))
    assert moe.shared_expert_size == module.config.n_shared_experts * I and not moe.shared_expert_gated
    x = np.random.RandomState(1).randn(1, T, D).astype(np.float32)
    with torch.no_grad():
        _, hf_weights, hf_experts = module.gate(torch.from_numpy(x))
        hf_out = module(torch.from_numpy(x))[0].numpy()
    experts, weights = deepseek_route(jnp.asarray(x[0]), layer.router, layer.router_score_bias, moe)
    # HF's top-k is unsorted: compare each token's experts as a set, the weights in expert order.
    hf_order, our_order = np.argsort(hf_experts.numpy(), -1), np.argsort(np.asarray(experts), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), our_order, -1),
                                  np.take_along_axis(hf_experts.numpy(), hf_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), our_order, -1),
                               np.take_along_axis(hf_weights.numpy(), hf_order, -1), atol=1e-6, rtol=1e-5)
    out, counts = moe_block(jnp.asarray(x), layer, moe, "silu")
    np.testing.assert_allclose(np.asarray(out)[0], hf_out, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(hf_experts.numpy().ravel(), minlength=E))


def test_groups_and_bias_change_the_choice():
    """The cases above would pass with grouping or the bias ignored if they never changed a
    choice: here they do (GLM's case, as HF routes it)."""
    module, moe, layer = _hf_block("glm4-moe")
    x = jnp.asarray(np.random.RandomState(1).randn(T, D).astype(np.float32))
    chosen = np.sort(np.asarray(deepseek_route(x, layer.router, layer.router_score_bias, moe)[0]), -1)
    ungrouped = dataclasses.replace(moe, deepseek=dataclasses.replace(moe.deepseek, num_groups=1, groups_used=1))
    unbiased = np.sort(np.asarray(deepseek_route(x, layer.router, 0 * layer.router_score_bias, moe)[0]), -1)
    assert (np.sort(np.asarray(deepseek_route(x, layer.router, layer.router_score_bias, ungrouped)[0]), -1)
            != chosen).any()
    assert (unbiased != chosen).any()


_GLM = dict(architectures=["Glm4MoeForCausalLM"], vocab_size=320, hidden_size=64, intermediate_size=128,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=32, n_group=2, topk_group=1, first_k_dense_replace=2,
            partial_rotary_factor=0.5)


def test_glm_config_reads_its_differences():
    config = ModelConfig.from_hf_dict({**_GLM, "attention_bias": True, "use_qk_norm": True})
    assert config.rotary_dim == 16 and config.attention_bias and config.qk_norm
    assert config.moe.sparse_layers == (False, False, True, True) and config.moe.shared_expert_size == 32
    assert config.moe.deepseek.scoring == "sigmoid" and config.moe.deepseek.score_correction
    plain = ModelConfig.from_hf_dict({**_GLM, "partial_rotary_factor": 1.0})
    assert plain.rotary_dim is None and not plain.attention_bias and not plain.qk_norm


@pytest.mark.parametrize("key,value", [
    ("scoring_func", "softmax"), ("topk_method", "group_limited_greedy"), ("moe_layer_freq", 2),
    ("n_group", 3), ("topk_group", 4), ("capacity_factor", 1.0), ("partial_rotary_factor", 0.3),
])
def test_unimplemented_glm_options_are_load_errors_naming_them(key, value):
    with pytest.raises(UnsupportedModelError, match=key):
        ModelConfig.from_hf_dict({**_GLM, key: value})


def test_too_few_experts_in_the_chosen_groups_is_refused():
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok=5"):
        ModelConfig.from_hf_dict({**_GLM, "num_experts_per_tok": 5})


def test_deepseek_v2_renormalizing_is_refused():
    """HF's DeepseekV2 ignores norm_topk_prob (DeepSeek's own code does not): neither is chosen silently."""
    family = Family(moe=MoeKeys("n_routed_experts", "moe_intermediate_size", deepseek="deepseek_v2"))
    with pytest.raises(UnsupportedModelError, match="norm_topk_prob"):
        moe_from_hf({**_BASE, "num_experts_per_tok": 2, "norm_topk_prob": True}, family, 4, "config.json")
