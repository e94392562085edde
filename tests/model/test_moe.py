"""The mixture-of-experts block against a naive per-token reference, degenerate routings
(every token to the same experts, experts that get no token) against each row alone with
their load counts, padding tokens routed nowhere, and the routing options raylm refuses. (Whole MoE models against HF: tests/model/test_model_vs_hf.py,
their GGUF files: tests/model/test_gguf_families.py, through the engine:
tests/workers/test_model_families_engine.py.)"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import raylm.model.kernels.grouped_matmul as grouped_matmul
from raylm.model.config.model_config import ModelConfig
from raylm.model.config.moe import MoeConfig
from raylm.model.decoder.moe import expert_mlps, moe_block, route
from raylm.model.errors import UnsupportedModelError
from raylm.model.loaders.load import load_model
from raylm.model.quantization.quant_array import quantize
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from tests.checkpoints import build_tiny_checkpoint

E, D, I = 6, 32, 16


def _moe(top_k: int = 2, norm: bool = True) -> MoeConfig:
    return MoeConfig(num_experts=E, top_k=top_k, expert_size=I, norm_topk_prob=norm, sparse_layers=(True,))


def _weights(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.RandomState(seed)
    return (rng.randn(E, D).astype(np.float32), rng.randn(E, 2, I, D).astype(np.float32) * 0.3,
            rng.randn(E, D, I).astype(np.float32) * 0.3)


def _naive(h: np.ndarray, router: np.ndarray, gate_up: np.ndarray, down: np.ndarray, moe: MoeConfig) -> np.ndarray:
    """HF's TopKRouter and a loop over each token's experts, in float64."""
    out = np.zeros(h.shape, np.float64)
    for t, x in enumerate(h.astype(np.float64)):
        logits = router @ x
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        picked = np.argsort(-probs, kind="stable")[: moe.top_k]
        weights = probs[picked] / (probs[picked].sum() if moe.norm_topk_prob else 1.0)
        for e, w in zip(picked, weights):
            g, u = gate_up[e, 0] @ x, gate_up[e, 1] @ x
            out[t] += w * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def _run(h, router, gate_up, down, moe):
    h = jnp.asarray(h)
    return np.asarray(expert_mlps(h, route(h, jnp.asarray(router), moe), jnp.asarray(gate_up), jnp.asarray(down), "silu"))


@pytest.mark.parametrize("top_k,norm", [(2, True), (3, False), (1, False)])
def test_experts_match_naive_reference(top_k, norm):
    router, gate_up, down = _weights()
    h = np.random.RandomState(1).randn(13, D).astype(np.float32)
    moe = _moe(top_k, norm)
    np.testing.assert_allclose(_run(h, router, gate_up, down, moe), _naive(h, router, gate_up, down, moe),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("top_k", [1, 2])
def test_degenerate_routing_equals_each_row_alone(top_k):
    """Positive tokens and router rows of falling multiples of one vector: every token picks
    experts 0 (and 1); the other experts get no row."""
    _, gate_up, down = _weights()
    h = np.abs(np.random.RandomState(2).randn(9, D)).astype(np.float32)
    router = (np.array([3.0, 2.0, -1.0, -1.5, -2.0, -2.5], np.float32)[:, None] * np.ones((1, D), np.float32)) / D
    moe = _moe(top_k)
    routing = route(jnp.asarray(h), jnp.asarray(router), moe)
    assert set(np.asarray(routing.experts).ravel().tolist()) == set(range(top_k))
    batch = _run(h, router, gate_up, down, moe)
    alone = np.concatenate([_run(h[t: t + 1], router, gate_up, down, moe) for t in range(len(h))])
    np.testing.assert_allclose(batch, alone, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(batch, _naive(h, router, gate_up, down, moe), atol=1e-5, rtol=1e-5)


def test_padding_tokens_are_routed_to_no_expert():
    """Tokens marked invalid get zeros and count for no expert; the others are unchanged."""
    router, gate_up, down = _weights()
    h = np.random.RandomState(1).randn(2, 4, D).astype(np.float32)
    valid = np.array([[True, True, False, False], [True, False, False, False]])
    layer = types.SimpleNamespace(router=jnp.asarray(router), w_experts_gate_up=jnp.asarray(gate_up),
                                  w_experts_down=jnp.asarray(down), w_shared_gate_up=None, router_bias=None,
                                  b_experts_gate_up=None, b_experts_down=None)
    out, counts = jax.jit(lambda h, v: moe_block(h, layer, _moe(), "silu", valid=v))(jnp.asarray(h), jnp.asarray(valid))
    out, counts = np.asarray(out), np.asarray(counts)
    np.testing.assert_allclose(out[valid], _naive(h[valid], router, gate_up, down, _moe()), atol=1e-5, rtol=1e-5)
    assert not out[~valid].any()
    picked = np.asarray(route(jnp.asarray(h[valid]), jnp.asarray(router), _moe()).experts).ravel()
    np.testing.assert_array_equal(counts, np.bincount(picked, minlength=E))


def test_engine_batch_routed_to_two_experts_equals_each_row_alone(tmp_path):
    """A zero router routes every token of a tiny Mixtral to experts 0 and 1 (equal
    probabilities, the lowest indices first), so experts 2 and 3 get nothing: a batch of
    prompts through the engine gives the tokens each prompt gets alone."""
    path, _ = build_tiny_checkpoint("mixtral", tmp_path / "m")
    model = load_model(path)
    layers = tuple(dataclasses.replace(lp, router=jnp.zeros_like(lp.router)) for lp in model.params.layers)
    model = dataclasses.replace(model, params=dataclasses.replace(model.params, layers=layers))
    llm = LLM(model, max_model_len=128, num_kv_blocks=64)
    rng = np.random.RandomState(4)
    prompts = [{"prompt_token_ids": rng.randint(3, 320, size=n).tolist()} for n in (3, 20, 37)]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    # The load counts: each prompt token and each fed-back output (all but the last) to experts
    # 0 and 1 in every layer, the padding of the steps' buckets to none.
    computed = sum(len(p["prompt_token_ids"]) for p in prompts) + len(prompts) * (greedy.max_tokens - 1)
    moe = llm.engine.stats().moe
    experts = model.config.moe.num_experts
    assert moe.routed_tokens == ((computed, computed) + (0,) * (experts - 2),) * model.config.num_layers
    alone = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert batch == alone


@pytest.mark.parametrize("scheme", ["int8", "fp8"])
def test_quantized_experts_compute_their_dequantized_weights(scheme):
    """model.quantization: int8 / fp8 quantizes the stacked experts per (expert, output channel);
    the block computes with exactly those weights, on the kernel and on ragged_dot."""
    router, gate_up, down = _weights()
    q_gate_up, q_down = quantize(jnp.asarray(gate_up), scheme), quantize(jnp.asarray(down), scheme)
    assert q_gate_up.scale.shape == (E, 2, I) and q_down.scale.shape == (E, D)
    h = jnp.asarray(np.random.RandomState(1).randn(7, D).astype(np.float32))
    routing = route(h, jnp.asarray(router), _moe())
    reference = _naive(np.asarray(h), router, np.asarray(q_gate_up.dequantize()), np.asarray(q_down.dequantize()), _moe())
    for kernel in (False, True):
        out = jax.jit(lambda h: expert_mlps(h, routing, q_gate_up, q_down, "silu", kernel=kernel))(h)
        np.testing.assert_allclose(np.asarray(out), reference, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not grouped_matmul.available(), reason="the C++ kernels are not built")
def test_grouped_kernel_equals_ragged_dot():
    """Groups of 0 to 9 rows (an empty first and middle group) and padding rows past them."""
    rng = np.random.RandomState(5)
    x = jnp.asarray(rng.randn(24, D).astype(np.float32))
    w = jnp.asarray(rng.randn(5, 2, I, D).astype(np.float32))
    sizes = jnp.asarray([0, 9, 0, 7, 5], jnp.int32)  # 21 of 24 rows
    kernel = jax.jit(lambda x, w, s: grouped_matmul.grouped_matmul(x, w, s, kernel=True))(x, w, sizes)
    reference = grouped_matmul.grouped_matmul(x, w, sizes)
    assert kernel.shape == (24, 2, I)
    np.testing.assert_allclose(np.asarray(kernel), np.asarray(reference), atol=1e-5, rtol=1e-5)
    assert not np.asarray(kernel[21:]).any()


_MIXTRAL = dict(architectures=["MixtralForCausalLM"], vocab_size=320, hidden_size=64, intermediate_size=64,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                num_experts_per_tok=2)


def test_config_reads_each_family_routing():
    mixtral = ModelConfig.from_hf_dict({**_MIXTRAL, "norm_topk_prob": False}).moe
    assert mixtral == MoeConfig(4, 2, 64, True, (True,) * 4)  # Mixtral always renormalizes
    qwen = ModelConfig.from_hf_dict({
        **_MIXTRAL, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "moe_intermediate_size": 32,
        "decoder_sparse_step": 2, "mlp_only_layers": [3],
    })
    assert qwen.moe == MoeConfig(8, 2, 32, False, (False, True, False, False))
    assert qwen.intermediate_size == 64 and qwen.is_sparse(1) and not qwen.is_sparse(3)
    assert qwen.first_layers(2).moe.sparse_layers == (False, True)


@pytest.mark.parametrize("key,value", [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"),
                                       ("routed_scaling_factor", 2.5), ("capacity_factor", 1.25)])
def test_unimplemented_routing_is_a_load_error_naming_it(key, value):
    with pytest.raises(UnsupportedModelError, match=key):
        ModelConfig.from_hf_dict({**_MIXTRAL, key: value})


def test_olmoe_clip_qkv_is_refused():
    raw = {**_MIXTRAL, "architectures": ["OlmoeForCausalLM"], "num_experts": 4, "clip_qkv": 8.0}
    with pytest.raises(UnsupportedModelError, match="clip_qkv"):
        ModelConfig.from_hf_dict(raw)
