"""Model hyper-parameters, read from an HF ``config.json`` or from GGUF metadata.

One frozen dataclass describes every Llama-family model raylm runs (Llama, Mistral,
Qwen2, SmolLM); the forward pass reads nothing else.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from model.errors import ModelLoadError, UnsupportedModelError

# HF architecture name -> whether q/k/v projections carry a bias.
SUPPORTED_HF_ARCHITECTURES: dict[str, bool] = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
SUPPORTED_GGUF_ARCHITECTURES: dict[str, bool] = {"llama": False, "qwen2": True}
SUPPORTED_ROPE_SCALING = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as HF defines it (``rope_scaling`` in config.json)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a Llama-family model."""

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
    attention_bias: bool
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; GQA needs whole groups"
            )

    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (the GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Build from the parsed contents of an HF ``config.json``."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_HF_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or raw.get('model_type')!r} in {source}; "
                f"raylm supports {', '.join(SUPPORTED_HF_ARCHITECTURES)}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            config = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(_rope_theta(raw)),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", SUPPORTED_HF_ARCHITECTURES[arch])),
                rope_scaling=_rope_scaling(raw.get("rope_scaling") or raw.get("rope_parameters"), source),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_id_tuple(raw.get("eos_token_id")),
            )
        except KeyError as missing:
            raise ModelLoadError(f"{source} lacks required key {missing}") from None
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
    def from_gguf_fields(cls, fields: Mapping[str, Any], source: str) -> "ModelConfig":
        """Build from GGUF key/value metadata (already decoded to Python values)."""
        arch = fields.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {arch!r} in {source}; "
                f"raylm supports {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
            )

        def get(key: str, default: Any = None) -> Any:
            value = fields.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelLoadError(f"{source} lacks GGUF metadata key {arch}.{key}")
            return value

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        vocab = fields.get(f"{arch}.vocab_size") or len(fields.get("tokenizer.ggml.tokens", ()))
        scaling = None
        scaling_type = fields.get(f"{arch}.rope.scaling.type")
        if scaling_type not in (None, "none"):
            scaling = _rope_scaling(
                {
                    "rope_type": scaling_type,
                    "factor": fields.get(f"{arch}.rope.scaling.factor", 1.0),
                    "original_max_position_embeddings": fields.get(
                        f"{arch}.rope.scaling.original_context_length", 8192
                    ),
                },
                source,
            )
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(fields.get(f"{arch}.attention.key_length") or hidden // heads),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 2048)),
            # Tied when the file has no separate output matrix; the loader decides that.
            tie_word_embeddings=False,
            attention_bias=SUPPORTED_GGUF_ARCHITECTURES[arch],
            rope_scaling=scaling,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=_as_id_tuple(fields.get("tokenizer.ggml.eos_token_id")),
        )


def _rope_theta(raw: Mapping[str, Any]) -> float:
    if "rope_theta" in raw:
        return raw["rope_theta"]
    params = raw.get("rope_parameters") or {}
    return params.get("rope_theta", 10000.0)


def _rope_scaling(raw: Mapping[str, Any] | None, source: str) -> RopeScaling | None:
    if not raw:
        return None
    rope_type = raw.get("rope_type") or raw.get("type")
    if rope_type == "default":
        return None
    if rope_type not in SUPPORTED_ROPE_SCALING:
        raise UnsupportedModelError(
            f"unsupported rope_scaling type {rope_type!r} in {source}; "
            f"raylm supports {', '.join(SUPPORTED_ROPE_SCALING)}"
        )
    return RopeScaling(
        rope_type=rope_type,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
