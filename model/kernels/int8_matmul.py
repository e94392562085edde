"""The integer compute mode's matmul: int8 activations against 4- and 8-bit weights as stored.

``model.activation_quantization: int8`` (model/quantization/activations.py packs the weights)
trades the exact mode's float32 arithmetic for llama.cpp's: each activation row is quantized
per block of 32 inputs to int8 (scale ``max|x| / 127``, round to nearest even), each block's
products are summed in integers against the stored weight integers (GGUF blocks with a scale
per 32 weights, ``int8_g32`` matrices, int8 with a scale per output row), and only the block sums are
scaled in float32. On AVX-512 VNNI one instruction does 64 multiply-adds where float32 does 16
(model/kernels/int8_matmul.cc says how, and why a row's result does not depend on the batch); on
Intel AMX, prompt chunks run on its int8 tiles (model/kernels/int8_amx.h), the same bits.

The result is not the float32 product: an activation moves by up to half its block's step
(``max|x| / 254``). docs/performance.md and the README measure what that does to logits and
greedy tokens. The exact mode stays the default and is untouched by this module.

The weights are repacked once at load for the kernel (model/quantization/int8_panels.py). One loop nest
serves every row count and every format, so unlike model/kernels/dense.py's pair of kernels there is one
target; it runs on CPU only, unsharded (the engine checks both at start-up). A mixture of experts'
stacked experts run the same loop nest per expert that got rows (``int8_grouped_matmul``).
"""

from __future__ import annotations

import ctypes
import math

import jax
import jax.numpy as jnp

from raylm.model.kernels import CpuKernel, cpu_only_process
from raylm.model.quantization.gguf_blocks import GgufBlocks
from raylm.model.quantization.int8_panels import Int8Panels, sub_scaled
from raylm.model.quantization.quant_array import QuantArray

_KERNEL = CpuKernel("int8_matmul", "RaylmInt8PanelMatmul", "raylm_int8_panel_matmul")
_GROUPED_KERNEL = CpuKernel("int8_matmul", "RaylmGroupedInt8PanelMatmul", "raylm_grouped_int8_panel_matmul")


def unavailable_reason() -> str | None:
    """Why the integer kernel cannot run in this process (None when it can)."""
    if not cpu_only_process():
        return f"it runs C++ CPU kernels, and JAX's backend here is {jax.default_backend()}"
    if not (_KERNEL.available() and _GROUPED_KERNEL.available()):
        return f"its kernel library is not built ({_KERNEL.library}); reinstall with `pip install -e .`"
    return None


FAMILIES = ("amx", "vnni", "avx2", "portable")  # best first; every one gives the same bits


def family() -> str:
    """The family the integer kernel runs now: the best this CPU offers (AMX tiles for prompt
    chunks where Linux grants them; AVX-512 VNNI, AVX2 or portable loops), or a lower one that
    ``RAYLM_INT8_MATMUL_FAMILY`` or ``use_family`` named."""
    function = _KERNEL.c_function("RaylmInt8MatmulFamily")
    function.restype = ctypes.c_char_p
    return function().decode()


def use_family(name: str) -> str:
    """Make later calls in this process run family ``name`` (one of ``FAMILIES``), or the best one
    here if that is lower; ``""`` goes back to the environment's choice. Returns the family now
    used: tests and benchmarks compare families in one process."""
    if name and name not in FAMILIES:
        raise ValueError(f"int8 matmul family {name!r}: expected one of {', '.join(FAMILIES)}")
    function = _KERNEL.c_function("RaylmInt8MatmulUseFamily")
    function.restype, function.argtypes = ctypes.c_char_p, [ctypes.c_char_p]
    return function(name.encode()).decode()


def takes_int8_activations(w: object) -> bool:
    """Whether the integer kernel can read ``w`` (once packed by model/quantization/int8_panels.py): GGUF
    blocks with a scale (and offset) per 32 weights (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0,
    int8_g32; IQ4_NL, IQ4_XS and MXFP4, whose 4-bit codes it looks up in their codebook), 8-bit
    blocks with two-level int8 scales (and offsets) per 16 (Q6_K, Q3_K, Q2_K, a fused Q4_K / Q6_K
    matrix), or int8 with a scale per output row (not fp8 values, per row or in blocks; not
    float). Mixed layouts brought to float32 tables per 16 (a K-quant
    fused with a Q8_0 matrix) stay in the exact kernels."""
    if isinstance(w, GgufBlocks):
        return not w.fp8 and (w.group == 32 or sub_scaled(w))
    return isinstance(w, QuantArray) and w.scheme == "int8"


def int8_matmul(x: jax.Array, w: Int8Panels) -> jax.Array:
    """``x [M, K] . w [N, K]^T -> [M, N]`` in the integer mode (inputs and outputs flattened)."""
    _KERNEL.require()
    n, k = math.prod(w.output_shape), math.prod(w.input_shape)
    if w.experts or x.dtype != jnp.float32 or x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"int8_matmul takes float32 x [M, {k}] for weights {w.shape}, got {x.dtype} {x.shape}")
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    return jax.ffi.ffi_call(_KERNEL.target, out)(x, *w.arrays())


def int8_grouped_matmul(x: jax.Array, w: Int8Panels, group_sizes: jax.Array) -> jax.Array:
    """``model.kernels.grouped_matmul`` for packed experts ``w [E, N..., K]`` (``pack_int8_experts``):
    ``x [M, K]``'s rows in consecutive groups of ``group_sizes [E]``, group ``e`` times expert ``e``,
    rows past the groups zeros; returns ``[M, N...]`` in ``x``'s dtype. Each row gets the bits
    ``int8_matmul`` gives it alone against its expert's matrix (``w.expert(e)``)."""
    _GROUPED_KERNEL.require()
    n, k = math.prod(w.output_shape), math.prod(w.input_shape)
    if not w.experts or x.ndim != 2 or x.shape[1] != k or group_sizes.shape != (w.experts,):
        raise ValueError(f"int8_grouped_matmul takes x [M, {k}] and group_sizes [{w.experts}] for stacked experts "
                         f"{w.shape}, got x {x.shape} and group_sizes {group_sizes.shape}")
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    y = jax.ffi.ffi_call(_GROUPED_KERNEL.target, out)(
        x.astype(jnp.float32), *w.arrays(), group_sizes.astype(jnp.int32))
    return y.reshape(x.shape[0], *w.output_shape).astype(x.dtype)


def int8_dense(x: jax.Array, w: Int8Panels, contract: int, out_dtype: jnp.dtype | None) -> jax.Array:
    """``model.kernels.dense`` for packed weights: ``x [..., K...]`` contracted with ``w [N..., K...]``'s
    inputs on 2-D views, in float32 (the result cast to ``out_dtype``, else to ``x``'s dtype)."""
    if w.num_input_dims != contract:
        raise ValueError(f"dense: weight {w.shape} has {w.num_input_dims} input dims, contracted {contract}")
    lead, size = x.shape[: x.ndim - contract], math.prod(x.shape[x.ndim - contract:])
    y = int8_matmul(x.astype(jnp.float32).reshape(math.prod(lead), size), w)
    return y.reshape(*lead, *w.output_shape).astype(out_dtype or x.dtype)
