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


class Int8Packer:
    """Packs a model's matrices for the integer kernel as they are handed to it, layer by layer,
    counting them. Why a packer rather than one pass over a loaded model: the loader hands it each
    decoder layer as soon as the layer is read (``model.loaders.load.load_model``), so a process
    holds one layer's stored form beside the packed ones. Packed after the whole load, every stored
    matrix and its packed copy were held at once: an 8B Q4_K_M peaked at 2.2x its resident size.
    Raises ``ValueError`` at once when the kernel cannot run here (before any weight is read)."""

    def __init__(self) -> None:
        if (reason := unavailable_reason()) is not None:
            raise ValueError(f"activation_quantization int8 cannot run here: {reason}")
        self.packed = 0

    def _pack(self, matrix: object, stacked: bool = False) -> object:
        if not takes_int8_activations(matrix):
            return matrix
        self.packed += 1
        return (pack_int8_experts if stacked else pack_int8_panels)(matrix)  # type: ignore[arg-type]

    def layer(self, lp: LayerParams) -> LayerParams:
        """``lp`` with every matrix the kernel reads packed (its stored form is dropped)."""
        return dataclasses.replace(lp, **{f: self._pack(getattr(lp, f), f in _STACKED_EXPERTS)
                                          for f in LAYER_MATRIX_INPUT_DIMS if f not in _NOT_PACKED})

    def finish(self, params: ModelParams, model_name: str, layers_packed: bool) -> ModelParams:
        """``params`` with the model's own matrices (the head) packed, and its layers too unless
        ``layers_packed`` (``layer`` packed each as it loaded); raises ``ValueError`` when the
        model had no matrix to pack, since the setting would change nothing."""
        layers = params.layers if layers_packed else tuple(self.layer(lp) for lp in params.layers)
        params = dataclasses.replace(params, layers=layers,
                                     **{f: self._pack(getattr(params, f)) for f in MODEL_MATRIX_INPUT_DIMS})
        if not self.packed:
            raise ValueError(
                f"activation_quantization int8 computes GGUF Q2_K..Q6_K/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/IQ4 blocks and int8 "
                f"weights in integers, and {model_name} has none (its matrices are float, fp8 or other block types): "
                "serve such a .gguf file with gguf_blocks keep/auto, or set quantization int8 or int8_g32, or leave "
                "activation_quantization none")
        return params


def with_int8_activations(params: ModelParams, model_name: str) -> ModelParams:
    """``params`` of a loaded model with every matrix the integer kernel reads packed for it (see
    the module docstring and ``Int8Packer``, which ``load_model`` uses to pack while it loads)."""
    return Int8Packer().finish(params, model_name, layers_packed=False)
