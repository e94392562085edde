"""RoPE settings as HF's config.json declares them (``rope_scaling`` / ``rope_parameters``).

Parsed once here; ``model.decoder.layers.rope_inv_freq`` turns them into frequencies. Every kind HF
defines that raylm does not compute is a load error naming it, never a silent default.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from raylm.model.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as HF defines it; which fields count depends on ``rope_type``:
    ``linear`` (factor), ``llama3`` (factor, low/high_freq_factor, original length), ``yarn``
    (factor, beta_fast/slow, truncate, mscale/mscale_all_dim or attention_factor, original
    length) and ``longrope`` (Phi-3's short/long factor per frequency, attention_factor,
    original length)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


def parse_rope_scaling(
    raw: Mapping[str, Any] | None, source: str, max_position_embeddings: int, original_default: int | None = None
) -> RopeScaling | None:
    """One ``rope_scaling`` / ``rope_parameters`` dict -> RopeScaling (None for default RoPE).

    ``original_default`` is the model's own ``original_max_position_embeddings`` (Phi-3 keeps
    it beside the RoPE dict); a missing ``factor`` for yarn/longrope is derived as HF does."""
    if not raw:
        return None
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope_scaling type {rope_type!r} in {source}; "
            f"raylm supports {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return None
    original = raw.get("original_max_position_embeddings") or original_default
    if rope_type in ("yarn", "longrope") and not original:
        raise UnsupportedModelError(f"{rope_type} RoPE in {source} needs original_max_position_embeddings")
    factor = raw.get("factor")
    if factor is None:
        if rope_type not in ("yarn", "longrope"):
            raise UnsupportedModelError(f"{rope_type} RoPE in {source} needs a factor")
        factor = max_position_embeddings / original
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original or 8192),
        beta_fast=float(raw.get("beta_fast") or 32.0),
        beta_slow=float(raw.get("beta_slow") or 1.0),
        truncate=bool(raw.get("truncate", True)),
        mscale=optional_float(raw.get("mscale")),
        mscale_all_dim=optional_float(raw.get("mscale_all_dim")),
        attention_factor=optional_float(raw.get("attention_factor")),
        short_factor=tuple(float(f) for f in raw.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in raw.get("long_factor") or ()),
    )
    if rope_type == "longrope" and not (scaling.short_factor and scaling.long_factor):
        raise UnsupportedModelError(f"longrope RoPE in {source} needs short_factor and long_factor")
    return scaling


def rotary_dim(rope: Mapping[str, Any], raw: Mapping[str, Any], head_dim: int, source: str) -> int | None:
    """How many leading dims of each head RoPE rotates (rotate-half over those, the rest pass
    through: HF's ``apply_rotary_pos_emb`` with ``partial_rotary_factor``), None for all.
    HF keeps the factor in ``rope_parameters``; older configs (GLM-4.5's) state it top-level."""
    factor = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if factor in (None, 1, 1.0):
        return None
    dim = int(head_dim * float(factor))  # HF's int(), as its RoPE initialisation computes it
    if not 0 < dim <= head_dim or dim % 2:
        raise UnsupportedModelError(
            f"partial_rotary_factor={factor} in {source} rotates {dim} of {head_dim} dims: it needs an even "
            "number between 2 and the head size"
        )
    return None if dim == head_dim else dim


def optional_float(value: Any) -> float | None:
    """``value`` as a float, keeping None (config keys that may be null)."""
    return None if value is None else float(value)
