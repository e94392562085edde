"""Experts stored as two stacked tensors, ``experts.gate_up_proj`` and ``experts.down_proj``,
answered as the per-projection ``[E, out, in]`` arrays ``stacked_experts`` reads.

Why: Llama 4 and Qwen3-VL-MoE checkpoints do not store a tensor per expert. Their releases hold
``gate_up_proj [E, D, 2I]`` (inputs first; gate then up along the last axis) and ``down_proj
[E, I, D]``; transformers 5 keeps Llama 4's that way but loads Qwen3-VL-MoE's transposed, and
saves it outputs first (``[E, 2I, D]``, ``[E, D, I]``). Both layouts are in the wild, so the
layout is read from the shapes: each tensor's own, or where it is square (D = 2I for gate/up,
D = I for down) its partner's, which then is not.
"""

from __future__ import annotations

import re

import numpy as np

from raylm.model.config.model_config import ModelConfig
from raylm.model.errors import ModelLoadError
from raylm.model.loaders.hf_tensors import TensorSource

_EXPERTS_RE = re.compile(r"(model\.layers\.\d+\.mlp\.)experts\.(gate_proj|up_proj|down_proj)")


def _stored(get: TensorSource, name: str) -> np.ndarray | None:
    found = get(name)
    if found is not None and not isinstance(found, np.ndarray):
        raise ModelLoadError(f"tensor {name!r} is stored quantized; raylm reads stacked experts as floats only")
    return found


def _inputs_first(shape: tuple[int, ...], inputs_first: tuple[int, int], name: str) -> bool | None:
    """Whether ``shape`` is ``[E, *inputs_first]`` (the release's layout) rather than the
    transposed one; None when both read the same (square)."""
    outputs_first = inputs_first[::-1]
    if inputs_first == outputs_first:
        return None
    if tuple(shape[1:]) == inputs_first:
        return True
    if tuple(shape[1:]) == outputs_first:
        return False
    raise ModelLoadError(f"tensor {name!r} has shape {tuple(shape)}: expected [E, {inputs_first[0]}, "
                         f"{inputs_first[1]}] or [E, {outputs_first[0]}, {outputs_first[1]}]")


def fused_expert_projection(get: TensorSource, prefix: str, proj: str, hidden: int, expert_size: int) -> np.ndarray | None:
    """Projection ``proj`` of the experts stored under ``prefix`` (``...experts.gate_up_proj`` /
    ``...experts.down_proj``) as ``[E, out, in]``; None when they are not stored that way."""
    names = {"gate_up": prefix + "experts.gate_up_proj", "down": prefix + "experts.down_proj"}
    inputs_first_shapes = {"gate_up": (hidden, 2 * expert_size), "down": (expert_size, hidden)}
    own = "down" if proj == "down_proj" else "gate_up"
    partner = "gate_up" if own == "down" else "down"
    stacked = _stored(get, names[own])
    if stacked is None:
        return None
    layout = _inputs_first(stacked.shape, inputs_first_shapes[own], names[own])
    if layout is None:  # square: the partner's shape tells
        other = _stored(get, names[partner])
        layout = other is not None and bool(_inputs_first(other.shape, inputs_first_shapes[partner], names[partner]))
    matrices = stacked.transpose(0, 2, 1) if layout else stacked  # [E, out, in]
    if own == "gate_up":
        matrices = matrices[:, :expert_size] if proj == "gate_proj" else matrices[:, expert_size:]
    return np.ascontiguousarray(matrices)


def fused_experts_tensors(get: TensorSource, config: ModelConfig) -> TensorSource:
    """``get`` also answering ``model.layers.N.mlp.experts.{gate,up,down}_proj`` (the stacked
    names ``stacked_experts`` asks for first) from fused experts, where a checkpoint has them."""
    if config.moe is None:
        return get
    hidden, expert_size = config.hidden_size, config.moe.expert_size

    def answer(name: str):
        match = _EXPERTS_RE.fullmatch(name)
        if match is None:
            return get(name)
        prefix, proj = match.groups()
        if proj != "down_proj":  # gate/up stacked apart: as they are
            found = get(name)
            if found is not None:
                return found
        # down_proj's name is the fused layout's own: its layout is read from the shapes.
        return fused_expert_projection(get, prefix, proj, hidden, expert_size)

    return answer
