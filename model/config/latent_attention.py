"""DeepSeek's multi-head latent attention (MLA) as config.json declares it.

Each token's keys and values are one compressed latent (``kv_lora_rank`` values, RMS-normed)
plus one rotary key shared by all heads (``qk_rope_head_dim``); ``kv_b_proj`` expands the latent
into every head's non-rotary key (``qk_nope_head_dim``) and value (``v_head_dim``). The query is
``q_proj`` of the hidden state, or with ``q_lora_rank`` a low-rank ``q_b_proj(norm(q_a_proj(x)))``.
The decoder's half is model/decoder/latent_attention.py. Their experts (from
``first_k_dense_replace`` on) are the DeepSeek-style MoE block of model/config/deepseek_routing.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from raylm.model.config.rope import RopeScaling
from raylm.model.errors import ModelLoadError

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


def softmax_scale(mla: LatentAttention, scaling: RopeScaling | None) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim)`` squared when the
    RoPE scaling names ``mscale_all_dim`` (DeepSeek's ``yarn_apply_mscale``; the cos/sin factor,
    ``mscale / mscale_all_dim``, is YaRN's own, model/decoder/layers.py)."""
    scale = mla.qk_head_dim**-0.5
    if scaling is not None and scaling.mscale_all_dim and scaling.factor > 1:
        mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale *= mscale * mscale
    return scale


# What a deepseek2 GGUF says about its attention (after "deepseek2."), read by
# ``latent_attention_from_gguf`` rather than by gguf_metadata's generic checks (its experts' keys:
# model/config/deepseek_routing.py).
GGUF_KEYS = (
    "attention.key_length", "attention.value_length", "attention.key_length_mla", "attention.value_length_mla",
    "attention.q_lora_rank", "attention.kv_lora_rank", "rope.dimension_count", "rope.scaling.yarn_log_multiplier",
)


def latent_attention_from_gguf(meta: Any) -> LatentAttention:
    """The MLA sizes of a llama.cpp ``deepseek2`` file (``meta``: a ``gguf_metadata.GgufMetadata``).
    Its converter writes ``key_length`` / ``value_length`` as the latent pool's (``kv_lora_rank +
    qk_rope_head_dim`` / ``kv_lora_rank``) and the heads' sizes as ``key_length_mla`` /
    ``value_length_mla``; files older than that split state the heads' sizes in the first two.
    Its RoPE rotates interleaved pairs (llama.cpp's NORM rope type), as HF's V2 does."""
    rope = int(meta.get("rope.dimension_count", required=True))
    split = meta.has("attention.key_length_mla")
    qk = int(meta.get("attention.key_length_mla" if split else "attention.key_length", required=True))
    value = int(meta.get("attention.value_length_mla" if split else "attention.value_length", required=True))
    q_lora = meta.get("attention.q_lora_rank")
    return LatentAttention(
        kv_lora_rank=int(meta.get("attention.kv_lora_rank", required=True)),
        qk_rope_head_dim=rope,
        qk_nope_head_dim=qk - rope,
        v_head_dim=value,
        q_lora_rank=int(q_lora) if q_lora else None,
        rope_interleave=True,
    )


def gguf_yarn(meta: Any, scaling: RopeScaling | None) -> RopeScaling | None:
    """A deepseek2 file's YaRN as llama.cpp computes it: ``rope.scaling.yarn_log_multiplier`` is
    ``0.1 * mscale_all_dim`` and cos/sin keep no factor of their own (HF's ``mscale`` equal to
    ``mscale_all_dim``, as DeepSeek's configs have it)."""
    multiplier = meta.get("rope.scaling.yarn_log_multiplier")
    if multiplier is None or scaling is None:
        return scaling
    mscale = float(multiplier) / 0.1
    return dataclasses.replace(scaling, mscale=mscale, mscale_all_dim=mscale)
