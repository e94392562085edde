"""Model hyper-parameters, read from an HF ``config.json`` or from GGUF metadata.

One frozen dataclass describes every decoder raylm runs: the Llama body plus the differences
a family declares (model/config/families.py) and the numbers its config gives (head size, windows,
soft-caps, RoPE kinds). The forward pass reads nothing else. A config option that raylm does
not implement is a load error naming it, never a silent default.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from raylm.model.config import gguf_metadata, hf_keys, latent_attention, text_decoder
from raylm.model.config.families import ACTIVATIONS, GGUF_FAMILIES, HF_FAMILIES
from raylm.model.config.latent_attention import LatentAttention, softmax_scale
from raylm.model.config.llama4 import (
    AttnTemperature,
    Llama4Attention,
    llama4_attention,
    llama4_from_gguf,
    llama4_moe,
)
from raylm.model.config.moe import MoeConfig, moe_from_gguf, moe_from_hf
from raylm.model.config.multipliers import Multipliers, multipliers_from_gguf, multipliers_from_hf
from raylm.model.config.nope_layers import GGUF_NOPE_INTERVAL, every_nth_nope, nope_layers_from_hf
from raylm.model.config.rope import RopeScaling, optional_float, parse_rope_scaling, rotary_dim
from raylm.model.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_HF_ARCHITECTURES: tuple[str, ...] = tuple(HF_FAMILIES)
SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = tuple(GGUF_FAMILIES)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """How one layer's attention scores are formed: ``softmax(softcap(q.k * scale))`` over the
    keys at positions ``p - window < k <= p`` (all ``k <= p`` when ``window`` is None), and only
    those of the query's own ``chunk`` of positions (``k // chunk == p // chunk``) when set."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    chunk: int | None = None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias
    rope_scaling: RopeScaling | None = None
    # RoPE rotates each head's first this-many dims, the rest pass through (partial_rotary_factor);
    # None: the whole head.
    rotary_dim: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # The declared differences (defaults: Llama).
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    qk_norm_whole: bool = False  # ... over all heads' q (and all k) at once (OLMoE)
    sandwich_norms: bool = False  # RMSNorm of the attention and MLP outputs before each residual add
    activation: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: float | None = None  # input embeddings times this, rounded in the model dtype (Gemma: sqrt(hidden))
    embedding_multiplier: float | None = None  # input embeddings times this, in float32 (Granite)
    residual_multiplier: float | None = None  # each residual branch times this before its add (Granite)
    query_scale: float | None = None  # attention scores' scale; None: head_dim ** -0.5
    logits_divisor: float | None = None  # output logits divided by this (Granite's logits_scaling)
    attn_softcap: float | None = None  # tanh soft-cap of attention scores
    final_softcap: float | None = None  # tanh soft-cap of the output logits
    # Per layer: its sliding window (keys it sees, its own included), None for full attention;
    # empty when no layer slides.
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None  # RoPE base of sliding layers (Gemma 3), default RoPE
    moe: MoeConfig | None = None  # mixture-of-experts layers (None: every layer has a dense MLP)
    # Llama 4 (model/config/llama4.py); each per-layer tuple empty when no layer has it.
    nope_layers: tuple[bool, ...] = ()  # per layer: no RoPE
    layer_chunks: tuple[int | None, ...] = ()  # per layer: its attention chunk (None: full attention)
    l2_qk_norm: bool = False  # the RoPE layers' q and k RMS-normalized (no weight) after RoPE
    attn_temperature: AttnTemperature | None = None  # the NoPE layers' query scale by position
    o_proj_bias: bool = False  # the attention output projection carries a bias (gpt-oss)
    attention_sinks: bool = False  # a learned per-head logit joins each softmax's denominator (gpt-oss)
    # DeepSeek's multi-head latent attention in place of GQA: then ``num_kv_heads`` is 1 (the
    # pool's one latent "head") and ``head_dim`` the rotary dims (HF's ``head_dim`` for these).
    mla: LatentAttention | None = None
    # A pipeline stage's slice of a model whose local and full-attention layers keep two KV
    # groups: the whole model's ``sliding_window``, so the stage keeps both groups (one may hold
    # none of its layers) and the replica's two block tables hold for it (``layer_slice``).
    stage_of_grouped_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; GQA needs whole groups"
            )
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ModelLoadError(f"{len(self.layer_windows)} layer windows for {self.num_layers} layers")
        for name in ("nope_layers", "layer_chunks"):
            if getattr(self, name) and len(getattr(self, name)) != self.num_layers:
                raise ModelLoadError(f"{len(getattr(self, name))} {name} for {self.num_layers} layers")
        if self.moe is not None and len(self.moe.sparse_layers) != self.num_layers:
            raise ModelLoadError(f"{len(self.moe.sparse_layers)} sparse-layer flags for {self.num_layers} layers")

    @property
    def attn_out_dim(self) -> int:
        """Each head's attention output (the input of ``o_proj`` per head): MLA's ``v_head_dim``."""
        return self.head_dim if self.mla is None else self.mla.v_head_dim

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (the GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def rope_dim(self) -> int:
        """The dims of each query and key head that RoPE rotates (the leading ones)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def first_layers(self, num_layers: int) -> "ModelConfig":
        """This config cut after its first ``num_layers`` decoder layers (a layer-skipping draft)."""
        return self.layer_slice(0, num_layers)

    def layer_slice(self, start: int, stop: int, *, stage: bool = False) -> "ModelConfig":
        """The config of decoder layers ``[start, stop)`` alone (a pipeline ``stage``'s, or a
        draft's): every per-layer declaration is sliced, so the slice indexes its layers from 0. A
        stage keeps the whole model's KV groups (``stage_of_grouped_window``): its pools must take
        the replica's block tables, even where its own layers would make one group."""
        if not 0 <= start < stop <= self.num_layers:
            raise ValueError(f"layers [{start}, {stop}) of a {self.num_layers}-layer model")
        moe = self.moe
        if moe is not None:
            moe = dataclasses.replace(moe, sparse_layers=moe.sparse_layers[start:stop])
        return dataclasses.replace(
            self, num_layers=stop - start, layer_windows=self.layer_windows[start:stop], moe=moe,
            nope_layers=self.nope_layers[start:stop], layer_chunks=self.layer_chunks[start:stop],
            stage_of_grouped_window=self.sliding_window if stage else self.stage_of_grouped_window,
        )

    def served_at(self, context_len: int) -> "ModelConfig":
        """This config for a replica serving at most ``context_len`` tokens per sequence: what
        depends on the served context (LongRoPE's factor choice) follows it."""
        return dataclasses.replace(self, max_position_embeddings=min(self.max_position_embeddings, context_len))

    def layer_window(self, layer: int) -> int | None:
        """Keys a query of ``layer`` sees (its own included), None for full attention."""
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def max_window(self) -> int | None:
        """The widest sliding window if every layer slides, else None (some layer sees all keys)."""
        if not self.layer_windows or None in self.layer_windows:
            return None
        return max(self.layer_windows)  # type: ignore[type-var]

    def local_span(self, layer: int) -> int | None:
        """The most keys back (its own included) a query of ``layer`` can see: its sliding window,
        or its attention chunk (Llama 4: a query sees its own chunk's keys up to itself, all
        within the last ``chunk`` positions); None for full attention."""
        window, chunk = self.layer_window(layer), self.layer_chunks[layer] if self.layer_chunks else None
        return window if chunk is None else chunk if window is None else min(window, chunk)

    @functools.cached_property
    def sliding_window(self) -> int | None:
        """The widest span (``local_span``) of the local layers of a model that also has
        full-attention layers (Gemma 2 and 3, gpt-oss interleave sliding ones, Llama 4 chunked
        ones), else None: those keep their KV in a block table of their own (``kv_group``), so
        that what lies behind their span can be released (behind a chunk's start is behind the
        span too). Computed once (``kv_group`` asks it for every layer). A pipeline stage's
        slice of such a model answers the model's (``stage_of_grouped_window``)."""
        if self.stage_of_grouped_window is not None:
            return self.stage_of_grouped_window
        spans = [s for s in map(self.local_span, range(self.num_layers)) if s is not None]
        if not spans or len(spans) == self.num_layers:
            return None
        return max(spans)

    def kv_group(self, layer: int) -> int:
        """Which KV group (block table and pool) ``layer`` reads when local and full-attention
        layers keep separate ones (``sliding_window``): 0 (the full-attention layers', or every
        layer's), 1 (the local layers')."""
        return int(self.sliding_window is not None and self.local_span(layer) is not None)

    @property
    def kv_group_layers(self) -> tuple[tuple[int, ...], ...]:
        """The layers of each KV group, in order (one group of every layer, or two)."""
        groups = 1 if self.sliding_window is None else 2
        return tuple(tuple(i for i in range(self.num_layers) if self.kv_group(i) == g) for g in range(groups))

    def attention(self, layer: int) -> AttentionSpec:
        """Layer ``layer``'s scale, window, soft-cap and attention chunk."""
        scale = self.query_scale if self.query_scale is not None else self.head_dim**-0.5
        chunk = self.layer_chunks[layer] if self.layer_chunks else None
        return AttentionSpec(scale, self.layer_window(layer), self.attn_softcap, chunk)

    def uses_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates its queries and keys (Llama 4's NoPE layers do not)."""
        return not (self.nope_layers and self.nope_layers[layer])

    def is_sparse(self, layer: int) -> bool:
        """Whether ``layer`` runs a mixture of experts instead of a dense MLP."""
        return self.moe is not None and self.moe.is_sparse(layer)

    @functools.cached_property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers that run a mixture of experts (``is_sparse``), in order; empty for a dense model."""
        return tuple(i for i in range(self.num_layers) if self.is_sparse(i))

    def uses_local_rope(self, layer: int) -> bool:
        """Whether ``layer`` rotates with the sliding layers' own RoPE base."""
        return self.local_rope_theta is not None and self.layer_window(layer) is not None

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from the parsed contents of an HF ``config.json`` (of a multimodal checkpoint:
        its text decoder's, model/config/text_decoder.py)."""
        if text_decoder.wrapped_architecture(raw) is not None:
            raw = text_decoder.text_decoder_config(raw, source)
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in HF_FAMILIES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or raw.get('model_type')!r} in {source}; "
                f"raylm supports {', '.join(SUPPORTED_HF_ARCHITECTURES)} (and the text decoder of "
                f"{', '.join(text_decoder.TEXT_DECODERS)})"
            )
        family = HF_FAMILIES[arch]
        hf_keys.refuse_unimplemented(raw, family, source)
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            layers = int(raw["num_hidden_layers"])
            max_positions = int(raw.get("max_position_embeddings", 2048))
            global_rope, local_rope = hf_keys.rope_parameters(raw)
            act = next((raw[key] for key in family.activation_keys if raw.get(key)), family.default_act)
            if act == "gelu" and family.gelu_is_tanh:
                act = "gelu_pytorch_tanh"
            scales = multipliers_from_hf(raw, source) if family.granite_multipliers else Multipliers()
            llama4 = llama4_attention(raw, layers, source) if family.llama4 else Llama4Attention()
            rope_scaling = parse_rope_scaling(
                global_rope, source, max_positions, raw.get("original_max_position_embeddings")
            )
            mla = None
            if family.latent_attention:
                mla = latent_attention.latent_attention_from_hf(raw, family.interleaved_rope, source)
            head_dim = mla.qk_rope_head_dim if mla else int(raw.get("head_dim") or hidden // heads)
            config = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size_mlp" if family.llama4 else "intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=1 if mla else int(raw.get("num_key_value_heads") or heads),
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(global_rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", family.tied_by_default)),
                # (Qwen2-MoE names its q/k/v biases' switch qkv_bias; gpt-oss's attention_bias
                # switches all four projections' biases, off too.)
                attention_bias=bool(raw["attention_bias"]) if family.o_proj_bias and "attention_bias" in raw
                else bool(raw.get("attention_bias") or raw.get("qkv_bias", family.attention_bias)),
                rope_scaling=rope_scaling,
                rotary_dim=None if mla else rotary_dim(global_rope, raw, head_dim, source),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
                qk_norm=family.qk_norm or bool(family.qk_norm_key and raw.get(family.qk_norm_key)),
                qk_norm_whole=family.qk_norm_whole,
                sandwich_norms=family.sandwich_norms,
                activation=hf_keys.activation(act, source),
                embed_scale=math.sqrt(hidden) if family.sqrt_hidden_embed_scale else None,
                embedding_multiplier=scales.embedding,
                residual_multiplier=scales.residual,
                query_scale=hf_keys.query_scale(raw, family, mla, rope_scaling, scales),
                logits_divisor=scales.logits_divisor,
                attn_softcap=optional_float(raw.get("attn_logit_softcapping")),
                final_softcap=optional_float(raw.get("final_logit_softcapping")),
                layer_windows=hf_keys.layer_windows(raw, family, layers, source),
                local_rope_theta=hf_keys.local_rope_theta(local_rope, source),
                moe=llama4_moe(raw, layers, source) if family.llama4 else moe_from_hf(raw, family, layers, source),
                nope_layers=nope_layers_from_hf(raw, layers, source) if family.nope_layers else llama4.nope_layers,
                layer_chunks=llama4.layer_chunks,
                l2_qk_norm=llama4.l2_qk_norm,
                attn_temperature=llama4.temperature,
                o_proj_bias=family.o_proj_bias and bool(raw.get("attention_bias", family.attention_bias)),
                attention_sinks=family.attention_sinks,
                mla=mla,
            )
        except KeyError as missing:
            raise ModelLoadError(f"{source} lacks required key {missing}") from None
        if local_rope is not None and rotary_dim(local_rope, {}, config.head_dim, source) != config.rotary_dim:
            raise UnsupportedModelError(
                f"partial_rotary_factor in {source} differs between sliding and full layers: raylm rotates "
                "every layer's heads alike"
            )
        return config

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelConfig":
        """Read ``config.json`` (and ``generation_config.json`` EOS ids) from a checkpoint dir."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{config_file} not found: an HF checkpoint directory needs config.json")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise ModelLoadError(f"{config_file} is not valid JSON: {err}") from None
        config = cls.from_hf_dict(raw, str(config_file))
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            extra = _as_id_tuple(json.loads(gen_file.read_text()).get("eos_token_id"))
            config = dataclasses.replace(
                config, eos_token_ids=tuple(dict.fromkeys(config.eos_token_ids + extra))
            )
        return config

    @classmethod
    def from_gguf_fields(
        cls, fields: Mapping[str, Any], source: str, rope_tensors: Mapping[str, Sequence[float]] | None = None
    ) -> "ModelConfig":
        """Build from GGUF key/value metadata (already decoded to Python values), read as
        llama.cpp reads each architecture (model/config/gguf_metadata.py); ``rope_tensors`` are the
        file's RoPE factor tensors (``gguf_metadata.ROPE_TENSORS``) that it has."""
        arch = fields.get("general.architecture")
        if arch not in GGUF_FAMILIES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {arch!r} in {source}; "
                f"raylm supports {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
            )
        family = HF_FAMILIES[GGUF_FAMILIES[arch]]
        meta = gguf_metadata.GgufMetadata(fields, arch, source)
        hidden = int(meta.get("embedding_length", required=True))
        heads = int(meta.get("attention.head_count", required=True))
        layers = gguf_metadata.decoder_layers(meta)
        head_dim = int(meta.get("attention.key_length") or hidden // heads)
        mla = latent_attention.latent_attention_from_gguf(meta) if family.latent_attention else None
        if mla is not None:
            head_dim = mla.qk_rope_head_dim
        gguf_metadata.refuse_unimplemented(meta, family, head_dim, latent_attention.GGUF_KEYS if mla else ())
        vocab = meta.get("vocab_size") or len(fields.get("tokenizer.ggml.tokens", ()))
        max_positions = int(meta.get("context_length", 2048))
        rotary = None if mla else gguf_metadata.rotary_dim(meta, head_dim)
        scaling, local_theta = gguf_metadata.rope(meta, max_positions, rotary or head_dim, rope_tensors or {})
        if mla is not None:
            scaling = latent_attention.gguf_yarn(meta, scaling)
        attn_softcap, final_softcap = gguf_metadata.softcaps(meta)
        windows = gguf_metadata.layer_windows(meta, layers)
        dense_size = int(meta.get("feed_forward_length", required=True))
        if family.llama4:
            llama4, moe = llama4_from_gguf(meta, layers)
        else:
            llama4, moe = Llama4Attention(), moe_from_gguf(meta, layers, dense_size)
        scales = multipliers_from_gguf(meta) if family.granite_multipliers else Multipliers()
        query_scale = gguf_metadata.query_scale(meta, hidden, heads, head_dim, layers)
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=dense_size,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=1 if mla else int(meta.get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(meta.get("rope.freq_base", 10000.0)),
            max_position_embeddings=max_positions,
            # Tied when the file has no separate output matrix; the loader decides that.
            tie_word_embeddings=False,
            attention_bias=family.attention_bias,
            rope_scaling=scaling,
            rotary_dim=rotary,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_id_tuple(fields.get("tokenizer.ggml.eos_token_id")),
            qk_norm=family.qk_norm,
            qk_norm_whole=family.qk_norm_whole,
            sandwich_norms=family.sandwich_norms,
            activation=ACTIVATIONS[family.default_act],
            embed_scale=math.sqrt(hidden) if family.sqrt_hidden_embed_scale else None,
            embedding_multiplier=scales.embedding,
            residual_multiplier=scales.residual,
            query_scale=softmax_scale(mla, scaling) if mla else scales.attention if query_scale is None else query_scale,
            logits_divisor=scales.logits_divisor,
            attn_softcap=attn_softcap,
            final_softcap=final_softcap,
            layer_windows=windows,
            local_rope_theta=local_theta if windows else None,
            moe=moe,
            nope_layers=every_nth_nope(layers, GGUF_NOPE_INTERVAL) if family.nope_layers else llama4.nope_layers,
            layer_chunks=llama4.layer_chunks,
            l2_qk_norm=llama4.l2_qk_norm,
            attn_temperature=llama4.temperature,
            o_proj_bias=family.o_proj_bias,
            attention_sinks=family.attention_sinks,
            mla=mla,
        )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
