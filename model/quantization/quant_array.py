"""Weight-only quantization: 8-bit matrices with float32 scales per output channel or per group.

``model.quantization: int8 | fp8`` stores every linear layer and the (tied) embedding / LM
head as a ``QuantArray`` at load time. At decode batch sizes a step is bound by reading
weights, so a quarter of float32's bytes is most of the speed-up; the C++ matmul kernel
reads the 8-bit values and widens them in registers (model/kernels/dense.py), XLA's dot converts
them where the kernel does not run. Scales are per output channel (one per row of the
``[out..., in...]`` layout, see model/decoder/params.py): int8 maps each row's absolute maximum to
127, fp8 (e4m3fn) to 448, its largest finite value. A channel of zeros gets scale 1 so it
stays exactly zero.

``int8_g32`` keeps a scale per group of 32 consecutive inputs instead (absmax / 127 of the
group): an outlier then coarsens 31 neighbours, not its whole row. That is GGUF's Q8_0 layout
with float32 scales, so the matrices are ``GgufBlocks`` (model/quantization/gguf_blocks.py) and run through
the block kernels, decode rows and prompt chunks alike; like GGUF blocks, one device only.
Matrices whose inputs are not whole groups of 32 are an error naming the scheme to use instead.

The KV pool can be 8-bit too (model/decoder/attention.py): a ``QuantArray`` whose one input dim is
the head dim, so it has a scale per (token, kv head).

The activations stay in the model dtype (W8A16 / W8A32): with int8 activations XLA's CPU
dot (s8 x s8 -> s32) measured slower than converting the weights (see
benchmarks/quantization_bench.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from raylm.model.decoder.params import LAYER_MATRIX_INPUT_DIMS, MODEL_MATRIX_INPUT_DIMS, LayerParams, ModelParams
from raylm.model.quantization.gguf_blocks import GgufBlocks

Scheme = Literal["int8", "int8_g32", "fp8"]
SCHEMES: tuple[str, ...] = ("none", "int8", "int8_g32", "fp8")
GROUP = 32  # int8_g32: inputs per scale (GGUF's block, so the block kernels run it)
# Largest magnitude each storage type holds (the value a row's absolute maximum maps to).
_RANGE = {"int8": 127.0, "fp8": float(jnp.finfo(jnp.float8_e4m3fn).max)}
_STORAGE = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
QUANTIZED_DTYPES: tuple[jnp.dtype, ...] = tuple(jnp.dtype(t) for t in _STORAGE.values())


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantArray:
    """An 8-bit matrix ``q [N..., K...]`` and its float32 ``scale [N...]``: ``w = q * scale``.

    ``scale`` has the output dims of ``q``; how many trailing dims are inputs is the number
    ``scale`` lacks, so a QuantArray carries everything ``model.kernels.dense`` needs.
    """

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def num_input_dims(self) -> int:
        return self.q.ndim - self.scale.ndim

    @property
    def scheme(self) -> Scheme:
        return "int8" if self.q.dtype == jnp.int8 else "fp8"

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes)

    def dequantize(self, dtype: jnp.dtype = jnp.float32) -> jax.Array:
        """The full-precision matrix (for references and for XLA paths that need one)."""
        scale = self.scale.reshape(*self.scale.shape, *(1,) * self.num_input_dims)
        return (self.q.astype(jnp.float32) * scale).astype(dtype)

    def rows(self, index: jax.Array | tuple[jax.Array, ...], dtype: jnp.dtype) -> jax.Array:
        """Entries ``index`` of the output dims with their inputs, dequantized: the embedding
        lookup (token ids into ``[V, D]``), a KV pool's gather (layer and block ids)."""
        return (self.q[index].astype(jnp.float32) * self.scale[index][..., None]).astype(dtype)


@functools.partial(jax.jit, static_argnames=("scheme", "num_input_dims"))
def quantize(
    w: jax.Array | np.ndarray | GgufBlocks, scheme: Scheme, num_input_dims: int = 1
) -> QuantArray | GgufBlocks:
    """Quantize ``w [N..., K...]`` (the last ``num_input_dims`` dims are inputs) per output
    channel (a ``QuantArray``), or per group of 32 inputs for ``int8_g32`` (``GgufBlocks``).

    Computed in float32, jitted (a model's matrices share a few shapes). GGUF blocks are
    dequantized first (exactly, so the result is that of the expanded matrix).
    """
    if scheme not in _RANGE and scheme != "int8_g32":
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {', '.join(SCHEMES[1:])}")
    w = w.dequantize() if isinstance(w, GgufBlocks) else w.astype(jnp.float32)
    if not 0 < num_input_dims < w.ndim:
        raise ValueError(f"a {w.ndim}-D weight cannot have {num_input_dims} input dims")
    flat = w.reshape(*w.shape[: w.ndim - num_input_dims], math.prod(w.shape[w.ndim - num_input_dims:]))
    if scheme == "int8_g32":
        return _quantize_groups(flat, w.shape[w.ndim - num_input_dims:])
    absmax = jnp.max(jnp.abs(flat), axis=-1)
    scale = jnp.where(absmax > 0, absmax / _RANGE[scheme], 1.0).astype(jnp.float32)
    scaled = flat / scale[..., None]
    if scheme == "int8":
        q = jnp.clip(jnp.round(scaled), -127, 127).astype(jnp.int8)
    else:  # round to nearest even by the cast; clipped so no rounding lands past the range
        q = jnp.clip(scaled, -_RANGE[scheme], _RANGE[scheme]).astype(_STORAGE[scheme])
    return QuantArray(q.reshape(w.shape), scale)


def _quantize_groups(flat: jax.Array, input_shape: tuple[int, ...]) -> GgufBlocks:
    """``flat [N..., K]`` as int8 with a float32 scale per 32 inputs, in GGUF's Q8_0 layout."""
    size = flat.shape[-1]
    if size % GROUP:
        raise ValueError(f"int8_g32 scales groups of {GROUP} inputs; a matrix with {size} inputs is not whole groups "
                         "(use quantization int8)")
    groups = flat.reshape(*flat.shape[:-1], size // GROUP, GROUP)
    absmax = jnp.max(jnp.abs(groups), axis=-1)
    scale = jnp.where(absmax > 0, absmax / _RANGE["int8"], 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(groups / scale[..., None]), -127, 127).astype(jnp.int8)
    return GgufBlocks(q.reshape(flat.shape), scale, jnp.zeros((*flat.shape[:-1], 0), jnp.float32), tuple(input_shape))


def parse_quantization(value: str | None) -> Scheme | None:
    """``None`` / ``"none"`` -> None, else the scheme (unknown names are an error naming the setting)."""
    if value is None or value == "none":
        return None
    if value not in SCHEMES:
        raise ValueError(f"quantization must be one of {', '.join(SCHEMES)}, got {value!r}")
    return value  # type: ignore[return-value]


def quantize_params(params: ModelParams, scheme: Scheme) -> ModelParams:
    """Every matrix of ``params`` (projections, embedding, LM head) as a ``QuantArray``;
    norms and biases stay in the model dtype. Layer by layer, so at most one layer's float32
    intermediates exist at a time beside the input."""

    def layer(lp: LayerParams) -> LayerParams:
        return dataclasses.replace(
            lp,
            **{f: quantize(getattr(lp, f), scheme, n) for f, n in LAYER_MATRIX_INPUT_DIMS.items()
               if getattr(lp, f) is not None},
        )

    matrices = {
        f: quantize(getattr(params, f), scheme, n)
        for f, n in MODEL_MATRIX_INPUT_DIMS.items()
        if getattr(params, f) is not None
    }
    return dataclasses.replace(params, layers=tuple(layer(lp) for lp in params.layers), **matrices)


def weight_bytes(params: ModelParams) -> int:
    """Bytes the parameters hold (8-bit matrices and their scales counted as stored)."""
    return sum(int(leaf.nbytes) for leaf in jax.tree_util.tree_leaves(params))
