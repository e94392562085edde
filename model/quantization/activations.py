"""``model.activation_quantization``: which matrices the integer compute mode multiplies.

``none`` (the default) keeps every product exact: float32 sums over the weights as stored. ``int8``
repacks every dense matrix the integer kernel reads (GGUF blocks with a scale per 32 weights: Q4_0,
Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0, IQ4_NL, IQ4_XS; Q6_K, Q3_K and Q2_K's int8 scales per 16 under a
super-block scale; ``int8_g32`` and per-row ``int8`` weights) into its layout (model/quantization/int8_panels.py), so that ``model.kernels.dense``
quantizes its activations to int8 per block of 32 and sums in integers, as llama.cpp does
(model/kernels/int8_matmul.py). A mixture of experts' stacked experts of those types are packed
expert by expert into one stack (``pack_int8_experts``), which model/kernels/grouped_matmul.py hands to
the integer kernel's grouped form. A float, fp8 or otherwise unsupported matrix stays in the exact
mode; a model with no such matrix at all is an error, since the setting would change nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from raylm.model.decoder.params import LAYER_MATRIX_INPUT_DIMS, MODEL_MATRIX_INPUT_DIMS, LayerParams, ModelParams
from raylm.model.kernels.int8_matmul import takes_int8_activations, unavailable_reason
from raylm.model.quantization.int8_panels import pack_int8_experts, pack_int8_panels

ActivationQuantization = Literal["none", "int8"]
ACTIVATION_QUANTIZATIONS: tuple[str, ...] = ("none", "int8")
# Latent attention's kv_b_proj is contracted per head by its absorbed form
# (model/decoder/latent_attention.py), not by a kernel.
_NOT_PACKED = frozenset({"wkv_b"})
_STACKED_EXPERTS = frozenset({"w_experts_gate_up", "w_experts_down"})  # [E, N..., K]: grouped_matmul's


def parse_activation_quantization(value: str | None) -> ActivationQuantization:
    """``None`` -> ``"none"``; an unknown name is an error naming the setting and its choices."""
    if value is None:
        return "none"
    if value not in ACTIVATION_QUANTIZATIONS:
        raise ValueError(f"activation_quantization must be one of {', '.join(ACTIVATION_QUANTIZATIONS)}, "
                         f"got {value!r}")
    return value  # type: ignore[return-value]


def with_int8_activations(params: ModelParams, model_name: str) -> ModelParams:
    """``params`` with every matrix the integer kernel reads packed for it (see the module
    docstring; the stored form is dropped, so memory stays that of the stored weights); raises
    ``ValueError`` when there is none, or when the kernel cannot run here."""
    if (reason := unavailable_reason()) is not None:
        raise ValueError(f"activation_quantization int8 cannot run here: {reason}")
    packed = 0

    def pack(matrix: object, stacked: bool = False) -> object:
        nonlocal packed
        if not takes_int8_activations(matrix):
            return matrix
        packed += 1
        return (pack_int8_experts if stacked else pack_int8_panels)(matrix)  # type: ignore[arg-type]

    def layer(lp: LayerParams) -> LayerParams:
        return dataclasses.replace(lp, **{f: pack(getattr(lp, f), f in _STACKED_EXPERTS)
                                          for f in LAYER_MATRIX_INPUT_DIMS if f not in _NOT_PACKED})

    params = dataclasses.replace(params, layers=tuple(layer(lp) for lp in params.layers),
                                 **{f: pack(getattr(params, f)) for f in MODEL_MATRIX_INPUT_DIMS})
    if not packed:
        raise ValueError(
            f"activation_quantization int8 computes GGUF Q2_K..Q6_K/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4 blocks and int8 weights in "
            "integers, and "
            f"{model_name} has none (its matrices are float, fp8 or other block types): serve such a .gguf file with "
            "gguf_blocks keep/auto, or set quantization int8 or int8_g32, or leave activation_quantization none")
    return params
