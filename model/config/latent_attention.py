"""DeepSeek's multi-head latent attention (MLA) as config.json declares it.

Each token's keys and values are one compressed latent (``kv_lora_rank`` values, RMS-normed)
plus one rotary key shared by all heads (``qk_rope_head_dim``); ``kv_b_proj`` expands the latent
into every head's non-rotary key (``qk_nope_head_dim``) and value (``v_head_dim``). The query is
``q_proj`` of the hidden state, or with ``q_lora_rank`` a low-rank ``q_b_proj(norm(q_a_proj(x)))``.
The decoder's half is model/decoder/latent_attention.py.

MoE layers of these families (``first_k_dense_replace`` below the layer count) are refused here
until the DeepSeek routing is wired in: a load error naming the key, never a dense stand-in.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from raylm.model.config.rope import RopeScaling
from raylm.model.errors import ModelLoadError, UnsupportedModelError

# DeepSeek's q_a_layernorm and kv_a_layernorm use RMSNorm's default epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class LatentAttention:
    """The sizes of one MLA model's attention (HF's names)."""

    kv_lora_rank: int  # the latent each token stores
    qk_rope_head_dim: int  # the rotary key shared by all heads (and each query head's rotary part)
    qk_nope_head_dim: int  # each head's key (and query) part expanded from the latent
    v_head_dim: int  # each head's value
    q_lora_rank: int | None = None  # None: a full-rank q_proj
    # Rotary dims stored as interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek-V2 always,
    # V3 with rope_interleave); else as halves (rotate-half, Llama's layout).
    rope_interleave: bool = True

    @property
    def qk_head_dim(self) -> int:
        """Each query (and expanded key) head: its non-rotary then its rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the paged pool keeps per token and layer: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def latent_attention_from_hf(raw: Mapping[str, Any], always_interleaved: bool, source: str) -> LatentAttention:
    """The MLA sizes of a DeepSeek config.json (``always_interleaved``: V2's complex-pair RoPE)."""
    try:
        q_lora = raw.get("q_lora_rank")
        return LatentAttention(
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            v_head_dim=int(raw["v_head_dim"]),
            q_lora_rank=None if q_lora is None else int(q_lora),
            rope_interleave=always_interleaved or bool(raw.get("rope_interleave", True)),
        )
    except KeyError as missing:
        raise ModelLoadError(f"{source} lacks required key {missing} of multi-head latent attention") from None


def refuse_routed_experts(raw: Mapping[str, Any], num_layers: int, source: str) -> None:
    """A DeepSeek config whose layers from ``first_k_dense_replace`` on are MoE layers (HF builds
    experts there whenever that index is below the layer count): refused, naming the key."""
    first_dense = raw.get("first_k_dense_replace")
    first_dense = 0 if first_dense is None else int(first_dense)
    if first_dense < num_layers:
        raise UnsupportedModelError(
            f"first_k_dense_replace={first_dense} in {source}: layers {first_dense}..{num_layers - 1} are "
            f"DeepSeek mixture-of-experts layers (n_routed_experts={raw.get('n_routed_experts')}), which raylm "
            "does not implement yet; only all-dense DeepSeek configs (first_k_dense_replace >= "
            f"num_hidden_layers={num_layers}) load"
        )


def softmax_scale(mla: LatentAttention, scaling: RopeScaling | None) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim)`` squared when the
    RoPE scaling names ``mscale_all_dim`` (DeepSeek's ``yarn_apply_mscale``; the cos/sin factor,
    ``mscale / mscale_all_dim``, is YaRN's own, model/decoder/layers.py)."""
    scale = mla.qk_head_dim**-0.5
    if scaling is not None and scaling.mscale_all_dim and scaling.factor > 1:
        mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale *= mscale * mscale
    return scale
