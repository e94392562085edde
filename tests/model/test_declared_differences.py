"""Every declared difference of Gemma 1, Granite, SmolLM3 and Llama 4 from Llama is exercised: with it set back to
Llama's, the tiny checkpoint's logits leave HF's (which they match with it, 1e-4); and their
configs are read as HF reads them (defaults, legacy names, options raylm refuses by name)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import torch

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.generate import SingleSequenceGenerator
from raylm.model.decoder.params import ModelParams
from raylm.model.errors import UnsupportedModelError
from raylm.model.loaders.load import load_checkpoint
from tests.checkpoints import build_tiny_checkpoint

PROMPT = np.random.RandomState(0).randint(3, 320, size=20).tolist()


def _llama_norms(config: ModelConfig, params: ModelParams) -> tuple[ModelConfig, ModelParams]:
    """RMSNorm weights read as Llama's ``w`` instead of Gemma's ``1 + w``."""
    norms = ("attn_norm", "mlp_norm")
    layers = tuple(dataclasses.replace(lp, **{n: getattr(lp, n) - 1 for n in norms}) for lp in params.layers)
    return config, dataclasses.replace(params, layers=layers, final_norm=params.final_norm - 1)


def _config_field(**llama: object):
    return lambda config, params: (dataclasses.replace(config, **llama), params)


# family -> its declared differences, each as (config, params) -> the same with Llama's behaviour.
DIFFERENCES = {
    "gemma": {
        "norm_plus_one": _llama_norms,
        "sqrt_hidden_embed_scale": _config_field(embed_scale=None),
        "geglu": _config_field(activation="silu"),
    },
    "granite": {
        "embedding_multiplier": _config_field(embedding_multiplier=None),
        "residual_multiplier": _config_field(residual_multiplier=None),
        "attention_multiplier": _config_field(query_scale=None),
        "logits_scaling": _config_field(logits_divisor=None),
    },
    "smollm3": {"nope_layers": _config_field(nope_layers=())},
    "llama4": {
        "nope_layers": _config_field(nope_layers=()),
        "chunked_attention": _config_field(layer_chunks=()),
        "l2_qk_norm": _config_field(l2_qk_norm=False),
        "attn_temperature_tuning": _config_field(attn_temperature=None),
        "sigmoid_scaled_expert_input": lambda config, params: (
            dataclasses.replace(config, moe=dataclasses.replace(config.moe, sigmoid_scales_input=False)), params),
    },
}
CASES = [(family, name) for family, names in DIFFERENCES.items() for name in names]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """family -> (config, params, HF's logits over PROMPT), each built once."""

    @functools.cache
    def load(family: str):
        path, hf_model = build_tiny_checkpoint(family, tmp_path_factory.mktemp(family) / "m")
        with torch.no_grad():
            reference = hf_model(torch.tensor([PROMPT])).logits[0].numpy()
        return (*load_checkpoint(path), reference)

    return load


@pytest.mark.parametrize("family, difference", CASES)
def test_setting_a_difference_back_to_llamas_moves_the_logits(loaded, family, difference):
    config, params, reference = loaded(family)
    ours = SingleSequenceGenerator(config, params).prompt_logits(PROMPT)
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=1e-4)
    llama_config, llama_params = DIFFERENCES[family][difference](config, params)
    moved = SingleSequenceGenerator(llama_config, llama_params).prompt_logits(PROMPT)
    assert np.abs(moved - reference).max() > 1e-2, f"{family}'s {difference} does not change the logits"


def _gemma(**extra) -> dict:
    return {"architectures": ["GemmaForCausalLM"], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, **extra}


def _granite(**extra) -> dict:
    return {**_gemma(), "architectures": ["GraniteForCausalLM"], **extra}


def test_gemma_config_reads_as_hf_gemma():
    config = ModelConfig.from_hf_dict(_gemma(hidden_act="gelu", hidden_activation="silu"))
    # GemmaConfig turns the legacy "gelu" into the tanh approximation; GemmaMLP reads hidden_act only.
    assert config.activation == "gelu_tanh" and config.tie_word_embeddings
    assert config.embed_scale == 8.0 and config.query_scale is None and not config.sandwich_norms
    assert ModelConfig.from_hf_dict(_gemma()).activation == "gelu_tanh"  # GemmaConfig's default
    with pytest.raises(UnsupportedModelError, match="final_logit_softcapping"):
        ModelConfig.from_hf_dict(_gemma(final_logit_softcapping=30.0))


def test_granite_config_reads_as_hf_granite():
    config = ModelConfig.from_hf_dict(_granite())  # every multiplier 1.0, attention's too (not 1/sqrt(head_dim))
    assert (config.embedding_multiplier, config.residual_multiplier, config.query_scale,
            config.logits_divisor) == (1.0, 1.0, 1.0, 1.0)
    assert config.activation == "silu" and not config.tie_word_embeddings and config.embed_scale is None
    for option in ("attention_bias", "mlp_bias"):
        with pytest.raises(UnsupportedModelError, match=option):
            ModelConfig.from_hf_dict(_granite(**{option: True}))


def test_llama4_config_reads_as_hf_llama4():
    raw = {**_gemma(), "architectures": ["Llama4ForCausalLM"], "num_hidden_layers": 8, "intermediate_size": 32,
           "intermediate_size_mlp": 96, "num_local_experts": 4, "interleave_moe_layer_step": 2}
    config = ModelConfig.from_hf_dict(raw)  # HF's defaults: a NoPE full-attention layer in four, chunks of 8192
    assert config.nope_layers == (False, False, False, True) * 2
    assert config.layer_chunks == (8192, 8192, 8192, None) * 2 and not config.layer_windows
    assert config.l2_qk_norm and config.attn_temperature == (8192.0, 0.1) and config.activation == "silu"
    assert config.moe.sparse_layers == (False, True) * 4 and config.intermediate_size == 96
    assert (config.moe.expert_size, config.moe.shared_expert_size, config.moe.top_k) == (32, 32, 1)
    assert config.moe.sigmoid_scales_input and not config.moe.shared_expert_gated
    with pytest.raises(UnsupportedModelError, match="attention_chunk_size"):
        ModelConfig.from_hf_dict({**raw, "attention_chunk_size": None})
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        ModelConfig.from_hf_dict({**raw, "layer_types": ["sliding_attention"] * 8})
