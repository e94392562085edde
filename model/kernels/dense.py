"""Linear layers: ``x . w^T`` by C++ kernels on CPU, XLA's dot elsewhere.

Weights are stored output-first, each output's inputs last and contiguous (``[N..., K...]``,
HF's ``[out, in]``; see model/decoder/params.py). For the few rows of a decode step (1..64
sequences) XLA's CPU dot reaches a third to a half of what the cores do, and the tied LM
head alone took 15-30 ms of a 16-row step; ``model/kernels/dense_matmul.cc`` streams each
weight once while the rows stay in cache (1.2-2x XLA at 2-32 rows, see ``KERNEL_MAX_ROWS``).
Above ``KERNEL_MAX_ROWS`` rows (prompt chunks) the prompt GEMM runs the same tiles blocked
for the caches (``model/kernels/prompt_gemm.inc``): weight rows in L2-sized panels widened to
float32 once per call, input rows in L2-sized blocks. Per core it matches XLA's float32 GEMM
(see ``KERNEL_MAX_ROWS``) while reading 8-bit and GGUF block weights as stored, where XLA's
path first wrote out a float32 copy of every matrix on every call. Both loop nests give each
row the same sums, so a row's result never depends on how many rows share the call. The kernels
are built by ``pip install`` (setup.py); without them, or for non-float32 operands, or on
another backend, the same program runs ``jnp`` (chosen when the program is lowered, so one
traced function serves every platform). XLA cannot partition a custom call: sharded programs
pass ``kernel=False``.

Weights may be ``QuantArray``s (model/quantization/quant_array.py): the kernels read their 8-bit values
directly and apply the per-output-channel scale to their sums; XLA's paths convert the
8-bit matrix to the activation dtype for their dot and scale its result (accelerators fuse
the conversion into the dot).

Weights may be bfloat16 or float16 with float32 activations (a float32 model keeping its
checkpoint's 16-bit matrices, model/loaders/hf_tensors.py): the 16-bit kernels widen them
exactly in registers and run the float32 tiles, so they give the widened matrix's float32
results bit for bit from half the bytes; elsewhere XLA's dot runs on ``w.astype(float32)``.

Weights may be ``GgufBlocks`` (model/quantization/gguf_blocks.py): a GGUF's block-quantized matrices as
stored. The block kernels widen them exactly and run the float32 tiles, so wherever the
float32 kernels run they give the float32 matrix's results bit for bit; elsewhere XLA's dot
runs on the exactly dequantized matrix.

Weights packed for the opt-in integer compute mode (model/quantization/int8_panels.py) run model/kernels/int8_matmul.py
instead, whatever the program.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from raylm.model.kernels import CpuKernel, on_cpu, traced_target
from raylm.model.kernels.int8_matmul import int8_dense
from raylm.model.quantization.gguf_blocks import GgufBlocks
from raylm.model.quantization.int8_panels import Int8Panels
from raylm.model.quantization.quant_array import QuantArray


class _Kernels(NamedTuple):
    """One product's two loop nests: the small-batch kernel and the prompt GEMM (the same
    sums for every row; ``KERNEL_MAX_ROWS`` picks)."""

    small: CpuKernel
    prompt: CpuKernel

    def target(self, rows: int) -> str:
        """The FFI target for a call of ``rows`` rows; raises if the kernel is unavailable."""
        kernel = self.prompt if rows > KERNEL_MAX_ROWS else self.small
        kernel.require()
        return traced_target(kernel.target)


def _kernels(symbol: str, target: str) -> _Kernels:
    """A product's two handlers in dense_matmul.cc: ``symbol`` and ``symbol``Prompt."""
    prompt = CpuKernel("dense_matmul", f"{symbol}Prompt", f"{target}_prompt")
    return _Kernels(CpuKernel("dense_matmul", symbol, target), prompt)


_KERNEL = _kernels("RaylmDenseMatmul", "raylm_dense_matmul")
_QUANTIZED_KERNEL = _kernels("RaylmDenseMatmulQuantized", "raylm_dense_matmul_quantized")
_GGUF_KERNEL = _kernels("RaylmGgufMatmul", "raylm_gguf_matmul")
_HALF_KERNEL = _kernels("RaylmDenseMatmulHalf", "raylm_dense_matmul_half")
# 16-bit weights a float32 model keeps as its checkpoint stores them (model/loaders/hf_tensors.py).
HALF_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Rows up to which the small-batch loop nest runs (every decode batch of the deploy defaults);
# larger calls run the prompt GEMM. Either gives every row the same bits, so this is a speed
# choice only. The small-batch kernel against XLA's dot, on the bundled model's projections
# (all 30 layers' weights and the LM head streamed from memory, `python -m
# raylm.benchmarks.dense_bench`, 2-core AMD EPYC with AVX-512, 16-lane tiles), XLA / kernel
# time: 1 row 1.0x, 2-16 rows 1.4-2.0x, 32 rows 1.2-1.3x, 48 rows 0.97x, 64 rows 0.93x; on
# AVX2 CPUs (8-lane tiles) the kernel led up to 32 rows and tied at 64. The prompt GEMM
# (`python -m raylm.benchmarks.prompt_gemm_bench`, same machine, docs/performance.md) reaches
# 59-101% of XLA's large float32 GEMM's GFLOP/s on 128-512-row chunks of the 135M and 1B layer
# shapes (0.74-1.76x XLA's dot on the widened matrix), and for 8-bit and GGUF block weights
# skips XLA's float32 copy of the matrix.
KERNEL_MAX_ROWS = 64


def available() -> bool:
    """Whether the C++ kernel is built and registered with JAX (CPU only)."""
    return all(k.available() for pair in (_KERNEL, _QUANTIZED_KERNEL, _GGUF_KERNEL, _HALF_KERNEL) for k in pair)


def dense_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [M, K] . w [N, K]^T -> [M, N]`` (float32) by the C++ kernel; raises if unavailable."""
    target = _KERNEL.target(x.shape[0])
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"the dense matmul kernel takes float32 operands, got x {x.dtype} and w {w.dtype}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"dense_matmul takes x [M, K] and w [N, K], got {x.shape} and {w.shape}")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))
    return call(x, w)


def half_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [M, K] . w [N, K]^T -> [M, N]`` for float32 ``x`` and bfloat16 or float16 ``w`` by
    the C++ kernel: the float32 kernel's result on ``w.astype(float32)``, bit for bit (the
    weights are widened exactly in registers); raises if unavailable."""
    target = _HALF_KERNEL.target(x.shape[0])
    if x.dtype != jnp.float32 or w.dtype not in HALF_DTYPES:
        raise ValueError(
            f"the 16-bit matmul kernel takes float32 x and bfloat16/float16 w, got {x.dtype} and {w.dtype}"
        )
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"half_matmul takes x [M, K] and w [N, K], got {x.shape} and {w.shape}")
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))
    return call(x, w)


def quantized_matmul(x: jax.Array, w: QuantArray) -> jax.Array:
    """``(x [M, K] . w.q [N, K]^T) * w.scale [N] -> [M, N]`` by the C++ kernel (int8 or fp8
    weights, float32 activations); raises if unavailable."""
    target = _QUANTIZED_KERNEL.target(x.shape[0])
    if x.dtype != jnp.float32:
        raise ValueError(f"the quantized matmul kernel takes float32 activations, got {x.dtype}")
    if x.ndim != 2 or w.q.ndim != 2 or w.scale.shape != w.q.shape[:1] or x.shape[1] != w.q.shape[1]:
        raise ValueError(f"quantized_matmul takes x [M, K] and w [N, K] with scale [N], got {x.shape} and {w.shape}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.q.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(target, out)(x, w.q, w.scale.astype(jnp.float32))


def gguf_matmul(x: jax.Array, w: GgufBlocks) -> jax.Array:
    """``x [M, K] . w [N, K]^T -> [M, N]`` for a 2-D ``GgufBlocks`` by the C++ kernel: the
    float32 kernel's result on ``w.dequantize()``, bit for bit; raises if unavailable."""
    target = _GGUF_KERNEL.target(x.shape[0])
    if x.dtype != jnp.float32:
        raise ValueError(f"the GGUF block kernel takes float32 activations, got {x.dtype}")
    if x.ndim != 2 or w.q.ndim != 2 or w.shape[1:] != x.shape[1:]:
        raise ValueError(f"gguf_matmul takes x [M, K] and 2-D blocks [N, K], got {x.shape} and {w.shape}")
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(target, out)(x, w.q, w.scale, w.offset, _supers(w), w.codebook_table())


def _supers(w: GgufBlocks) -> jax.Array:
    """The kernel's ``supers`` operand: the two-level scales' float32 part, or ``[N..., 0]``."""
    return w.supers if w.two_level else jnp.zeros((*w.scale.shape[:-1], 0), jnp.float32)


def dense(
    x: jax.Array, w: jax.Array | QuantArray | GgufBlocks | Int8Panels, contract: int = 1, *, kernel: bool, out_dtype: jnp.dtype | None = None
) -> jax.Array:
    """Contract ``x``'s last ``contract`` dims with ``w``'s last ``contract`` dims.

    ``x [..., K...]`` and ``w [N..., K...]`` give ``[..., N...]``. ``kernel`` says the program
    is unsharded: the C++ kernels run where they can (CPU, built, float32) and XLA's dot on
    2-D views otherwise. Without it, a plain
    ``tensordot`` over the named dims, which a sharded program partitions. ``out_dtype`` is
    the dot's accumulation/result type (the LM head asks float32 of bfloat16 weights). Weights
    packed for the integer compute mode take its kernel (model/kernels/int8_matmul.py).
    """
    if isinstance(w, Int8Panels):
        return int8_dense(x, w, contract, out_dtype)
    if isinstance(w, QuantArray):
        return _quantized_dense(x, w, contract, kernel=kernel, out_dtype=out_dtype)
    if isinstance(w, GgufBlocks):
        return _gguf_dense(x, w, contract, kernel=kernel, out_dtype=out_dtype)
    k_dims = x.shape[x.ndim - contract:]
    if w.shape[w.ndim - contract:] != k_dims:
        raise ValueError(f"dense: x {x.shape} and w {w.shape} differ in their last {contract} dims")
    lead, out = x.shape[: x.ndim - contract], w.shape[: w.ndim - contract]

    def by_jnp(x: jax.Array, w: jax.Array) -> jax.Array:
        axes = (tuple(range(x.ndim - contract, x.ndim)), tuple(range(w.ndim - contract, w.ndim)))
        return jnp.tensordot(x, w, axes, preferred_element_type=out_dtype)

    if x.dtype == jnp.float32 and w.dtype in HALF_DTYPES:
        return _half_dense(x, w, contract, kernel=kernel, out_dtype=out_dtype)
    if not kernel:
        return by_jnp(x, w)
    # An unsharded program: both operands as 2-D matrices (free reshapes of row-major
    # arrays). XLA CPU's dot otherwise transposes a weight with several output dims into
    # [K, N] on every call (a copy of the whole matrix: 1.9x slower 64-row decode steps).
    rows, size = math.prod(lead), math.prod(k_dims)

    def by_xla(x: jax.Array, w: jax.Array) -> jax.Array:
        y = jnp.einsum("mk,nk->mn", x.reshape(rows, size), w.reshape(-1, size), preferred_element_type=out_dtype)
        return y.reshape(*lead, *out)

    if not (available() and x.dtype == w.dtype == jnp.float32 and rows > 0):
        return by_xla(x, w)

    def by_kernel(x: jax.Array, w: jax.Array) -> jax.Array:
        return dense_matmul(x.reshape(rows, size), w.reshape(-1, size)).reshape(*lead, *out)

    return on_cpu(x, w, cpu=by_kernel, default=by_xla)


def _half_dense(x: jax.Array, w: jax.Array, contract: int, *, kernel: bool, out_dtype: jnp.dtype | None) -> jax.Array:
    """``dense`` for float32 activations and 16-bit weights (a float32 model keeping its
    checkpoint's bfloat16 or float16 matrices): the 16-bit kernels wherever the float32 kernels
    would run, so a program gives the widened matrix's float32 results bit for bit; else
    ``dense`` over ``w.astype(float32)`` (XLA's dot on the exactly widened matrix; accelerators
    fuse the conversion)."""
    lead, size = x.shape[: x.ndim - contract], math.prod(x.shape[x.ndim - contract:])
    rows = math.prod(lead)

    def by_xla(x: jax.Array, w: jax.Array) -> jax.Array:
        return dense(x, w.astype(x.dtype), contract, kernel=kernel, out_dtype=out_dtype)

    if not (kernel and available() and rows > 0):
        return by_xla(x, w)
    if w.shape[w.ndim - contract:] != x.shape[x.ndim - contract:]:
        raise ValueError(f"dense: x {x.shape} and w {w.shape} differ in their last {contract} dims")
    out = w.shape[: w.ndim - contract]

    def by_kernel(x: jax.Array, w: jax.Array) -> jax.Array:
        y = half_matmul(x.reshape(rows, size), w.reshape(-1, size)).reshape(*lead, *out)
        return y if out_dtype is None else y.astype(out_dtype)

    return on_cpu(x, w, cpu=by_kernel, default=by_xla)


def _quantized_dense(
    x: jax.Array, w: QuantArray, contract: int, *, kernel: bool, out_dtype: jnp.dtype | None
) -> jax.Array:
    """``dense`` for 8-bit weights: the kernels where they run, else ``dense`` over the
    converted matrix, times the scales."""
    if w.num_input_dims != contract:
        raise ValueError(f"dense: weight {w.shape} has {w.num_input_dims} input dims, contracted {contract}")
    dtype = out_dtype or x.dtype

    def by_xla(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
        y = dense(x, q.astype(x.dtype), contract, kernel=kernel, out_dtype=out_dtype)
        return (y * scale).astype(dtype)

    lead, size = x.shape[: x.ndim - contract], math.prod(x.shape[x.ndim - contract:])
    rows = math.prod(lead)
    if not (kernel and available() and x.dtype == jnp.float32 and rows > 0):
        return by_xla(x, w.q, w.scale)

    def by_kernel(x: jax.Array, q: jax.Array, scale: jax.Array) -> jax.Array:
        flat = QuantArray(q.reshape(-1, size), scale.reshape(-1))
        return quantized_matmul(x.reshape(rows, size), flat).reshape(*lead, *scale.shape).astype(dtype)

    return on_cpu(x, w.q, w.scale, cpu=by_kernel, default=by_xla)


def _gguf_dense(
    x: jax.Array, w: GgufBlocks, contract: int, *, kernel: bool, out_dtype: jnp.dtype | None
) -> jax.Array:
    """``dense`` for GGUF blocks: the block kernels wherever the float32 kernels would run (so
    a program gives the float32 matrix's results bit for bit), else ``dense`` over the exactly
    dequantized matrix."""
    if w.num_input_dims != contract:
        raise ValueError(f"dense: weight {w.shape} has {w.num_input_dims} input dims, contracted {contract}")
    lead, size = x.shape[: x.ndim - contract], math.prod(x.shape[x.ndim - contract:])
    rows = math.prod(lead)
    two_level = w.two_level

    def blocks(q: jax.Array, scale: jax.Array, offset: jax.Array, supers: jax.Array) -> GgufBlocks:
        return GgufBlocks(q, scale, offset, w.input_shape, supers if two_level else None, w.codebook)

    def by_xla(x: jax.Array, *arrays: jax.Array) -> jax.Array:
        return dense(x, blocks(*arrays).dequantize(x.dtype), contract, kernel=kernel, out_dtype=out_dtype)

    arrays = (w.q, w.scale, w.offset, _supers(w))
    if not (kernel and available() and x.dtype == jnp.float32 and rows > 0):
        return by_xla(x, *arrays)

    def by_kernel(x: jax.Array, *arrays: jax.Array) -> jax.Array:
        flat = blocks(*arrays).flat()
        y = gguf_matmul(x.reshape(rows, size), flat).reshape(*lead, *w.scale.shape[:-1])
        return y if out_dtype is None else y.astype(out_dtype)

    return on_cpu(x, *arrays, cpu=by_kernel, default=by_xla)
