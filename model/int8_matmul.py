"""The integer compute mode's matmul: int8 activations against 4- and 8-bit weights as stored.

``model.activation_quantization: int8`` (model/activation_quantization.py marks the weights)
trades the exact mode's float32 arithmetic for llama.cpp's: each activation row is quantized
per block of 32 inputs to int8 (scale ``max|x| / 127``, round to nearest even), each block's
products are summed in integers against the stored weight integers (GGUF Q4_0 / Q4_1 / Q8_0
blocks, ``int8_g32`` matrices, int8 with a scale per output row), and only the block sums are
scaled in float32. On AVX-512 VNNI one instruction does 64 multiply-adds where float32 does 16
(model/kernels/int8_matmul.cc says how, and why a row's result does not depend on the batch).

The result is not the float32 product: an activation moves by up to half its block's step
(``max|x| / 254``). docs/performance.md and the README measure what that does to logits and
greedy tokens. The exact mode stays the default and is untouched by this module.

One loop nest serves every row count, so unlike model/dense.py's pair of kernels there is one
target per weight format; it runs on CPU only, unsharded (the engine checks both at start-up).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from model.gguf_blocks import GgufBlocks
from model.kernels import CpuKernel, cpu_only_process
from model.quantization import QuantArray

_GGUF_KERNEL = CpuKernel("int8_matmul", "RaylmInt8GgufMatmul", "raylm_int8_gguf_matmul")
_QUANTIZED_KERNEL = CpuKernel("int8_matmul", "RaylmInt8QuantizedMatmul", "raylm_int8_quantized_matmul")


def unavailable_reason() -> str | None:
    """Why the integer kernels cannot run in this process (None when they can)."""
    if not cpu_only_process():
        return f"it runs C++ CPU kernels, and JAX's backend here is {jax.default_backend()}"
    for kernel in (_GGUF_KERNEL, _QUANTIZED_KERNEL):
        if not kernel.available():
            return f"its kernel library is not built ({kernel.library}); reinstall with `pip install -e .`"
    return None


def takes_int8_activations(w: object) -> bool:
    """Whether the integer kernels read ``w`` as stored: GGUF blocks (int8_g32 included) or int8
    with a scale per output row (not fp8, not float)."""
    return isinstance(w, GgufBlocks) or (isinstance(w, QuantArray) and w.scheme == "int8")


def int8_gguf_matmul(x: jax.Array, w: GgufBlocks) -> jax.Array:
    """``x [M, K] . w [N, K]^T -> [M, N]`` in the integer mode for 2-D blocks."""
    _GGUF_KERNEL.require()
    if x.dtype != jnp.float32 or x.ndim != 2 or w.q.ndim != 2 or w.shape[1:] != x.shape[1:]:
        raise ValueError(f"int8_gguf_matmul takes float32 x [M, K] and 2-D blocks [N, K], got {x.dtype} {x.shape} "
                         f"and {w.shape}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(_GGUF_KERNEL.target, out)(x, w.q, w.scale, w.offset)


def int8_quantized_matmul(x: jax.Array, w: QuantArray) -> jax.Array:
    """``(x [M, K] . w.q [N, K]^T) * w.scale [N] -> [M, N]`` in the integer mode (int8 weights)."""
    _QUANTIZED_KERNEL.require()
    if x.dtype != jnp.float32 or x.ndim != 2 or w.q.dtype != jnp.int8 or w.q.ndim != 2 or x.shape[1] != w.q.shape[1]:
        raise ValueError(f"int8_quantized_matmul takes float32 x [M, K] and int8 w [N, K], got {x.dtype} {x.shape} "
                         f"and {w.q.dtype} {w.shape}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.q.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(_QUANTIZED_KERNEL.target, out)(x, w.q, w.scale.astype(jnp.float32))


def int8_dense(x: jax.Array, w: GgufBlocks | QuantArray, contract: int, out_dtype: jnp.dtype | None) -> jax.Array:
    """``model.dense`` for a weight marked for int8 activations: ``x [..., K...]`` contracted with
    ``w [N..., K...]``'s inputs on 2-D views, in float32 (the result cast to ``out_dtype``, else
    to ``x``'s dtype)."""
    if w.num_input_dims != contract:
        raise ValueError(f"dense: weight {w.shape} has {w.num_input_dims} input dims, contracted {contract}")
    lead, size = x.shape[: x.ndim - contract], math.prod(x.shape[x.ndim - contract:])
    rows = x.astype(jnp.float32).reshape(math.prod(lead), size)
    if isinstance(w, GgufBlocks):
        y = int8_gguf_matmul(rows, w.flat())
        out = w.scale.shape[:-1]
    else:
        y = int8_quantized_matmul(rows, QuantArray(w.q.reshape(-1, size), w.scale.reshape(-1)))
        out = w.scale.shape
    return y.reshape(*lead, *out).astype(out_dtype or x.dtype)
