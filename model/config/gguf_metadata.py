"""What llama.cpp's GGUF metadata says about a family's differences, read as llama.cpp reads it.

A GGUF states less than a config.json: llama.cpp fixes per architecture what HF configures
(src/llama-model.cpp, ``load_hparams``), and its converter (convert_hf_to_gguf.py) writes only
what llama.cpp reads. So the rules below are llama.cpp's: Gemma 2 slides every other layer
(window 4096 unless stated) and caps logits at 50 / 30 unless stated; Gemma 3 slides five
layers in six with RoPE base 10000 on them and scales only its global layers' RoPE; Gemma
scales queries by 1/sqrt(head_dim), except the 27B models by 1/sqrt(hidden/heads); gpt-oss
slides every other layer; Llama 4 chunks and tunes attention as model/config/llama4.py says; Phi-3's
LongRoPE is two factor tensors beside ``rope.scaling.attn_factor`` and
``rope.scaling.original_context_length`` (no scaling type); Llama 3's RoPE is one
``rope_freqs`` tensor of per-frequency divisors.

Where the file states something llama.cpp leaves out, the file wins: ``attention.sliding_window``
on a "llama" file (Mistral) slides every layer, on Phi-3 too (llama.cpp switches Phi-3's window
off; HF and the checkpoint apply it); ``attention.sliding_window_pattern`` (a period, or one
flag per layer) overrides Gemma's default period. Anything else a file states that raylm
does not implement is a load error naming the key.

``ModelConfig.from_gguf_fields`` assembles the config from these answers; this module knows
nothing of it.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from raylm.model.config.deepseek_routing import GGUF_ARCHES as DEEPSEEK_ARCHES
from raylm.model.config.deepseek_routing import GGUF_KEYS as DEEPSEEK_KEYS
from raylm.model.config.families import Family
from raylm.model.config.rope import RopeScaling, parse_rope_scaling
from raylm.model.errors import ModelLoadError, UnsupportedModelError

# GGUF tensors that are model settings rather than weights (the config reads them).
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
# Gemma's sliding period and 27B layer counts (llama.cpp: LLM_TYPE_27B picks the query scale).
_GEMMA = {"gemma2": (2, 46), "gemma3": (6, 62)}
# Per-arch keys (after "{arch}.") that change the computation in ways raylm does not
# implement, with the value that means "off" (None: refused whatever the value).
_UNIMPLEMENTED: dict[str, Any] = {
    "attention.scale": None,
    "attention.causal": True,
    "attention.clamp_kqv": 0.0,
    "attention.max_alibi_bias": 0.0,
    "attention.key_length_swa": None,
    "attention.value_length_swa": None,
    "attention.shared_kv_layers": None,
    "attention.temperature_scale": None,
    "logit_scale": 1.0,
    "embedding_scale": None,
    "residual_scale": None,
    "use_parallel_residual": False,
    "rope.dimension_sections": None,
    "rope.dimension_count_swa": None,
    "rope.scaling.alpha": None,
    "rope.scaling.yarn_ext_factor": None,
    "rope.scaling.yarn_attn_factor": None,
    "rope.scaling.yarn_log_multiplier": None,
    # mixture-of-experts routing variants (model/config/moe.py reads the rest of the block)
    "expert_gating_func": 1,  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
    "expert_weights_scale": 1.0,
    "expert_group_count": 0,
    "expert_group_used_count": 0,
    "leading_dense_block_count": 0,
    "moe_every_n_layers": 0,
    "nextn_predict_layers": 0,  # multi-token prediction layers after the decoder's
}
# Architectures whose RoPE (llama.cpp's NEOX mode) may rotate fewer dims than a head's
# (``rope.dimension_count``): the leading ones, by halves, as HF's partial rotary does.
_PARTIAL_ROTARY_ARCHES = ("glm4moe",)

# Keys of that list a family's own module reads instead (model/config/multipliers.py: Granite's).
_READ_BY_FAMILY = ("embedding_scale", "residual_scale", "attention.scale", "logit_scale")


class GgufMetadata:
    """A GGUF's fields seen through its architecture's key prefix."""

    def __init__(self, fields: Mapping[str, Any], arch: str, source: str):
        self.fields, self.arch, self.source = fields, arch, source

    def has(self, key: str) -> bool:
        return f"{self.arch}.{key}" in self.fields

    def get(self, key: str, default: Any = None, required: bool = False) -> Any:
        value = self.fields.get(f"{self.arch}.{key}", default)
        if value is None and required:
            raise ModelLoadError(f"{self.source} lacks GGUF metadata key {self.arch}.{key}")
        if isinstance(value, list) and not key.startswith("attention.sliding_window_pattern"):
            raise UnsupportedModelError(
                f"{self.source}: {self.arch}.{key} is per layer ({value}); raylm needs one value for all layers"
            )
        return value

    def refuse(self, key: str, why: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{self.source}: GGUF key {self.arch}.{key}={self.get(key)!r} {why}")


def refuse_unimplemented(meta: GgufMetadata, family: Family, head_dim: int, answered: Sequence[str] = ()) -> None:
    """Load errors for settings the file states and raylm does not compute (``answered``: keys
    a family's own reading has taken care of)."""
    read = _READ_BY_FAMILY if family.granite_multipliers else ()
    for key, off in _UNIMPLEMENTED.items():
        if meta.arch in DEEPSEEK_ARCHES and key in DEEPSEEK_KEYS:
            continue  # read by model/config/deepseek_routing.py
        if key not in read and key not in answered and meta.has(key) and (off is None or meta.get(key) != off):
            raise meta.refuse(key, "is not implemented by raylm")
    for key in ("attention.value_length", "rope.dimension_count"):
        if key in answered or (key == "rope.dimension_count" and meta.arch in _PARTIAL_ROTARY_ARCHES):
            continue  # (``rotary_dim``, or the family's own reading)
        if meta.get(key, head_dim) != head_dim:
            raise meta.refuse(key, f"differs from the head size {head_dim}: raylm rotates and attends whole heads")
    if not family.logit_softcaps:
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if meta.has(key):
                raise meta.refuse(key, f"is a Gemma 2 / 3 setting; llama.cpp does not read it for {meta.arch}")
    elif meta.arch == "gemma3" and meta.has("attn_logit_softcapping"):
        raise meta.refuse("attn_logit_softcapping", "is not part of Gemma 3 (llama.cpp does not read it)")


def decoder_layers(meta: GgufMetadata) -> int:
    """The decoder's layers: ``block_count`` less the multi-token-prediction layers stored after
    them (llama.cpp's n_layer; their tensors are not read)."""
    return int(meta.get("block_count", required=True)) - int(meta.get("nextn_predict_layers") or 0)


def rotary_dim(meta: GgufMetadata, head_dim: int) -> int | None:
    """The leading dims of each head RoPE rotates (``rope.dimension_count``), None for all."""
    dim = int(meta.get("rope.dimension_count") or head_dim)
    if dim == head_dim:
        return None
    if not 0 < dim < head_dim or dim % 2:
        raise meta.refuse("rope.dimension_count", f"must be even and at most the head size {head_dim}")
    return dim


def layer_windows(meta: GgufMetadata, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), () when no layer slides."""
    arch = meta.arch
    if arch in _GEMMA:
        default = 4096 if arch == "gemma2" else 0  # gemma3 without a window: none (llama.cpp)
        window, period = int(meta.get("attention.sliding_window", default)), _GEMMA[arch][0]
    elif arch in ("llama", "phi3"):
        window, period = int(meta.get("attention.sliding_window", 0)), 0  # every layer
    elif arch == "gpt-oss":  # llama.cpp: every other layer, the first sliding
        window, period = int(meta.get("attention.sliding_window", required=True)), 2
    else:
        if meta.get("attention.sliding_window", 0):
            raise meta.refuse("attention.sliding_window", f"has no layer pattern raylm knows for {arch}")
        return ()
    if window <= 0:
        return ()
    pattern = meta.get("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise meta.refuse("attention.sliding_window_pattern", f"needs one flag for each of {num_layers} layers")
        sliding = [bool(p) for p in pattern]
    else:  # llama.cpp's set_swa_pattern: 0 slides every layer, n the first n-1 of each n
        period = int(pattern)
        sliding = [period == 0 or i % period < period - 1 for i in range(num_layers)]
    if not any(sliding):
        return ()
    return tuple(window if s else None for s in sliding)


def query_scale(meta: GgufMetadata, hidden: int, heads: int, head_dim: int, num_layers: int) -> float | None:
    """Gemma's attention scale as llama.cpp sets it (None: the default 1/sqrt(head_dim))."""
    if meta.arch not in _GEMMA:
        return None
    if num_layers == _GEMMA[meta.arch][1]:  # the 27B: query_pre_attn_scalar = hidden / heads
        return (hidden // heads) ** -0.5
    return head_dim**-0.5


def softcaps(meta: GgufMetadata) -> tuple[float | None, float | None]:
    """(attention, final) logit soft-caps: Gemma 2's defaults are llama.cpp's (and HF's) 50 / 30."""
    if meta.arch == "gemma2":
        return float(meta.get("attn_logit_softcapping", 50.0)), float(meta.get("final_logit_softcapping", 30.0))
    final = meta.get("final_logit_softcapping")
    return None, (float(final) if final else None)


def rope(
    meta: GgufMetadata, max_positions: int, head_dim: int, tensors: Mapping[str, Sequence[float]]
) -> tuple[RopeScaling | None, float | None]:
    """(the global layers' RoPE scaling, the sliding layers' own RoPE base or None)."""
    kind = meta.get("rope.scaling.type") or "none"
    attn_factor = meta.get("rope.scaling.attn_factor")
    original = meta.get("rope.scaling.original_context_length")
    local_theta = meta.get("rope.freq_base_swa")
    if meta.arch == "gemma3":
        local_theta = float(local_theta or 10000.0)
    elif local_theta is not None and float(local_theta) != float(meta.get("rope.freq_base", 10000.0)):
        raise meta.refuse("rope.freq_base_swa", f"(a RoPE base of its own for sliding layers) is not read for {meta.arch}")
    else:
        local_theta = None
    factors = {name: tuple(float(f) for f in values) for name, values in tensors.items()}
    if "rope_freqs.weight" in factors:
        if kind != "none" or attn_factor is not None:
            raise meta.refuse("rope.scaling.type", "beside a rope_freqs tensor is not implemented")
        divisors = _checked(factors["rope_freqs.weight"], head_dim, meta.source, "rope_freqs.weight")
        # llama.cpp divides each frequency by its entry (Llama 3's RoPE as the converter writes
        # it): LongRoPE's rotation with one set of factors and no attention factor.
        return RopeScaling("longrope", 1.0, original_max_position_embeddings=max_positions, attention_factor=1.0,
                           short_factor=divisors, long_factor=divisors), local_theta
    if "rope_factors_long.weight" in factors or kind == "longrope":
        if original is None:
            raise ModelLoadError(f"{meta.source}: LongRoPE factors need {meta.arch}.rope.scaling.original_context_length")
        long = _checked(factors.get("rope_factors_long.weight", ()), head_dim, meta.source, "rope_factors_long.weight")
        short = _checked(factors.get("rope_factors_short.weight", ()), head_dim, meta.source, "rope_factors_short.weight")
        return RopeScaling("longrope", max_positions / int(original), original_max_position_embeddings=int(original),
                           attention_factor=None if attn_factor is None else float(attn_factor),
                           short_factor=short, long_factor=long), local_theta
    if attn_factor is not None and float(attn_factor) != 1.0:
        raise meta.refuse("rope.scaling.attn_factor", f"with RoPE scaling {kind!r} is not implemented")
    if kind == "none":
        return None, local_theta
    raw: dict[str, Any] = {"rope_type": kind, "factor": meta.get("rope.scaling.factor")}
    if original is not None:
        raw["original_max_position_embeddings"] = int(original)
    for ours, key in (("beta_fast", "rope.scaling.yarn_beta_fast"), ("beta_slow", "rope.scaling.yarn_beta_slow")):
        if meta.has(key):
            raw[ours] = float(meta.get(key))
    if kind not in ("linear", "yarn"):  # GGUF's scaling types: none, linear, yarn, longrope
        raise meta.refuse("rope.scaling.type", "is not a RoPE scaling type raylm implements (linear, yarn, longrope)")
    return parse_rope_scaling(raw, meta.source, max_positions), local_theta


def _checked(values: tuple[float, ...], head_dim: int, source: str, name: str) -> tuple[float, ...]:
    if len(values) != head_dim // 2 or not all(math.isfinite(v) and v > 0 for v in values):
        raise ModelLoadError(f"{source}: tensor {name} needs {head_dim // 2} positive factors, got {len(values)}")
    return values
