"""Llama 4 text's attention and experts, read from config.json as HF's Llama4TextConfig does.

HF (transformers/models/llama4/modeling_llama4.py) differs from Llama in:

- NoPE layers: ``no_rope_layers[i] == 0`` rotates nothing on layer ``i`` (default: every
  ``no_rope_layer_interval``-th layer);
- chunked local attention on the layers ``layer_types`` marks ``chunked_attention`` (by default
  the RoPE layers): a query sees only the keys of its own ``attention_chunk_size`` chunk of
  positions, up to itself;
- ``use_qk_norm``: the RoPE layers' queries and keys RMS-normalized per head, without a weight,
  after RoPE;
- ``attn_temperature_tuning``: the NoPE layers' queries times
  ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` at position ``p``;
- experts on the ``moe_layers`` (default every ``interleave_moe_layer_step``-th layer): the
  top-k router logits through a sigmoid scale each chosen expert's *input*, an ungated shared
  expert of the experts' size is added; dense layers' MLPs are ``intermediate_size_mlp`` wide.

The checkpoint's q/k rows rotate as adjacent pairs (HF applies RoPE as complex numbers); the
loader reorders them into rotate-half halves (model/loaders/llama4_tensors.py), which leaves
q.k unchanged.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from raylm.model.config.moe import MoeConfig
from raylm.model.config.nope_layers import GGUF_NOPE_INTERVAL, every_nth_nope, nope_layers_from_hf
from raylm.model.errors import ModelLoadError, UnsupportedModelError

_LAYER_TYPES = ("full_attention", "chunked_attention")


class AttnTemperature(NamedTuple):
    """Llama 4's query scale on NoPE layers: ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``."""

    floor_scale: float
    attn_scale: float


class Llama4Attention(NamedTuple):
    """What ``ModelConfig`` keeps of a Llama 4 config's attention (defaults: Llama's)."""

    nope_layers: tuple[bool, ...] = ()  # per layer: no RoPE
    layer_chunks: tuple[int | None, ...] = ()  # per layer: its attention chunk, None for full attention
    l2_qk_norm: bool = False  # the RoPE layers' q and k RMS-normalized (no weight) after RoPE
    temperature: AttnTemperature | None = None  # on the NoPE layers


def llama4_attention(raw: Mapping[str, Any], num_layers: int, source: str) -> Llama4Attention:
    """The attention differences as HF's Llama4TextConfig derives them."""
    uses_rope = [not nope for nope in nope_layers_from_hf(raw, num_layers, source)]
    types = list(raw.get("layer_types") or ["chunked_attention" if r else "full_attention" for r in uses_rope])
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown or len(types) != num_layers:
        raise UnsupportedModelError(f"layer_types in {source}: {types} (raylm implements {', '.join(_LAYER_TYPES)}, "
                                    f"one per layer)")
    chunk = raw.get("attention_chunk_size", 8192)
    if chunk is None or int(chunk) < 1:  # (HF's mask builder refuses it too)
        raise UnsupportedModelError(f"attention_chunk_size={chunk} in {source}: Llama 4 needs a chunk size")
    temperature = None
    if raw.get("attn_temperature_tuning", True):
        temperature = AttnTemperature(float(raw.get("floor_scale", 8192)), float(raw.get("attn_scale", 0.1)))
    return Llama4Attention(
        nope_layers=tuple(not r for r in uses_rope),
        layer_chunks=tuple(int(chunk) if t == "chunked_attention" else None for t in types),
        l2_qk_norm=bool(raw.get("use_qk_norm", True)),
        temperature=temperature,
    )


def llama4_moe(raw: Mapping[str, Any], num_layers: int, source: str) -> MoeConfig | None:
    """The experts as HF's Llama4TextMoe runs them (None: no layer has them)."""
    try:
        experts, size = int(raw["num_local_experts"]), int(raw["intermediate_size"])
    except KeyError as missing:
        raise ModelLoadError(f"{source} lacks required key {missing}") from None
    step = int(raw.get("interleave_moe_layer_step", 1))
    layers = raw.get("moe_layers")
    layers = set(range(step - 1, num_layers, step) if layers is None else layers)
    return _experts(experts, int(raw.get("num_experts_per_tok", 1)), size, layers, num_layers)


def _experts(experts: int, top_k: int, size: int, layers: set[int], num_layers: int) -> MoeConfig | None:
    if not layers & set(range(num_layers)):
        return None
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        expert_size=size,
        norm_topk_prob=False,
        sparse_layers=tuple(i in layers for i in range(num_layers)),
        shared_expert_size=size,
        sigmoid_scales_input=True,
        shared_expert_gated=False,
    )


# What llama.cpp's llama4 architecture fixes rather than reads (src/llama-model.cpp): 8192-token
# chunks on three layers in four, the fourth without RoPE and with temperature tuning (floor
# 8192, scale 0.1); q/k L2 norms except on the 128-expert model (Maverick).
_GGUF_CHUNK, _GGUF_TEMPERATURE, _GGUF_NO_QK_NORM_EXPERTS = 8192, AttnTemperature(8192.0, 0.1), 128


def llama4_from_gguf(meta: Any, num_layers: int) -> tuple[Llama4Attention, MoeConfig | None]:
    """The attention differences and experts of a llama.cpp ``llama4`` file (``meta``: a
    ``gguf_metadata.GgufMetadata``), as llama.cpp runs that architecture: the converter writes
    only ``interleave_moe_layer_step`` and the experts' counts and size."""
    if meta.has("attention.sliding_window"):
        raise meta.refuse("attention.sliding_window", "(a llama4 file without chunked attention) is not implemented")
    nope = every_nth_nope(num_layers, GGUF_NOPE_INTERVAL)
    experts = int(meta.get("expert_count", required=True))
    attention = Llama4Attention(
        nope_layers=nope,
        layer_chunks=tuple(None if n else _GGUF_CHUNK for n in nope),
        l2_qk_norm=experts != _GGUF_NO_QK_NORM_EXPERTS,
        temperature=_GGUF_TEMPERATURE,
    )
    step = int(meta.get("interleave_moe_layer_step", required=True))
    top_k = int(meta.get("expert_used_count", required=True))
    size = int(meta.get("expert_feed_forward_length", required=True))
    sparse = set(range(step - 1, num_layers, step)) if step > 0 else set()  # (llama.cpp: 0 is no experts)
    return attention, _experts(experts, top_k, size, sparse, num_layers)
