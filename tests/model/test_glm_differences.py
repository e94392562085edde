"""Every declared difference of the tiny GLM-4.5 (tests/checkpoints.py "glm4-moe") is exercised:
setting each back to Llama's, or to the plain TopKRouter's routing, moves the logits. (The
logits with all of them are HF's: tests/model/test_model_vs_hf.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.loaders.load import load_checkpoint, load_model
from raylm.model.quantization.quant_array import QuantArray
from tests.checkpoints import build_tiny_checkpoint


def _routing(**changes):
    def flip(config, params):
        moe = config.moe
        return dataclasses.replace(config, moe=dataclasses.replace(
            moe, deepseek=dataclasses.replace(moe.deepseek, **changes))), params
    return flip


def _moe(**changes):
    def flip(config, params):
        return dataclasses.replace(config, moe=dataclasses.replace(config.moe, **changes)), params
    return flip


def _without(config_changes, *fields):
    def flip(config, params):
        layers = tuple(dataclasses.replace(lp, **{f: None for f in fields}) for lp in params.layers)
        return dataclasses.replace(config, **config_changes), dataclasses.replace(params, layers=layers)
    return flip


def _no_shared_experts(config, params):
    config, params = _without({}, "w_shared_gate_up", "w_shared_down")(config, params)
    return _moe(shared_expert_size=0)(config, params)


def _no_dense_layer(config, params):
    """Layer 0 sparse like the others, with layer 1's router and experts."""
    moe = config.moe
    sparse = params.layers[1]
    first = dataclasses.replace(sparse, attn_norm=params.layers[0].attn_norm, wqkv=params.layers[0].wqkv,
                                wo=params.layers[0].wo, mlp_norm=params.layers[0].mlp_norm,
                                bqkv=params.layers[0].bqkv, q_norm=params.layers[0].q_norm,
                                k_norm=params.layers[0].k_norm)
    config = dataclasses.replace(config, moe=dataclasses.replace(moe, sparse_layers=(True,) * config.num_layers))
    return config, dataclasses.replace(params, layers=(first, *params.layers[1:]))


FLIPS = {
    "whole-head rotary": lambda c, p: (dataclasses.replace(c, rotary_dim=None), p),
    "no q/k/v biases": _without({"attention_bias": False}, "bqkv"),
    "no q/k norms": _without({"qk_norm": False}, "q_norm", "k_norm"),
    "TopKRouter routing": _moe(deepseek=None),
    "softmax scores": _routing(scoring="softmax"),
    "no correction bias": _routing(score_correction=False),
    "no groups": _routing(num_groups=1, groups_used=1),
    "groups by their best score": _routing(group_score="max"),
    "no scaling factor": _routing(scaling_factor=1.0),
    "no renormalizing": _moe(norm_topk_prob=False),
    "no shared experts": _no_shared_experts,
    "no dense first layer": _no_dense_layer,
}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return build_tiny_checkpoint("glm4-moe", tmp_path_factory.mktemp("glm") / "m")[0]


@pytest.fixture(scope="module")
def glm(path):
    config, params = load_checkpoint(path)
    ids = np.random.RandomState(0).randint(3, 320, size=24).tolist()
    return config, params, ids, SingleSequenceGenerator(config, params).prompt_logits(ids)


@pytest.mark.parametrize("flip", sorted(FLIPS))
def test_each_difference_moves_the_logits(glm, flip):
    config, params, ids, logits = glm
    flipped = SingleSequenceGenerator(*FLIPS[flip](config, params)).prompt_logits(ids)
    assert np.abs(flipped - logits).max() > 1e-2


def test_router_and_correction_bias_stay_unquantized(path):
    """They pick the experts: int8 weights leave them as loaded, a bfloat16 model keeps the bias
    float32 (as HF does)."""
    layer = load_model(path, quantization="int8").params.layers[1]
    assert isinstance(layer.w_experts_gate_up, QuantArray) and isinstance(layer.w_shared_gate_up, QuantArray)
    assert not isinstance(layer.router, QuantArray) and layer.router_score_bias.dtype == np.float32
    assert load_checkpoint(path, "bfloat16")[1].layers[1].router_score_bias.dtype == np.float32
