"""gpt-oss's experts and router as HF stores them, into the decoder's stacked layout.

HF's GptOssExperts keeps each layer's experts as three stacked tensors with their inputs
first: ``mlp.experts.gate_up_proj [E, D, 2I]`` with gate and up interleaved along the last
dim (even columns gate, odd columns up), ``mlp.experts.down_proj [E, I, D]``, and their
biases ``gate_up_proj_bias [E, 2I]`` (interleaved the same way) and ``down_proj_bias [E, D]``;
the router is ``mlp.router.weight [E, D]`` with ``mlp.router.bias [E]``. The openai release
stores the two matrices in MXFP4 instead, outputs first (``gate_up_proj_blocks [E, 2I, D/32,
16]`` and ``_scales``; the checkpoint loader answers ``*_blocks`` with the ``[E, out, in]``
matrix, as blocks or floats: model/quantization/mxfp4.py). The decoder reads
``w_experts_gate_up [E, 2, I, D]`` (gate, then up; outputs first), ``w_experts_down [E, D, I]``
and ``b_experts_gate_up [E, 2, I]`` (model/decoder/params.py).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from raylm.model.config.model_config import ModelConfig
from raylm.model.errors import ModelLoadError
from raylm.model.quantization.gguf_blocks import GgufBlocks, map_rows

# Answers an HF tensor name with its array (or blocks), None when the checkpoint lacks it.
TensorSource = Callable[[str], "np.ndarray | GgufBlocks | None"]


def deinterleaved_gate_up(gate_up: np.ndarray) -> np.ndarray:
    """``[..., 2I]`` with gate and up alternating -> ``[..., 2, I]`` (gate, then up)."""
    return np.stack([gate_up[..., ::2], gate_up[..., 1::2]], axis=-2)


def _float(array: np.ndarray | GgufBlocks, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if not isinstance(array, np.ndarray) or tuple(array.shape) != shape:
        raise ModelLoadError(f"tensor {name!r} has shape {tuple(array.shape)}, expected {shape}")
    return np.asarray(array, np.float32)


def _experts(get: TensorSource, name: str, E: int, out: int, size: int) -> np.ndarray | GgufBlocks:
    """The stacked experts' matrix ``name`` as ``[E, out, size]``: HF's float tensor (inputs
    first, transposed here) or the MXFP4 one the loader answers for ``name + "_blocks"``."""
    plain = get(name)
    if plain is not None:
        return np.ascontiguousarray(_float(plain, name, (E, size, out)).transpose(0, 2, 1))
    stored = get(name + "_blocks")
    if stored is None:
        raise ModelLoadError(f"tensor {name!r} (or MXFP4 {name}_blocks / _scales) is missing")
    if tuple(stored.shape) != (E, out, size):
        raise ModelLoadError(f"tensor {name}_blocks holds experts of shape {tuple(stored.shape)}, "
                             f"expected {(E, out, size)}")
    return stored if isinstance(stored, GgufBlocks) else np.asarray(stored, np.float32)


def _gate_up(get: TensorSource, prefix: str, E: int, I: int, D: int) -> np.ndarray | GgufBlocks:
    """The experts' gate and up matrices ``[E, 2, I, D]`` (gate first): stacked from the two
    halves where the checkpoint holds them apart (llama.cpp's files: model/loaders/gguf_gpt_oss.py),
    else HF's ``gate_up_proj`` with its rows alternating gate, up."""
    gate, up = (get(f"{prefix}experts.{half}_blocks") for half in ("gate_proj", "up_proj"))
    if gate is not None and up is not None:
        for name, half in (("gate_proj", gate), ("up_proj", up)):
            if tuple(half.shape) != (E, I, D):
                raise ModelLoadError(f"tensor {prefix}experts.{name} holds experts of shape {tuple(half.shape)}, "
                                     f"expected {(E, I, D)}")
        return map_rows(lambda g, u: np.stack([g, u], axis=1), gate, up)
    gate_up = _experts(get, prefix + "experts.gate_up_proj", E, 2 * I, D)  # rows alternate gate, up
    return map_rows(lambda a: np.ascontiguousarray(a.reshape(E, I, 2, a.shape[-1]).transpose(0, 2, 1, 3)), gate_up)


def _gate_up_bias(get: TensorSource, prefix: str, vector: Callable[[str, tuple[int, ...]], np.ndarray],
                  E: int, I: int) -> np.ndarray:
    """The experts' gate and up biases ``[E, 2, I]``: apart, or HF's interleaved ``gate_up_proj_bias``."""
    gate = get(f"{prefix}experts.gate_proj_bias")
    if gate is None:
        return deinterleaved_gate_up(vector("experts.gate_up_proj_bias", (E, 2 * I)))
    return np.stack([_float(gate, f"{prefix}experts.gate_proj_bias", (E, I)), vector("experts.up_proj_bias", (E, I))],
                    axis=1)


def gpt_oss_moe_fields(get: TensorSource, config: ModelConfig, layer: int) -> dict[str, np.ndarray | GgufBlocks]:
    """Layer ``layer``'s router (and its bias, as ``config.moe.router_bias`` says), experts and
    expert biases as LayerParams fields (float32, or the experts as MXFP4 blocks)."""
    E, I, D = config.moe.num_experts, config.moe.expert_size, config.hidden_size
    prefix = f"model.layers.{layer}.mlp."

    def vector(name: str, shape: tuple[int, ...]) -> np.ndarray:
        array = get(prefix + name)
        if array is None:
            raise ModelLoadError(f"tensor {prefix + name!r} is missing (expected shape {shape})")
        return _float(array, prefix + name, shape)

    fields = dict(
        router=vector("router.weight", (E, D)),
        w_experts_gate_up=_gate_up(get, prefix, E, I, D),
        b_experts_gate_up=_gate_up_bias(get, prefix, vector, E, I),
        w_experts_down=_experts(get, prefix + "experts.down_proj", E, D, I),
        b_experts_down=vector("experts.down_proj_bias", (E, D)),
    )
    if config.moe.router_bias:
        fields["router_bias"] = vector("router.bias", (E,))
    return fields
