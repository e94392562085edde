"""gpt-oss's experts and router as HF stores them, into the decoder's stacked layout.

HF's GptOssExperts keeps each layer's experts as three stacked tensors with their inputs
first: ``mlp.experts.gate_up_proj [E, D, 2I]`` with gate and up interleaved along the last
dim (even columns gate, odd columns up), ``mlp.experts.down_proj [E, I, D]``, and their
biases ``gate_up_proj_bias [E, 2I]`` (interleaved the same way) and ``down_proj_bias [E, D]``;
the router is ``mlp.router.weight [E, D]`` with ``mlp.router.bias [E]``. The decoder reads
``w_experts_gate_up [E, 2, I, D]`` (gate, then up; outputs first), ``w_experts_down [E, D, I]``
and ``b_experts_gate_up [E, 2, I]`` (model/decoder/params.py).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from raylm.model.config.model_config import ModelConfig

# Reads HF tensor ``name`` checked against ``shape`` (hf_tensors.build_params' ``fetch``).
Fetch = Callable[[str, tuple[int, ...]], np.ndarray]


def deinterleaved_gate_up(gate_up: np.ndarray) -> np.ndarray:
    """``[..., 2I]`` with gate and up alternating -> ``[..., 2, I]`` (gate, then up)."""
    return np.stack([gate_up[..., ::2], gate_up[..., 1::2]], axis=-2)


def gpt_oss_moe_fields(fetch: Fetch, config: ModelConfig, layer: int) -> dict[str, np.ndarray]:
    """Layer ``layer``'s router, router bias, experts and expert biases as LayerParams fields
    (float32)."""
    E, I, D = config.moe.num_experts, config.moe.expert_size, config.hidden_size
    prefix = f"model.layers.{layer}.mlp."

    def read(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return np.asarray(fetch(prefix + name, shape), np.float32)

    gate_up = deinterleaved_gate_up(read("experts.gate_up_proj", (E, D, 2 * I)))  # [E, D, 2, I]
    return dict(
        router=read("router.weight", (E, D)),
        router_bias=read("router.bias", (E,)),
        w_experts_gate_up=np.ascontiguousarray(gate_up.transpose(0, 2, 3, 1)),
        b_experts_gate_up=deinterleaved_gate_up(read("experts.gate_up_proj_bias", (E, 2 * I))),
        w_experts_down=np.ascontiguousarray(read("experts.down_proj", (E, I, D)).transpose(0, 2, 1)),
        b_experts_down=read("experts.down_proj_bias", (E, D)),
    )
