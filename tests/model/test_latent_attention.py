"""DeepSeek's multi-head latent attention (model/decoder/latent_attention.py) beyond the logits
match with HF (tests/model/test_model_vs_hf.py): the pool holds the latent only, the absorbed
form (one query per row) equals the expanded form (prompt chunks), every declared difference
(attention and experts) moves the logits, and what is not implemented is refused."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raylm.cache.kv_budget import bytes_per_block
from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.flop_count import ModelFlops
from raylm.model.decoder.forward import forward
from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.decoder.kv_pool import KVCache
from raylm.model.errors import UnsupportedModelError
from raylm.model.kernels import paged_decode
from raylm.model.kernels.int8_matmul import unavailable_reason
from raylm.model.loaders.load import load_checkpoint
from raylm.model.quantization.activations import with_int8_activations
from raylm.model.quantization.int8_panels import Int8Panels
from raylm.model.quantization.quant_array import QuantArray, parse_quantization, quantize_params
from raylm.model.runtime.sharding import make_mesh, param_shardings
from raylm.workers.core.lora_adapters import LoraAdapters
from tests.checkpoints import build_tiny_checkpoint

BLOCK = 16


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    path, _ = build_tiny_checkpoint("deepseek-v3", tmp_path_factory.mktemp("dsv3") / "m")
    return load_checkpoint(path)


def _v3_config(**overrides) -> ModelConfig:
    """DeepSeek-V3's own attention sizes (num_hidden_layers cut to 2, all dense)."""
    raw = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168, intermediate_size=18432,
               num_hidden_layers=2, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
               kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
               first_k_dense_replace=2, n_routed_experts=256, rope_theta=10000.0)
    return ModelConfig.from_hf_dict({**raw, **overrides})


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pool_holds_one_latent_per_token_and_layer(dtype):
    config = _v3_config()
    info = KVCache.abstract(config, num_blocks=1, block_size=1, dtype=dtype, num_layers=1)
    assert info.shape == (1, 1, 1, 1, 576) and info.latent
    assert info.nbytes == 576 * jnp.dtype(dtype).itemsize  # kv_lora_rank + qk_rope_head_dim, stored once
    assert bytes_per_block(config, BLOCK, dtype) == 2 * BLOCK * 576 * jnp.dtype(dtype).itemsize
    pool = KVCache.create(config, num_blocks=3, block_size=BLOCK, dtype=dtype)
    assert pool.v is None and pool.k.shape == (2, 3, BLOCK, 1, 576) and pool.k.dtype == dtype


def test_tensor_parallel_splits_the_heads_and_replicates_the_latent(deepseek_v3):
    config, params = deepseek_v3
    mesh = make_mesh(2)
    layer = param_shardings(params, config, mesh).layers[0]
    specs = {name: tuple(getattr(layer, name).spec) for name in ("wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm",
                                                                  "wkv_b", "wo")}
    assert specs == {"wq_a": (None, None), "q_a_norm": (None,), "wq_b": ("tp", None, None), "wkv_a": (None, None),
                     "kv_a_norm": (None,), "wkv_b": ("tp", None, None), "wo": (None, "tp", None)}
    pool = KVCache.abstract(config, 4, BLOCK, jnp.float32).shardings(config, mesh)
    assert all(axis is None for axis in pool.spec)


def test_config_reads_the_experts_as_hf_does():
    """DeepSeek-V3's own routing (HF's config defaults: sigmoid + noaux_tc with the correction bias,
    8 groups of which 4, renormalized, scaled by 2.5, one shared expert) from layer
    first_k_dense_replace on; V2's softmax, greedy or group-limited by each group's best score, never
    renormalized; all-dense configs (first_k_dense_replace >= the layer count) have no experts."""
    moe = _v3_config(first_k_dense_replace=1, num_experts_per_tok=8, moe_intermediate_size=2048).moe
    assert (moe.num_experts, moe.top_k, moe.expert_size, moe.shared_expert_size) == (256, 8, 2048, 2048)
    assert moe.sparse_layers == (False, True) and moe.norm_topk_prob and not moe.shared_expert_gated
    routing = moe.deepseek
    assert (routing.scoring, routing.score_correction, routing.num_groups, routing.groups_used,
            routing.group_score, routing.scaling_factor) == ("sigmoid", True, 8, 4, "top2_sum", 2.5)
    v2 = _v3_config(architectures=["DeepseekV2ForCausalLM"], first_k_dense_replace=0, num_experts_per_tok=6,
                    n_routed_experts=160, moe_intermediate_size=1536, topk_method="group_limited_greedy",
                    n_group=8, topk_group=3, routed_scaling_factor=16.0).moe
    assert v2.sparse_layers == (True, True) and not v2.norm_topk_prob and v2.shared_expert_size == 2 * 1536
    assert (v2.deepseek.scoring, v2.deepseek.score_correction, v2.deepseek.num_groups, v2.deepseek.groups_used,
            v2.deepseek.group_score, v2.deepseek.scaling_factor) == ("softmax", False, 8, 3, "max", 16.0)
    assert _v3_config().moe is None


@pytest.mark.parametrize("key,value", [("scoring_func", "softmax"), ("topk_method", "greedy"), ("moe_layer_freq", 2),
                                       ("n_group", 7)])
def test_routing_hf_does_not_read_is_refused_naming_the_key(key, value):
    with pytest.raises(UnsupportedModelError, match=key):
        _v3_config(first_k_dense_replace=1, num_experts_per_tok=8, moe_intermediate_size=2048, **{key: value})


def test_flops_count_the_absorbed_attention(deepseek_v3):
    """Per key and layer: scores over the 32 + 8 latent dims and values of its 32, for 4 heads."""
    config, params = deepseek_v3
    assert ModelFlops.of(config, params).attention == ((None, 3 * (2 * 4 * (32 + 8) + 2 * 4 * 32)),)


def test_int8_weights_and_activations(deepseek_v3):
    """Weight-only int8 and the integer compute mode: kv_b_proj, contracted per head by the
    absorbed form, stays an int8 QuantArray (dequantized there); the projections run in integers."""
    if unavailable_reason() is not None:
        pytest.skip(unavailable_reason())
    config, params = deepseek_v3
    weights = quantize_params(params, parse_quantization("int8"))
    packed = with_int8_activations(weights, "deepseek-v3")
    assert isinstance(packed.layers[0].wkv_b, QuantArray) and isinstance(packed.layers[0].wkv_a, Int8Panels)
    ids = np.random.RandomState(5).randint(3, 320, size=20).tolist()
    reference = SingleSequenceGenerator(config, params).prompt_logits(ids)
    # (int8 moves these tiny random models' logits by 5-10% on average, as Llama's; a token whose
    # experts it changes moves further, so the mean is bounded rather than the largest.)
    for quantized in (weights, packed):
        logits = SingleSequenceGenerator(config, quantized).prompt_logits(ids)
        assert np.abs(logits - reference).mean() < 0.1 * np.abs(reference).mean()


def test_lora_is_refused():
    with pytest.raises(UnsupportedModelError, match="enable_lora"):
        LoraAdapters(_v3_config(), max_rank=8, max_cpu_loras=2)


def _logits(config, params, tokens, start, kv, cpu_kernels=False):
    """All logits of ``tokens`` at positions ``start..``, one forward call, blocks 1.. as the table."""
    n = len(tokens)
    table = jnp.arange(1, kv.k.shape[1], dtype=jnp.int32)[None]
    positions = jnp.arange(start, start + n, dtype=jnp.int32)[None]
    run = jax.jit(forward, static_argnames=("config", "all_logits", "cpu_kernels"))
    logits, kv = run(params, config, jnp.asarray([tokens], jnp.int32), positions, kv, table,
                     jnp.array([start + n], jnp.int32), all_logits=True, cpu_kernels=cpu_kernels)
    return np.asarray(logits[0]), kv


@pytest.mark.parametrize("cpu_kernels", [False, True])
def test_absorbed_decode_equals_expanded_prompt(deepseek_v3, cpu_kernels):
    """Tokens 20..39 one at a time (the absorbed form; the paged kernel reading the latent pool as
    keys and values with ``cpu_kernels``) after a 20-token chunk, against all 40 as one chunk (the
    expanded form), on the latents each wrote into the pool."""
    if cpu_kernels and not paged_decode.available():
        pytest.skip("the C++ paged kernel is not built")
    config, params = deepseek_v3
    tokens = np.random.RandomState(3).randint(3, 320, size=40).tolist()
    expanded, _ = _logits(config, params, tokens, 0, KVCache.create(config, 5, BLOCK, jnp.float32))
    _, kv = _logits(config, params, tokens[:20], 0, KVCache.create(config, 5, BLOCK, jnp.float32))
    absorbed = []
    for p in range(20, 40):
        step, kv = _logits(config, params, tokens[p:p + 1], p, kv, cpu_kernels)
        absorbed.append(step[0])
    np.testing.assert_allclose(np.stack(absorbed), expanded[20:], atol=1e-4, rtol=1e-4)


def _mla(**changes):
    return lambda config, params: (dataclasses.replace(config, mla=dataclasses.replace(config.mla, **changes)), params)


def _moe(**changes):
    return lambda config, params: (dataclasses.replace(config, moe=dataclasses.replace(config.moe, **changes)), params)


def _routing(**changes):
    def flip(config, params):
        routing = dataclasses.replace(config.moe.deepseek, **changes)
        return dataclasses.replace(config, moe=dataclasses.replace(config.moe, deepseek=routing)), params
    return flip


def _without_q_lora(config, params):
    """Full-rank queries ``q_b_proj . q_a_proj`` (no q_a_layernorm between them)."""
    layers = tuple(dataclasses.replace(lp, wq=jnp.einsum("hkr,rd->hkd", lp.wq_b, lp.wq_a), wq_a=None, wq_b=None,
                                       q_a_norm=None) for lp in params.layers)
    return _mla(q_lora_rank=None)(config, params)[0], dataclasses.replace(params, layers=layers)


def _unit_latent_norm(config, params):
    return config, dataclasses.replace(params, layers=tuple(
        dataclasses.replace(lp, kv_a_norm=jnp.ones_like(lp.kv_a_norm)) for lp in params.layers))


def _without_shared_experts(config, params):
    layers = tuple(dataclasses.replace(lp, w_shared_gate_up=None, w_shared_down=None) for lp in params.layers)
    return _moe(shared_expert_size=0)(config, params)[0], dataclasses.replace(params, layers=layers)


def _without_dense_first_layer(config, params):
    """Layer 0 sparse like the others, with layer 1's router and experts."""
    sparse = params.layers[1]
    experts = ("router", "router_score_bias", "w_experts_gate_up", "w_experts_down", "w_shared_gate_up",
               "w_shared_down")
    first = dataclasses.replace(params.layers[0], w_gate_up=None, w_down=None,
                                **{name: getattr(sparse, name) for name in experts})
    config = _moe(sparse_layers=(True,) * config.num_layers)(config, params)[0]
    return config, dataclasses.replace(params, layers=(first, *params.layers[1:]))


# Each declared difference of the tiny V3 set back to Llama's (or the plain TopKRouter's).
FLIPS = {
    "rope_interleave": _mla(rope_interleave=False),
    "mscale_all_dim softmax scale": lambda c, p: (dataclasses.replace(c, query_scale=c.mla.qk_head_dim**-0.5), p),
    "yarn (mscale / mscale_all_dim cos/sin)": lambda c, p: (dataclasses.replace(c, rope_scaling=None), p),
    "q_lora_rank": _without_q_lora,
    "latent norm weight": _unit_latent_norm,
    # The experts' routing (V3: sigmoid, noaux_tc), shared experts and dense first layer.
    "TopKRouter routing": _moe(deepseek=None),
    "softmax scores": _routing(scoring="softmax"),
    "no correction bias": _routing(score_correction=False),
    "no groups": _routing(num_groups=1, groups_used=1),
    "groups by their best score": _routing(group_score="max"),
    "routed_scaling_factor": _routing(scaling_factor=1.0),
    "norm_topk_prob": _moe(norm_topk_prob=False),
    "n_shared_experts": _without_shared_experts,
    "first_k_dense_replace": _without_dense_first_layer,
}


@pytest.fixture(scope="module")
def v3_logits(deepseek_v3):
    ids = np.random.RandomState(4).randint(3, 320, size=24).tolist()
    return ids, SingleSequenceGenerator(*deepseek_v3).prompt_logits(ids)


@pytest.mark.parametrize("flip", list(FLIPS))
def test_each_declared_difference_moves_the_logits(deepseek_v3, v3_logits, flip):
    ids, base = v3_logits
    moved = SingleSequenceGenerator(*FLIPS[flip](*deepseek_v3)).prompt_logits(ids)
    assert np.abs(moved - base).max() > 1e-2
