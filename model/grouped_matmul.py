"""One matmul over groups of rows, each group against its own matrix: the experts of an MoE
layer (model/moe.py).

``x [M, K]``'s rows are sorted into consecutive groups, ``group_sizes [G]`` long (summing to
at most ``M``; rows past the last group are padding and come out as zeros), and group ``g``
is multiplied by ``w[g]`` (stored ``[G, N..., K]``, output-first as every matrix here:
model/params.py).

``jax.lax.ragged_dot_general`` states exactly this, and accelerators run grouped-GEMM kernels
for it. XLA's CPU backend does not: it lowers ragged_dot to a dense dot over every group
with the other groups' rows masked to zero, ``G`` times the work and every expert's weights
read whatever the routing (``deploy/benchmarks/moe_layer_bench.py`` measures it). So on CPU
the C++ kernel runs (model/kernels/dense_matmul.cc, ``GroupedMatmul``): the small-batch dense
kernel once per expert that got rows, over just those rows; and since that kernel sums each
output in the same order whatever the batch, a token's result does not depend on what else
was routed with it. Sharded programs (expert parallelism) keep ragged_dot: XLA cannot
partition a custom call.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from model.kernels import CpuKernel
from model.quantization import QuantArray

_KERNEL = CpuKernel("dense_matmul", "RaylmGroupedMatmul", "raylm_grouped_matmul")
# Rows of x contract their one dim with w's last; x's rows are ragged over w's leading groups.
_DIMENSIONS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def available() -> bool:
    """Whether the C++ grouped kernel is built and registered with JAX (CPU only)."""
    return _KERNEL.available()


def grouped_matmul(
    x: jax.Array, w: jax.Array | QuantArray, group_sizes: jax.Array, *, kernel: bool = False
) -> jax.Array:
    """``x [M, K]`` by groups: rows of group ``g`` times ``w[g] [N..., K]``; returns ``[M, N...]``.
    ``kernel``: the C++ kernel on CPU where it is built (float32), else ragged_dot."""
    if isinstance(w, QuantArray):  # weight-only 8-bit experts: the converted matrices
        w = w.dequantize(x.dtype)
    G, K = w.shape[0], w.shape[-1]
    out = w.shape[1:-1]
    if x.ndim != 2 or x.shape[1] != K or group_sizes.shape != (G,):
        raise ValueError(f"grouped_matmul takes x [M, K], w [G, N..., K], group_sizes [G]: got "
                         f"{x.shape}, {w.shape}, {group_sizes.shape}")
    stacked = w.reshape(G, math.prod(out), K).astype(x.dtype)
    sizes = group_sizes.astype(jnp.int32)

    def by_ragged_dot(x: jax.Array, stacked: jax.Array, sizes: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot_general(x, stacked, sizes, _DIMENSIONS, preferred_element_type=x.dtype)

    def by_kernel(x: jax.Array, stacked: jax.Array, sizes: jax.Array) -> jax.Array:
        result = jax.ShapeDtypeStruct((x.shape[0], stacked.shape[1]), jnp.float32)
        return jax.ffi.ffi_call(_KERNEL.target, result)(x, stacked, sizes)

    if kernel and available() and x.dtype == jnp.float32 and x.shape[0] > 0:
        y = jax.lax.platform_dependent(x, stacked, sizes, cpu=by_kernel, default=by_ragged_dot)
    else:
        y = by_ragged_dot(x, stacked, sizes)
    return y.reshape(x.shape[0], *out)
