"""HF checkpoints stored quantized for serving: config.json's ``quantization_config``.

Why: most checkpoints published for serving are AWQ, GPTQ, compressed-tensors (llm-compressor)
or FP8 exports, whose layers are int32 words of 4-bit values or 8-bit floats with scales; read
as float weights they are garbage. ``read_quantization`` reads the config once; its
``matrix`` turns one layer's stored tensors into the matrix HF means, held as
model/loaders/hf_quantized_matrix.py describes (blocks or 8-bit values where that is exact and a
kernel reads them, float32 otherwise). gpt-oss's release (MXFP4) packs its stacked experts
instead, which ``packed_experts`` reads (model/quantization/mxfp4.py).

The file says which layers are quantized: a layer holding the format's tensors (``qweight``,
``weight_packed``, or an 8-bit ``weight`` beside its scale) is read by the format; one holding a
float ``weight`` (embeddings, norms, usually the LM head, and the layers that
``modules_to_not_convert`` / ``ignore`` list) loads as floats. compressed-tensors' ``ignore``
and ``targets`` pick each quantized layer's scheme.

Activation-side settings are not reproduced: raylm runs every layer on float activations, so
``input_activations``, ``output_activations``, ``activation_scheme`` and ``kv_cache_scheme``
(and their ``input_scale`` / ``k_scale`` tensors) are ignored. A W8A8 checkpoint thus gives the
logits of its int8 weights times float activations, not of the int8 x int8 products a GPU
kernel would compute.

Each method's config keys are either read or listed as calibration / tooling metadata; any other
key with a value is an error naming it: a setting raylm does not implement never becomes a
silent default.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, NoReturn, Protocol

import numpy as np

from raylm.model.errors import ModelLoadError
from raylm.model.loaders.hf_quantized_matrix import (
    BlockScaled,
    Form,
    IntGroups,
    Matrix,
    RowScaled,
    unpack_words,
)
from raylm.model.quantization.gguf_blocks import dequantized
from raylm.model.quantization.mxfp4 import hf_mxfp4_blocks

FLOATS = ("F16", "BF16", "F32")
INTS = ("I32", "I64")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: field i of an int32 holds column AWQ_ORDER[i] of its 8
# Keys HF's shared GPTQ/AWQ config base writes (calibration and kernel choices: no effect on the weights).
_CALIBRATION = frozenset({
    "tokenizer", "dataset", "damp_percent", "damp_auto_increment", "act_group_aware", "true_sequential",
    "static_groups", "mse", "meta", "backend", "model_seqlen", "block_name_to_quantize",
    "module_name_preceding_first_block", "batch_size", "pad_token_id", "max_input_length", "cache_block_outputs",
    "modules_in_block_to_quantize", "use_exllama", "exllama_config", "use_cuda_fp16", "model_name_or_path",
    "model_file_base_name", "quantizer",
})
# Names of tensors only a quantized layer has (a checkpoint holding them needs a quantization_config).
QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".weight_packed", ".weight_scale", ".weight_scale_inv")


class Tensors(Protocol):
    """A checkpoint's tensors by name: ``dtype`` is safetensors' (``"I32"``, ``"F8_E4M3"``, ...)."""

    def dtype(self, name: str) -> str | None: ...

    def read(self, name: str) -> np.ndarray | None: ...


class Layer:
    """One layer's stored tensors, read with errors that name the tensor and the reason."""

    def __init__(self, module: str, tensors: Tensors, method: str):
        self.module, self.tensors, self.method = module, tensors, method

    def kind(self, suffix: str) -> str | None:
        return self.tensors.dtype(f"{self.module}.{suffix}")

    def fail(self, suffix: str, message: str) -> NoReturn:
        raise ModelLoadError(f"tensor {f'{self.module}.{suffix}'!r} ({self.method} checkpoint) {message}")

    def need(self, suffix: str, kinds: tuple[str, ...], ndims: tuple[int, ...]) -> np.ndarray:
        kind = self.kind(suffix)
        if kind is None:
            self.fail(suffix, f"is missing: layer {self.module} is stored quantized and needs it")
        if kind not in kinds:
            self.fail(suffix, f"is {kind}, expected {' or '.join(kinds)}")
        array = self.tensors.read(f"{self.module}.{suffix}")
        if array.ndim not in ndims:
            self.fail(suffix, f"has shape {tuple(array.shape)}, expected {' or '.join(f'{n}-D' for n in ndims)}")
        return array

    def optional(self, suffix: str, kinds: tuple[str, ...], ndims: tuple[int, ...]) -> np.ndarray | None:
        return None if self.kind(suffix) is None else self.need(suffix, kinds, ndims)

    def expect(self, suffix: str, array: np.ndarray, shape: tuple[int, ...], why: str) -> None:
        if tuple(array.shape) != tuple(shape):
            self.fail(suffix, f"has shape {tuple(array.shape)}, expected {tuple(shape)}: {why}")


class QuantizedCheckpoint:
    """One ``quant_method``: how its layers' tensors make a matrix."""

    method = ""
    READ: frozenset[str] = frozenset()  # config keys this method reads
    IGNORED: frozenset[str] = frozenset()  # config keys without effect on the weights

    def __init__(self, config: dict[str, Any], source: str):
        self.source = source
        unknown = sorted(k for k, v in config.items()
                         if k not in self.READ | self.IGNORED and v not in (None, False, "", [], {}))
        if unknown:
            self.bad(f"{', '.join(unknown)} (not implemented by raylm; it reads {', '.join(sorted(self.READ))})")

    def bad(self, what: str) -> NoReturn:
        raise ModelLoadError(f"{self.source}: quantization_config ({self.method}): {what}")

    def matrix(self, module: str, tensors: Tensors, keep: bool) -> Matrix | None:
        """The weight of layer ``module`` (``[out, in]``), or None when it is not stored quantized
        (then its ``.weight``, if any, is a float tensor). ``keep``: as stored where exact
        (float32 models on one device), else the float32 matrix."""
        form = self.form(Layer(module, tensors, self.method))
        return None if form is None else (form.stored() if keep else form.dense())

    def form(self, layer: Layer) -> Form | None:
        raise NotImplementedError

    def packed_experts(self, name: str, tensors: Tensors, keep: bool) -> Matrix | None:
        """Stacked experts stored packed under ``name`` (``*_blocks``, gpt-oss's MXFP4) as
        ``[E, out, in]``, or None: this method packs none."""
        return None

    def plain(self, layer: Layer) -> None:
        """A layer without this format's tensors: its ``weight`` must be floats (or absent)."""
        kind = layer.kind("weight")
        if kind is not None and kind not in (*FLOATS, "F64"):
            layer.fail("weight", f"is {kind} without the tensors a quantized {self.method} layer stores")
        return None

    def int_setting(self, config: dict[str, Any], key: str, allowed: tuple[int, ...] | None, default: Any) -> int:
        value = config.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or (allowed is not None and value not in allowed):
            choices = "a positive number or -1" if allowed is None else ", ".join(map(str, allowed))
            self.bad(f"{key} {value!r} is not supported (raylm reads {choices})")
        if allowed is None and value <= 0 and value != -1:
            self.bad(f"{key} {value!r} is not a group size (a positive number, or -1: one group)")
        return value


class Awq(QuantizedCheckpoint):
    """AutoAWQ's GEMM layout, 4-bit with zero points: ``qweight [in, out/8]`` and ``qzeros
    [in/group, out/8]`` int32 (field i of a word holds column AWQ_ORDER[i] of its 8), ``scales
    [in/group, out]``; ``w[out, in] = (q - z) * s``."""

    method = "awq"
    READ = frozenset({"quant_method", "bits", "group_size", "zero_point", "version", "format",
                      "modules_to_not_convert"})
    IGNORED = _CALIBRATION | {"desc_act", "sym", "do_fuse", "fuse_max_seq_len", "modules_to_fuse"}

    def __init__(self, config: dict[str, Any], source: str):
        super().__init__(config, source)
        self.bits = self.int_setting(config, "bits", (4,), None)
        self.group_size = self.int_setting(config, "group_size", None, None)
        if config.get("zero_point", True) is not True:
            self.bad("zero_point false is not supported (AWQ GEMM checkpoints store zero points)")
        layout = str(config.get("version") or config.get("format") or "gemm").lower()
        if layout != "gemm":
            self.bad(f"version/format {layout!r} is not supported (raylm reads AutoAWQ's gemm layout)")

    def form(self, layer: Layer) -> IntGroups | None:
        if layer.kind("qweight") is None:
            return self.plain(layer)
        qweight = layer.need("qweight", ("I32",), (2,))
        qzeros = layer.need("qzeros", ("I32",), (2,))
        scales = layer.need("scales", FLOATS, (2,))
        num_groups, out = scales.shape
        group = qweight.shape[0] if self.group_size == -1 else self.group_size
        if out % 8:
            layer.fail("scales", f"has {out} outputs, which int32 words of 8 4-bit values cannot pack")
        expected = (num_groups * group, out // 8)
        if tuple(qweight.shape) != expected:
            rows = qweight.shape[0]
            whole = "" if rows % group == 0 else f"; {rows} inputs are not whole groups of {group}"
            layer.fail("qweight", f"has shape {tuple(qweight.shape)}, expected {expected}: scales "
                                  f"{tuple(scales.shape)} hold {num_groups} groups of group_size {group} inputs and "
                                  f"{out} outputs, 8 to an int32{whole}")
        layer.expect("qzeros", qzeros, (num_groups, out // 8), "a zero per group and output, 8 to an int32")
        q = unpack_words(qweight, 4, 1, AWQ_ORDER).T
        zero = unpack_words(qzeros, 4, 1, AWQ_ORDER).T.astype(np.int32)
        return IntGroups(np.ascontiguousarray(q), zero, scales.T, np.arange(qweight.shape[0]) // group, 4)


class Gptq(QuantizedCheckpoint):
    """AutoGPTQ / GPTQModel: ``qweight [in*bits/32, out]`` (values packed along the inputs, low
    bits first), ``qzeros [groups, out*bits/32]`` (along the outputs), ``scales [groups, out]``,
    ``g_idx [in]`` (each input's group; act-order reorders them). The classic format (``gptq``,
    v1) stores zeros minus one: ``w = s * (q - (z + 1))``; ``gptq_v2`` stores ``z``."""

    method = "gptq"
    READ = frozenset({"quant_method", "bits", "group_size", "desc_act", "sym", "format", "checkpoint_format",
                      "lm_head", "pack_dtype", "modules_to_not_convert"})
    IGNORED = _CALIBRATION

    def __init__(self, config: dict[str, Any], source: str):
        super().__init__(config, source)
        self.bits = self.int_setting(config, "bits", (4, 8), None)
        self.group_size = self.int_setting(config, "group_size", None, None)
        self.desc_act = bool(config.get("desc_act", False))
        layout = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
        if layout not in ("gptq", "gptq_v2"):
            self.bad(f"checkpoint_format/format {layout!r} is not supported (raylm reads gptq and gptq_v2)")
        self.zero_bias = 1 if layout == "gptq" else 0
        if str(config.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            self.bad(f"pack_dtype {config['pack_dtype']!r} is not supported (raylm reads int32 words)")

    def form(self, layer: Layer) -> IntGroups | None:
        if layer.kind("qweight") is None:
            return self.plain(layer)
        per = 32 // self.bits
        qweight = layer.need("qweight", ("I32",), (2,))
        qzeros = layer.need("qzeros", ("I32",), (2,))
        scales = layer.need("scales", FLOATS, (2,))
        g_idx = layer.optional("g_idx", INTS, (1,))
        out = scales.shape[1]
        inputs = qweight.shape[0] * per
        num_groups = 1 if self.group_size == -1 else -(-inputs // self.group_size)
        layer.expect("qweight", qweight, (inputs // per, out), f"scales {tuple(scales.shape)} hold {out} outputs")
        layer.expect("scales", scales, (num_groups, out), f"{inputs} inputs in groups of group_size {self.group_size}")
        if out % per:
            layer.fail("qzeros", f"cannot pack {out} outputs {per} to an int32")
        layer.expect("qzeros", qzeros, (num_groups, out // per), f"a zero per group and output, {per} to an int32")
        if g_idx is None:
            if self.desc_act:
                layer.fail("g_idx", "is missing (desc_act: true)")
            groups = np.arange(inputs) // (inputs if self.group_size == -1 else self.group_size)
        else:
            layer.expect("g_idx", g_idx, (inputs,), "a group per input")
            if inputs and (g_idx.min() < 0 or g_idx.max() >= num_groups):
                layer.fail("g_idx", f"names groups outside 0..{num_groups - 1}")
            groups = g_idx.astype(np.int64)
        q = unpack_words(qweight, self.bits, 0).T
        zero = unpack_words(qzeros, self.bits, 1).T.astype(np.int32) + self.zero_bias
        return IntGroups(np.ascontiguousarray(q), zero, scales.T, groups, self.bits)


def row_scale(layer: Layer, suffix: str, scale: np.ndarray, out: int) -> np.ndarray:
    """A per-tensor (``[]``, ``[1]``) or per-output-row (``[out, 1]``, ``[out]``) scale, per row."""
    if scale.size == 1:
        return np.full(out, scale.reshape(()), np.float32)
    if tuple(scale.shape) in ((out, 1), (out,)):
        return scale.reshape(out)
    layer.fail(suffix, f"has shape {tuple(scale.shape)}, expected a scale per tensor ([] or [1]) or per output row "
                       f"([{out}, 1])")


class Fp8(QuantizedCheckpoint):
    """HF transformers' FineGrainedFP8 (DeepSeek-V3, Qwen3 FP8): ``weight`` float8_e4m3fn with
    ``weight_scale_inv [ceil(out/128), ceil(in/128)]`` (``weight_block_size``; a scalar when the
    size is null), which multiplies, or (AutoFP8) ``weight_scale`` per tensor or output row."""

    method = "fp8"
    READ = frozenset({"quant_method", "activation_scheme", "weight_block_size", "modules_to_not_convert",
                      "ignored_layers", "fmt", "scale_fmt", "expert_dtype", "dequantize", "modules_to_convert"})

    def __init__(self, config: dict[str, Any], source: str):
        super().__init__(config, source)
        block = config.get("weight_block_size", (128, 128))  # HF's default when the key is absent
        if block is not None and not (isinstance(block, (list, tuple)) and len(block) == 2
                                      and all(isinstance(n, int) and n > 0 for n in block)):
            self.bad(f"weight_block_size {block!r} is not two positive sizes")
        self.block = None if block is None else (block[0], block[1])
        for key, allowed in (("fmt", "e4m3"), ("scale_fmt", "float"), ("expert_dtype", "fp8")):
            if config.get(key, allowed) != allowed:
                self.bad(f"{key} {config[key]!r} is not supported (raylm reads {allowed})")
        if config.get("modules_to_convert"):
            self.bad("modules_to_convert (fp8 embeddings) is not supported")
        if config.get("activation_scheme", "dynamic") not in ("dynamic", "static"):  # activation-side: not run
            self.bad(f"activation_scheme {config['activation_scheme']!r} is neither dynamic nor static")

    def form(self, layer: Layer) -> RowScaled | BlockScaled | None:
        if layer.kind("weight") != "F8_E4M3":
            return self.plain(layer)
        weight = layer.need("weight", ("F8_E4M3",), (2,))
        out, size = weight.shape
        if layer.kind("weight_scale") is not None:
            scale = layer.need("weight_scale", FLOATS, (0, 1, 2))
            return RowScaled(weight, row_scale(layer, "weight_scale", scale, out))
        if layer.kind("weight_scale_inv") is None:
            layer.fail("weight_scale_inv", "is missing: an fp8 weight needs weight_scale_inv (or weight_scale)")
        scale = layer.need("weight_scale_inv", FLOATS, (0, 1, 2))
        if self.block is None:
            return RowScaled(weight, row_scale(layer, "weight_scale_inv", scale, out))
        rows, cols = self.block
        layer.expect("weight_scale_inv", scale, (math.ceil(out / rows), math.ceil(size / cols)),
                     f"a scale per {rows}x{cols} block (weight_block_size) of the {out}x{size} weight")
        return BlockScaled(weight, scale, self.block)


class Mxfp4(QuantizedCheckpoint):
    """transformers' Mxfp4Config (the gpt-oss release): the experts' ``gate_up_proj`` and
    ``down_proj`` stored as ``*_blocks`` and ``*_scales`` (model/quantization/mxfp4.py), every
    ``.weight`` in floats (``modules_to_not_convert`` lists them)."""

    method = "mxfp4"
    READ = frozenset({"quant_method", "modules_to_not_convert"})
    IGNORED = frozenset({"dequantize"})  # transformers' choice of kernel or expansion at load

    def form(self, layer: Layer) -> None:
        return self.plain(layer)

    def packed_experts(self, name: str, tensors: Tensors, keep: bool) -> Matrix | None:
        if not name.endswith("_blocks"):
            return None
        blocks = tensors.read(name)
        if blocks is None:
            return None
        scales_name = name.removesuffix("_blocks") + "_scales"
        scales = tensors.read(scales_name)
        if scales is None:
            raise ModelLoadError(f"{self.source}: {name!r} has no {scales_name!r} (MXFP4 keeps a scale per 32 weights)")
        try:
            matrix = hf_mxfp4_blocks(blocks, scales)
        except ValueError as err:
            raise ModelLoadError(f"tensor {name!r} ({self.method} checkpoint): {err}") from None
        return matrix if keep else dequantized(matrix)


def method_of(path: Path) -> str | None:
    """The checkpoint directory's ``quant_method`` (None: stored in floats)."""
    config = _quantization_config(path)
    return None if config is None else str(config.get("quant_method", "")).lower()


def read_quantization(path: Path) -> QuantizedCheckpoint | None:
    """How the checkpoint at ``path`` stores its quantized layers (None: it has none)."""
    from raylm.model.loaders.hf_compressed_tensors import CompressedTensors

    config = _quantization_config(path)
    if config is None:
        return None
    methods = {"awq": Awq, "gptq": Gptq, "fp8": Fp8, "compressed-tensors": CompressedTensors, "mxfp4": Mxfp4}
    method = str(config.get("quant_method", "")).lower()
    if method not in methods:
        raise ModelLoadError(f"{path}: quantization_config's quant_method {config.get('quant_method')!r} is not "
                             f"supported (raylm reads {', '.join(methods)})")
    return methods[method](config, str(path))


def _quantization_config(path: Path) -> dict[str, Any] | None:
    """config.json's ``quantization_config`` (None without one, or without a config.json: the
    config loader reports that)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    try:
        config = json.loads(file.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError, AttributeError) as err:
        raise ModelLoadError(f"cannot read {path}/config.json: {err}") from None
    if config is not None and not isinstance(config, dict):
        raise ModelLoadError(f"{path}/config.json: quantization_config is not a mapping: {config!r}")
    return config

