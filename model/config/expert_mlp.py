"""How an MoE family's experts differ from the plain gated MLP of Mixtral / Qwen-MoE: gpt-oss's.

gpt-oss (HF's GptOssTopKRouter and GptOssExperts) adds a bias to the router's logits, to each
expert's gate/up and down projections, and replaces SwiGLU by a clamped one:
``gate = min(gate, limit)``, ``up = clip(up, -limit, limit)``,
``(up + 1) * gate * sigmoid(alpha * gate)``. Read from config.json's ``swiglu_limit`` and
``swiglu_alpha`` with HF's defaults; the decoder's side is model/decoder/expert_mlp.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from raylm.model.errors import UnsupportedModelError


@dataclasses.dataclass(frozen=True)
class ClampedSwiglu:
    """gpt-oss's expert activation: gate clamped above and up on both sides at ``limit``,
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    limit: float = 7.0
    alpha: float = 1.702


def clamped_swiglu_from_hf(raw: Mapping[str, Any], source: str) -> ClampedSwiglu:
    """The clamped SwiGLU a gpt-oss config.json states (HF's defaults where it is silent)."""
    limit = float(raw.get("swiglu_limit") if raw.get("swiglu_limit") is not None else 7.0)
    alpha = float(raw.get("swiglu_alpha") if raw.get("swiglu_alpha") is not None else 1.702)
    if not limit > 0:
        raise UnsupportedModelError(f"swiglu_limit={limit} in {source}: it must be positive")
    return ClampedSwiglu(limit, alpha)
