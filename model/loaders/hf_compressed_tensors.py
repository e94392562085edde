"""compressed-tensors checkpoints (llm-compressor's exports, ``quant_method: compressed-tensors``).

``config_groups`` give layers (``targets``: module names, ``re:`` regexes, or the class
``Linear``) a weight scheme (num_bits, type int or float, symmetric, strategy tensor / channel /
group / block, group_size, block_structure); ``ignore`` keeps layers in floats; ``format`` (at
the top, or per group in mixed-precision exports) says how the weights are stored:

- ``pack-quantized`` (W4A16): ``weight_packed [out, ceil(in/8)]`` int32, value ``j`` of word
  ``i`` being input ``8i + j`` (low bits first), stored unsigned as ``q + 2^(bits-1)``;
  ``weight_scale [out, in/group]`` (``[out, 1]`` per channel, ``[1]`` per tensor); an asymmetric
  scheme's ``weight_zero_point`` is packed the same way along the outputs (``[ceil(out/8),
  groups]``; older exports keep it int8 ``[out, groups]``); ``weight_shape`` is ``[out, in]``;
  act-order adds ``weight_g_idx``. ``w = (q - z) * s``.
- ``int-quantized`` / ``naive-quantized``: an int8 ``weight`` with its scale (and zero point when
  asymmetric). W8A8 per channel or tensor is a ``QuantArray``; see hf_quantized for why its
  activations stay float.
- ``float-quantized``: a float8_e4m3fn ``weight``, scaled per tensor / channel (a
  ``QuantArray``), per block or per group (expanded to float32).

How each becomes a matrix: model/loaders/hf_quantized_matrix.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import numpy as np

from raylm.model.loaders.hf_quantized import FLOATS, INTS, Layer, QuantizedCheckpoint, row_scale
from raylm.model.loaders.hf_quantized_matrix import BlockScaled, IntGroups, RowScaled, unpack_words

# format -> (type, num_bits it reads)
_FORMATS = {
    "pack-quantized": ("int", (4, 8)),
    "int-quantized": ("int", (2, 3, 4, 5, 6, 7, 8)),
    "naive-quantized": ("int", (2, 3, 4, 5, 6, 7, 8)),
    "float-quantized": ("float", (8,)),
}
_WEIGHT_KEYS = frozenset({"num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic",
                          "actorder", "observer", "observer_kwargs", "scale_dtype", "zp_dtype"})
_GROUP_KEYS = frozenset({"targets", "weights", "input_activations", "output_activations", "format"})


def target_matches(module: str, target: str) -> bool:
    """compressed-tensors' rule: ``re:`` + a regex matched from the start, the class name
    ``Linear`` (every matrix the loader asks for is one), or the module's exact name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in ("Linear", module)


@dataclasses.dataclass(frozen=True)
class Scheme:
    """One config group's weight scheme."""

    format: str
    bits: int
    symmetric: bool
    strategy: str  # tensor | channel | group | block
    group_size: int | None
    block: tuple[int, int] | None


class CompressedTensors(QuantizedCheckpoint):
    method = "compressed-tensors"
    READ = frozenset({"quant_method", "format", "config_groups", "ignore", "quantization_status", "kv_cache_scheme",
                      "sparsity_config", "transform_config"})
    IGNORED = frozenset({"global_compression_ratio", "version", "provider", "run_compressed", "dequantize",
                         "use_optimized_inference"})

    def __init__(self, config: dict[str, Any], source: str):
        super().__init__(config, source)
        if config.get("quantization_status") not in (None, "compressed"):
            self.bad(f"quantization_status {config['quantization_status']!r} is not supported (raylm reads "
                     "compressed checkpoints)")
        sparsity = config.get("sparsity_config") or {}
        if sparsity.get("format", "dense") != "dense":
            self.bad(f"sparsity_config format {sparsity.get('format')!r} is not supported (raylm reads dense weights)")
        if config.get("transform_config"):
            self.bad("transform_config (rotations) is not supported")
        self.ignore = tuple(config.get("ignore") or ())
        self.groups: list[tuple[tuple[str, ...], Scheme]] = []
        for name, group in (config.get("config_groups") or {}).items():
            extra = sorted(set(group) - _GROUP_KEYS)
            if extra:
                self.bad(f"config_groups.{name}: {', '.join(extra)} (not implemented by raylm)")
            if group.get("weights") is None:
                continue  # activations only: raylm runs float activations (hf_quantized's docstring)
            self.groups.append((tuple(group.get("targets") or ()),
                                self._scheme(name, group["weights"], group.get("format") or config.get("format"))))

    def _scheme(self, name: str, weights: dict[str, Any], fmt: str | None) -> Scheme:
        where = f"config_groups.{name}.weights"
        extra = sorted(k for k, v in weights.items() if k not in _WEIGHT_KEYS and v not in (None, False, "", [], {}))
        if extra:
            self.bad(f"{where}: {', '.join(extra)} (not implemented by raylm)")
        if weights.get("dynamic"):
            self.bad(f"{where}.dynamic {weights['dynamic']!r}: weights quantized at run time are not supported")
        if fmt not in _FORMATS:
            self.bad(f"format {fmt!r} of config_groups.{name} is not supported (raylm reads {', '.join(_FORMATS)})")
        kind, widths = _FORMATS[fmt]
        bits, type_ = weights.get("num_bits", 8), str(weights.get("type", "int")).lower()
        if type_ != kind or bits not in widths:
            self.bad(f"{where}: {bits}-bit {type_} weights in the {fmt} format are not supported (it holds "
                     f"{'/'.join(map(str, widths))}-bit {kind} weights)")
        group_size = weights.get("group_size")
        strategy = weights.get("strategy") or (
            "tensor" if group_size is None else "group" if group_size > 0 else "channel")
        if strategy not in ("tensor", "channel", "group", "block"):
            self.bad(f"{where}.strategy {strategy!r} is not supported (raylm reads tensor, channel, group, block)")
        if strategy == "group" and not (isinstance(group_size, int) and group_size > 0):
            self.bad(f"{where}: strategy group needs a positive group_size, got {group_size!r}")
        block = None
        if strategy == "block":
            structure = weights.get("block_structure")
            if isinstance(structure, str):
                structure = structure.lower().split("x")
            try:
                block = (int(structure[0]), int(structure[1]))
            except (TypeError, ValueError, IndexError):
                self.bad(f"{where}.block_structure {weights.get('block_structure')!r} is not two block sizes")
            if type_ != "float":
                self.bad(f"{where}: block-scaled int weights are not supported")
        return Scheme(fmt, bits, bool(weights.get("symmetric", True)), strategy, group_size, block)

    def scheme_of(self, module: str) -> Scheme | None:
        if any(target_matches(module, t) for t in self.ignore):
            return None
        return next((s for targets, s in self.groups if any(target_matches(module, t) for t in targets)), None)

    def form(self, layer: Layer) -> IntGroups | RowScaled | BlockScaled | None:
        packed = layer.kind("weight_packed") is not None
        if not packed and layer.kind("weight") in (None, *FLOATS):
            return None
        stored = "weight_packed" if packed else "weight"
        scheme = self.scheme_of(layer.module)
        if scheme is None:
            layer.fail(stored, f"is stored quantized, but no config_groups entry targets {layer.module} (or ignore "
                               "lists it)")
        if packed != (scheme.format == "pack-quantized"):
            layer.fail(stored, f"is present, but config_groups give {layer.module} the {scheme.format} format")
        if scheme.format == "pack-quantized":
            return self._packed(layer, scheme)
        if scheme.format == "float-quantized":
            return self._floats(layer, scheme)
        return self._ints(layer, scheme)

    def _packed(self, layer: Layer, scheme: Scheme) -> IntGroups:
        per = 32 // scheme.bits
        packed = layer.need("weight_packed", ("I32",), (2,))
        out, size = packed.shape[0], packed.shape[1] * per
        shape = layer.optional("weight_shape", INTS, (1,))
        if shape is not None:
            if shape.shape != (2,) or int(shape[0]) != out:
                layer.fail("weight_shape", f"is {shape.tolist()}, but weight_packed has {out} rows")
            size = int(shape[1])
        layer.expect("weight_packed", packed, (out, -(-size // per)), f"{size} inputs, {per} to an int32")
        q = np.ascontiguousarray(unpack_words(packed, scheme.bits, 1)[:, :size])
        scale, groups = self._scales(layer, scheme, out, size, "weight_packed")
        zero = self._zeros(layer, scheme, out, scale.shape[1], 1 << (scheme.bits - 1), packed_bits=scheme.bits)
        return IntGroups(q, zero, scale, groups, scheme.bits)

    def _ints(self, layer: Layer, scheme: Scheme) -> IntGroups | RowScaled:
        weight = layer.need("weight", ("I8",), (2,))
        out, size = weight.shape
        scale, groups = self._scales(layer, scheme, out, size, "weight")
        zero = self._zeros(layer, scheme, out, scale.shape[1], 128)  # int8 values, shifted to q's unsigned domain
        if scheme.strategy in ("tensor", "channel") and np.all(zero == 128):
            return RowScaled(weight, scale[:, 0])
        return IntGroups((weight.astype(np.int16) + 128).astype(np.uint8), zero, scale, groups, 8)

    def _floats(self, layer: Layer, scheme: Scheme) -> RowScaled | BlockScaled:
        weight = layer.need("weight", ("F8_E4M3",), (2,))
        out, size = weight.shape
        zero = layer.optional("weight_zero_point", ("I8", *INTS, *FLOATS), (0, 1, 2))
        if zero is not None and np.any(zero.astype(np.float32) != 0):
            layer.fail("weight_zero_point", "is not zero: raylm reads symmetric float weights")
        if scheme.strategy == "block":
            rows, cols = scheme.block
            scale = layer.need("weight_scale", FLOATS, (2,))
            layer.expect("weight_scale", scale, (math.ceil(out / rows), math.ceil(size / cols)),
                         f"a scale per {rows}x{cols} block (block_structure) of the {out}x{size} weight")
            return BlockScaled(weight, scale, scheme.block)
        scale, groups = self._scales(layer, scheme, out, size, "weight")
        if scheme.strategy == "group":
            if not np.array_equal(groups, np.arange(size) // scheme.group_size):
                layer.fail("weight_g_idx", "reorders groups (act-order), which raylm reads for int weights only")
            return BlockScaled(weight, scale, (1, scheme.group_size))
        return RowScaled(weight, scale[:, 0])

    def _scales(self, layer: Layer, scheme: Scheme, out: int, size: int, stored: str) -> tuple[np.ndarray, np.ndarray]:
        """``weight_scale`` as ``[out, groups]`` (as stored: its dtype decides exactness) and each input's group."""
        scale = layer.need("weight_scale", FLOATS, (0, 1, 2))
        if scheme.strategy != "group":
            return row_scale(layer, "weight_scale", scale, out).reshape(out, 1), np.zeros(size, np.int64)
        group = scheme.group_size
        if size % group:
            layer.fail(stored, f"has {size} inputs, which group_size {group} does not divide")
        layer.expect("weight_scale", scale, (out, size // group), f"a scale per output and group of {group} inputs")
        g_idx = layer.optional("weight_g_idx", INTS, (1,))
        if g_idx is None:
            return scale, np.arange(size) // group
        layer.expect("weight_g_idx", g_idx, (size,), "a group per input")
        if size and (g_idx.min() < 0 or g_idx.max() >= size // group):
            layer.fail("weight_g_idx", f"names groups outside 0..{size // group - 1}")
        return scale, g_idx.astype(np.int64)

    def _zeros(self, layer: Layer, scheme: Scheme, out: int, num_groups: int, offset: int,
               packed_bits: int | None = None) -> np.ndarray:
        """Zero points ``[out, groups]`` in the values' unsigned domain (signed ones + ``offset``)."""
        zero = layer.optional("weight_zero_point", ("I8", *INTS), (0, 1, 2))
        if zero is None:
            if not scheme.symmetric:
                layer.fail("weight_zero_point", "is missing (the scheme is asymmetric: symmetric false)")
            return np.full((out, num_groups), offset, np.int32)
        if packed_bits is not None and zero.dtype == np.int32 and zero.ndim == 2 and \
                zero.shape == (-(-out // (32 // packed_bits)), num_groups):
            return unpack_words(zero, packed_bits, 0)[:out].astype(np.int32)  # stored unsigned, like the values
        if zero.size == 1:
            return np.full((out, num_groups), int(zero.reshape(())) + offset, np.int32)
        if zero.size == out * num_groups and zero.shape in ((out, num_groups), (out,)):
            return zero.reshape(out, num_groups).astype(np.int32) + offset
        layer.fail("weight_zero_point", f"has shape {tuple(zero.shape)}, expected ({out}, {num_groups}) or packed "
                                        f"along the outputs")
