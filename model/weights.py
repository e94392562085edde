"""Turn a checkpoint's per-layer HF-named tensors into the stacked ``ModelParams`` pytree.

Every format loader (safetensors, GGUF) only has to answer "give me the tensor HF calls
``name``, as a float numpy array in HF's ``[out, in]`` layout"; naming, orientation,
stacking, shape checks and the dtype cast live here once.
"""

from __future__ import annotations

from typing import Callable

import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.errors import ModelLoadError
from model.params import LayerParams, ModelParams, expected_layer_shapes

# Answers an HF tensor name with its array, or None if the checkpoint lacks it.
TensorSource = Callable[[str], "np.ndarray | None"]


def _hf_layer_tensors(config: ModelConfig) -> dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]]:
    """Param field -> (HF tensor name pattern, converter from HF layout to ours)."""
    H, KVH, Dh, D = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size

    def split_out(heads: int) -> Callable[[np.ndarray], np.ndarray]:
        return lambda w: w.T.reshape(D, heads, Dh)  # [heads*Dh, D] -> [D, heads, Dh]

    def split_bias(heads: int) -> Callable[[np.ndarray], np.ndarray]:
        return lambda b: b.reshape(heads, Dh)

    prefix = "model.layers.{i}."
    fields = {
        "attn_norm": ("input_layernorm.weight", lambda w: w),
        "wq": ("self_attn.q_proj.weight", split_out(H)),
        "wk": ("self_attn.k_proj.weight", split_out(KVH)),
        "wv": ("self_attn.v_proj.weight", split_out(KVH)),
        "wo": ("self_attn.o_proj.weight", lambda w: w.T.reshape(H, Dh, D)),
        "mlp_norm": ("post_attention_layernorm.weight", lambda w: w),
        "w_gate": ("mlp.gate_proj.weight", lambda w: w.T),
        "w_up": ("mlp.up_proj.weight", lambda w: w.T),
        "w_down": ("mlp.down_proj.weight", lambda w: w.T),
    }
    if config.attention_bias:
        fields.update(
            bq=("self_attn.q_proj.bias", split_bias(H)),
            bk=("self_attn.k_proj.bias", split_bias(KVH)),
            bv=("self_attn.v_proj.bias", split_bias(KVH)),
        )
    return {k: (prefix + name, conv) for k, (name, conv) in fields.items()}


def _hf_shape(field: str, config: ModelConfig) -> tuple[int, ...]:
    """Shape HF stores for one layer's tensor (to report mismatches in the file's own terms)."""
    H, KVH, Dh, D, I = (
        config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size, config.intermediate_size,
    )
    return {
        "attn_norm": (D,), "mlp_norm": (D,),
        "wq": (H * Dh, D), "wk": (KVH * Dh, D), "wv": (KVH * Dh, D), "wo": (D, H * Dh),
        "w_gate": (I, D), "w_up": (I, D), "w_down": (D, I),
        "bq": (H * Dh,), "bk": (KVH * Dh,), "bv": (KVH * Dh,),
    }[field]


def build_params(config: ModelConfig, get: TensorSource, source: str, dtype: jnp.dtype) -> ModelParams:
    """Assemble and validate ``ModelParams`` from HF-named tensors, cast to ``dtype``."""

    def fetch(name: str, shape: tuple[int, ...]) -> np.ndarray:
        array = get(name)
        if array is None:
            raise ModelLoadError(f"{source}: tensor {name!r} is missing (expected shape {shape})")
        if tuple(array.shape) != shape:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has shape {tuple(array.shape)}, expected {shape}"
            )
        return array

    layer_shapes = expected_layer_shapes(config)
    stacked: dict[str, jnp.ndarray] = {}
    for field, (pattern, convert) in _hf_layer_tensors(config).items():
        out = np.empty(layer_shapes[field], dtype=np.float32)
        for i in range(config.num_layers):
            name = pattern.format(i=i)
            out[i] = convert(fetch(name, _hf_shape(field, config)).astype(np.float32, copy=False))
        stacked[field] = jnp.asarray(out, dtype=dtype)
        del out

    V, D = config.vocab_size, config.hidden_size
    embed = fetch("model.embed_tokens.weight", (V, D))
    lm_head = None
    if not config.tie_word_embeddings:
        lm_head = jnp.asarray(fetch("lm_head.weight", (V, D)).T, dtype=dtype)
    return ModelParams(
        embed=jnp.asarray(embed, dtype=dtype),
        layers=LayerParams(**stacked),
        final_norm=jnp.asarray(fetch("model.norm.weight", (D,)), dtype=dtype),
        lm_head=lm_head,
    )
