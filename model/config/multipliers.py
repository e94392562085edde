"""Granite's four scalar multipliers, read from config.json or from llama.cpp's GGUF keys.

HF Granite (transformers/models/granite/modeling_granite.py) is Llama with: input embeddings
times ``embedding_multiplier``, each residual branch (attention and MLP outputs) times
``residual_multiplier`` before its add, attention scores scaled by ``attention_multiplier``
(in place of ``head_dim ** -0.5``) and the logits divided by ``logits_scaling``; all four
default to 1.0. llama.cpp's converter (GraniteModel) writes them, when non-zero, as
``granite.embedding_scale``, ``granite.residual_scale``, ``granite.attention.scale`` and
``granite.logit_scale``; llama.cpp reads 0 (or absent) as "none" for the first three (the
attention scale then is ``1/sqrt(head_dim)``) and requires the logit scale.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

from raylm.model.config.gguf_metadata import GgufMetadata
from raylm.model.errors import UnsupportedModelError


class Multipliers(NamedTuple):
    """What ``ModelConfig`` keeps of them (None: Llama's behaviour)."""

    embedding: float | None = None  # input embeddings times this
    residual: float | None = None  # each residual branch times this before its add
    attention: float | None = None  # the attention scores' scale
    logits_divisor: float | None = None  # output logits divided by this


def multipliers_from_hf(raw: Mapping[str, Any], source: str) -> Multipliers:
    """Granite's multipliers as HF applies them (each defaults to 1.0)."""
    values = {key: float(raw.get(key, 1.0)) for key in
              ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")}
    if values["logits_scaling"] == 0.0:
        raise UnsupportedModelError(f"logits_scaling=0 in {source}: the logits are divided by it")
    return Multipliers(values["embedding_multiplier"], values["residual_multiplier"], values["attention_multiplier"],
                       values["logits_scaling"])


def multipliers_from_gguf(meta: GgufMetadata) -> Multipliers:
    """Granite's multipliers as llama.cpp reads a "granite" file's keys."""

    def nonzero(key: str) -> float | None:
        value = float(meta.get(key, 0.0))
        return value if value != 0.0 else None

    logits = float(meta.get("logit_scale", required=True))
    if logits == 0.0:
        raise meta.refuse("logit_scale", "divides the logits: it cannot be 0")
    if meta.get("rope.scaling.finetuned", True) is False:
        raise meta.refuse("rope.scaling.finetuned", "switches RoPE off for Granite; raylm rotates every layer")
    return Multipliers(nonzero("embedding_scale"), nonzero("residual_scale"), nonzero("attention.scale"), logits)
