"""One matmul over groups of rows, each group against its own matrix: the experts of an MoE
layer (model/decoder/moe.py).

``x [M, K]``'s rows are sorted into consecutive groups, ``group_sizes [G]`` long (summing to
at most ``M``; rows past the last group are padding and come out as zeros), and group ``g``
is multiplied by ``w[g]`` (stored ``[G, N..., K]``, output-first as every matrix here:
model/decoder/params.py). ``w`` may be float, 8-bit (``QuantArray``, a scale per expert and output
channel) or GGUF blocks (``GgufBlocks``) as model/kernels/dense.py takes them, or packed for the
integer mode (``Int8Panels`` with ``experts``: model/kernels/int8_matmul.py's grouped kernel).

``jax.lax.ragged_dot_general`` states exactly this, and accelerators run grouped-GEMM kernels
for it. XLA's CPU backend does not: it lowers ragged_dot to a dense dot over every group
with the other groups' rows masked to zero, ``G`` times the work and every expert's weights
read whatever the routing (``benchmarks/moe_layer_bench.py`` measures it). So on CPU
the C++ kernels run (model/kernels/grouped_matmul.cc): the dense kernel once per expert that
got rows, over just those rows, reading 8-bit and block experts as stored (no float32 copy of
the stack per step); and since that kernel sums each output in the same order whatever the
batch, a token's result does not depend on what else was routed with it, and 8-bit and block
experts give the float32 kernel's results on their widened values bit for bit. XLA cannot
partition a custom call, so experts split over devices (expert parallelism) call it per device
inside a ``shard_map`` on each device's own experts (model/decoder/expert_parallel.py).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from raylm.model.kernels import CpuKernel, on_cpu, on_gpu
from raylm.model.kernels.int8_matmul import int8_grouped_matmul
from raylm.model.kernels.pallas.grouped_matmul import pallas_grouped_matmul
from raylm.model.quantization.gguf_blocks import GgufBlocks
from raylm.model.quantization.int8_panels import Int8Panels
from raylm.model.quantization.quant_array import QuantArray

_KERNEL = CpuKernel("grouped_matmul", "RaylmGroupedMatmul", "raylm_grouped_matmul")
_QUANTIZED_KERNEL = CpuKernel("grouped_matmul", "RaylmGroupedQuantizedMatmul", "raylm_grouped_quantized_matmul")
_GGUF_KERNEL = CpuKernel("grouped_matmul", "RaylmGroupedGgufMatmul", "raylm_grouped_gguf_matmul")
# Rows of x contract their one dim with w's last; x's rows are ragged over w's leading groups.
_DIMENSIONS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
)


def available() -> bool:
    """Whether the C++ grouped kernels are built and registered with JAX (CPU only)."""
    return all(k.available() for k in (_KERNEL, _QUANTIZED_KERNEL, _GGUF_KERNEL))


def grouped_matmul(
    x: jax.Array, w: jax.Array | QuantArray | GgufBlocks | Int8Panels, group_sizes: jax.Array, *, kernel: bool = False,
    gpu_kernel: bool = False,
) -> jax.Array:
    """``x [M, K]`` by groups: rows of group ``g`` times ``w[g] [N..., K]``; returns ``[M, N...]``.
    ``kernel``: the C++ kernel on CPU where it is built (float32 activations); ``gpu_kernel``: the
    Pallas kernel where lowered for a GPU (float or 8-bit experts: model/kernels/pallas/grouped_matmul.py);
    else ragged_dot (8-bit experts converted for it and scaled after, blocks dequantized exactly).
    Experts packed for the integer mode (``Int8Panels``) always take its kernel
    (model/kernels/int8_matmul.py ``int8_grouped_matmul``: CPU only, unsharded, as the engine checks)."""
    if isinstance(w, Int8Panels):
        return int8_grouped_matmul(x, w, group_sizes)
    G, K = w.shape[0], w.shape[-1]
    out = tuple(w.shape[1:-1])
    N = math.prod(out)
    one_input_dim = not isinstance(w, (QuantArray, GgufBlocks)) or w.num_input_dims == 1
    if x.ndim != 2 or x.shape[1] != K or group_sizes.shape != (G,) or not one_input_dim:
        raise ValueError(f"grouped_matmul takes x [M, K], w [G, N..., K], group_sizes [G]: got "
                         f"{x.shape}, {w.shape}, {group_sizes.shape}")
    sizes = group_sizes.astype(jnp.int32)
    # Every format's arrays as [G, N, ...] (free reshapes of row-major arrays).
    if isinstance(w, QuantArray):
        arrays = (w.q.reshape(G, N, K), w.scale.reshape(G, N).astype(jnp.float32))
    elif isinstance(w, GgufBlocks):
        supers = w.supers if w.two_level else jnp.zeros((*w.scale.shape[:-1], 0), jnp.float32)
        arrays = tuple(a.reshape(G, N, a.shape[-1]) for a in (w.q, w.scale, w.offset, supers))
    else:
        arrays = (w.reshape(G, N, K).astype(x.dtype),)

    def by_ragged_dot(x: jax.Array, sizes: jax.Array, *arrays: jax.Array) -> jax.Array:
        if isinstance(w, GgufBlocks):
            q, scales, offsets, supers = arrays
            stacked = GgufBlocks(q, scales, offsets, (K,), supers if w.two_level else None,
                                 w.codebook).dequantize(x.dtype)
            scale = None
        else:
            stacked, scale = arrays[0].astype(x.dtype), (arrays[1] if isinstance(w, QuantArray) else None)
        y = jax.lax.ragged_dot_general(x, stacked, sizes, _DIMENSIONS, preferred_element_type=x.dtype)
        if scale is None:
            return y
        # Each row's expert (rows past the groups are zeros whatever scale they get).
        group = jnp.minimum(jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(x.shape[0]), side="right"), G - 1)
        return (y * scale[group]).astype(x.dtype)

    def by_kernel(x: jax.Array, sizes: jax.Array, *arrays: jax.Array) -> jax.Array:
        target = (_QUANTIZED_KERNEL if isinstance(w, QuantArray) else _GGUF_KERNEL if isinstance(w, GgufBlocks)
                  else _KERNEL).target
        codebook = (w.codebook_table(),) if isinstance(w, GgufBlocks) else ()  # GgufBlocks.codebook
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], N), jnp.float32))(x, *arrays, sizes,
                                                                                             *codebook)

    def by_gpu_kernel(x: jax.Array, sizes: jax.Array, *arrays: jax.Array) -> jax.Array:
        return pallas_grouped_matmul(x, QuantArray(*arrays) if isinstance(w, QuantArray) else arrays[0], sizes)

    if kernel and available() and x.dtype == jnp.float32 and x.shape[0] > 0:
        y = on_cpu(x, sizes, *arrays, cpu=by_kernel, default=by_ragged_dot)
    elif gpu_kernel and not isinstance(w, GgufBlocks) and x.shape[0] > 0:
        y = on_gpu(x, sizes, *arrays, gpu=by_gpu_kernel, default=by_ragged_dot)
    else:
        y = by_ragged_dot(x, sizes, *arrays)
    return y.reshape(x.shape[0], *out)
