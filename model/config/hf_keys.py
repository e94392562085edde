"""How an HF ``config.json``'s keys read into ``ModelConfig`` (model/config/model_config.py): the
options HF implements and raylm refuses, RoPE parameters (transformers 5's ``rope_parameters`` or
the older keys), per-layer sliding windows, the attention scale and the MLP activation. Split
from ``ModelConfig.from_hf_dict`` so that it reads as the list of fields it fills.
"""

from __future__ import annotations

from typing import Any, Mapping

from raylm.model.config.families import ACTIVATIONS, Family
from raylm.model.config.latent_attention import LatentAttention, softmax_scale
from raylm.model.config.multipliers import Multipliers
from raylm.model.config.rope import RopeScaling
from raylm.model.errors import ModelLoadError, UnsupportedModelError

_LAYER_TYPES = {"full_attention": False, "sliding_attention": True}


def refuse_unimplemented(raw: Mapping[str, Any], family: Family, source: str) -> None:
    """Options HF implements for these architectures and raylm does not: load errors."""
    if raw.get("attention_bias") and not (family.attention_bias or family.reads_attention_bias):
        raise UnsupportedModelError(
            f"attention_bias=true in {source}: raylm implements q/k/v biases (Qwen2, GLM-4.5) and o_proj's "
            "(gpt-oss) only"
        )
    if raw.get("mlp_bias"):
        raise UnsupportedModelError(f"mlp_bias=true in {source} is not supported")
    if raw.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"clip_qkv={raw['clip_qkv']} in {source}: raylm does not clamp q/k/v")
    if raw.get("use_bidirectional_attention"):
        raise UnsupportedModelError(f"use_bidirectional_attention=true in {source}: raylm serves causal decoders")
    if not family.logit_softcaps:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if raw.get(key) is not None:
                raise UnsupportedModelError(f"{key} in {source} is read only for Gemma 2 and 3")


def query_scale(
    raw: Mapping[str, Any], family: Family, mla: LatentAttention | None, rope_scaling: RopeScaling | None,
    scales: Multipliers,
) -> float | None:
    """Attention scores' scale where it is not ``head_dim ** -0.5``: Gemma 2/3's
    query_pre_attn_scalar, MLA's (model/config/latent_attention.py), Granite's multiplier."""
    if mla is not None:
        return softmax_scale(mla, rope_scaling)
    if family.query_pre_attn_scalar:
        return float(raw.get("query_pre_attn_scalar", 256)) ** -0.5
    return scales.attention


def rope_parameters(raw: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(global RoPE dict, sliding layers' own or None), from ``rope_parameters`` (transformers
    5, possibly per layer type) or the older ``rope_theta`` / ``rope_scaling`` /
    ``rope_local_base_freq`` keys."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {}) or None
    merged = dict(raw.get("rope_scaling") or params or {})
    if "rope_theta" in raw:
        merged.setdefault("rope_theta", raw["rope_theta"])
    local = {"rope_theta": raw["rope_local_base_freq"]} if "rope_local_base_freq" in raw else None
    return merged, local


def local_rope_theta(local: Mapping[str, Any] | None, source: str) -> float | None:
    if local is None:
        return None
    if (local.get("rope_type") or "default") != "default":
        raise UnsupportedModelError(
            f"sliding layers' RoPE type {local.get('rope_type')!r} in {source}: raylm scales global layers' RoPE only"
        )
    return float(local.get("rope_theta", 10000.0))


def layer_windows(raw: Mapping[str, Any], family: Family, layers: int, source: str) -> tuple[int | None, ...]:
    """Each layer's sliding window as HF applies it, or () when no layer slides."""
    if family.llama4:  # its layer_types say chunked or full attention (model/config/llama4.py)
        return ()
    window = raw.get("sliding_window")
    if family.window_on_all_layers:
        kinds = [window is not None] * layers
    elif raw.get("layer_types") is not None:
        types = list(raw["layer_types"])
        unknown = sorted(set(types) - set(_LAYER_TYPES))
        if unknown:
            raise UnsupportedModelError(
                f"layer_types in {source}: {', '.join(unknown)} not supported (raylm implements "
                f"{', '.join(_LAYER_TYPES)})"
            )
        if len(types) != layers:
            raise ModelLoadError(f"layer_types in {source} lists {len(types)} layers, the model has {layers}")
        kinds = [_LAYER_TYPES[t] for t in types]
    elif raw.get("use_sliding_window") and window is not None:  # Qwen2/3 configs before layer_types
        first = int(raw.get("max_window_layers", layers))
        kinds = [i >= first for i in range(layers)]
    elif family.sliding_pattern and window is not None:  # Gemma configs before layer_types
        pattern = int(raw.get("sliding_window_pattern") or family.sliding_pattern)
        kinds = [(i + 1) % pattern != 0 for i in range(layers)]
    else:
        kinds = [False] * layers
    if window is None or not any(kinds) or raw.get("use_sliding_window") is False:
        return ()  # (use_sliding_window false: Qwen2/3 and SmolLM3 then ignore sliding_window, as HF)
    if int(window) < 1:
        raise UnsupportedModelError(f"sliding_window={window} in {source}: it must be at least 1")
    return tuple(int(window) if sliding else None for sliding in kinds)


def activation(name: str, source: str) -> str:
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"MLP activation {name!r} in {source}: raylm supports {', '.join(ACTIVATIONS)}"
        )
    return ACTIVATIONS[name]
