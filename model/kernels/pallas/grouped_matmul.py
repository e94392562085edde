"""The experts' grouped matmul on a GPU, as a Pallas (Triton) kernel over routed rows only.

``model.kernels.grouped_matmul`` states the contract (``x [M, K]``'s rows in consecutive groups,
``group_sizes [G]`` long, group ``g`` times ``w[g] [N, K]``, rows past the groups zeros). XLA's
GPU backend lowers ``ragged_dot`` by expanding it into a zero-padded dense dot over every
group (the XLA authors' own description of the default; cuDNN and hipBLASLt paths cover some
configurations only), so an MoE layer would multiply every token by every expert. JAX's
grouped-matmul kernels are TPU (megablox) or Hopper-only Mosaic GPU (``ragged_dot_mgpu``),
and neither runs in the CPU test suite's interpret mode; this one follows megablox's plan on
Triton: the sorted rows are cut into ``bm``-row tiles, each (tile, group) pair that shares
rows is one program row of the grid (at most ``tiles + G - 1`` of them), and a program
multiplies its tile's rows of its group by that group's ``[bn, K]`` slice of ``w``, storing
only those rows (programs of one tile write disjoint rows, so none races). Empty pairs skip
their loop. 8-bit experts (int8 / fp8 with a scale per expert and output channel) are widened
in the kernel, so they are read as stored.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from raylm.model.kernels import gpu_kernels_interpreted
from raylm.model.quantization.quant_array import QuantArray
from raylm.model.runtime.buckets import bucket, cdiv

ROW_TILE = 64  # rows of x per program (a tile may be shared by two groups: two programs)
COL_TILE = 128  # output columns per program
DEPTH_TILE = 64  # contraction per dot


def group_bounds(group_sizes: jax.Array) -> jax.Array:
    """Each group's rows ``[start, end)`` of the sorted rows, ``[G, 2]``."""
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    return jnp.stack([ends - sizes, ends], axis=1)


def pair_plan(group_sizes: jax.Array, num_tiles: int, row_tile: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per program row ``p`` of ``num_tiles + G - 1``: its group, its tile, and whether it is real
    (each group's tiles in order, groups in order; the rest are empty)."""
    sizes = group_sizes.astype(jnp.int32)
    bounds = group_bounds(sizes)
    starts, ends = bounds[:, 0], bounds[:, 1]
    first = starts // row_tile
    count = jnp.where(sizes > 0, (ends - 1) // row_tile - first + 1, 0)
    offsets = jnp.cumsum(count)
    pairs = num_tiles + sizes.shape[0] - 1
    p = jnp.arange(pairs, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(offsets, p, side="right"), sizes.shape[0] - 1).astype(jnp.int32)
    tile = first[group] + p - (offsets[group] - count[group])
    return group, jnp.where(p < offsets[-1], tile, 0), (p < offsets[-1]).astype(jnp.int32)


def _kernel(x_ref, w_ref, scale_ref, bounds_ref, group_ref, tile_ref, real_ref, o_ref, *, row_tile: int,
            col_tile: int, depth_tile: int, exact: bool):
    p, j = pl.program_id(0), pl.program_id(1)
    K = x_ref.shape[1]
    N = w_ref.shape[1]
    group, row0 = group_ref[p], tile_ref[p] * row_tile
    start, end = bounds_ref[group, 0], bounds_ref[group, 1]
    rows = row0 + jnp.arange(row_tile)
    mine = (rows >= start) & (rows < end) & (real_ref[p] > 0)
    cols = j * col_tile + jnp.arange(col_tile)
    col_ok = cols < N
    precision = jax.lax.Precision.HIGHEST if exact else None

    def body(step, acc):
        depth = step * depth_tile + jnp.arange(depth_tile)
        depth_ok = depth < K
        x = plgpu.load(x_ref.at[pl.ds(row0, row_tile), pl.ds(step * depth_tile, depth_tile)],
                       mask=mine[:, None] & depth_ok[None, :], other=0)
        w = plgpu.load(w_ref.at[group, pl.ds(j * col_tile, col_tile), pl.ds(step * depth_tile, depth_tile)],
                       mask=col_ok[:, None] & depth_ok[None, :], other=jnp.zeros((), w_ref.dtype))
        return acc + plgpu.dot(x, w.astype(x.dtype), trans_b=True, precision=precision)

    steps = jnp.where(real_ref[p] > 0, pl.cdiv(K, depth_tile), 0)
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((row_tile, col_tile), jnp.float32))
    if scale_ref is not None:
        acc = acc * plgpu.load(scale_ref.at[group, pl.ds(j * col_tile, col_tile)], mask=col_ok, other=0)[None, :]
    plgpu.store(o_ref.at[pl.ds(row0, row_tile), pl.ds(j * col_tile, col_tile)], acc.astype(o_ref.dtype),
                mask=mine[:, None] & col_ok[None, :])


def _whole(array: jax.Array | None) -> pl.BlockSpec | None:
    """Every program sees all of ``array`` (it indexes its rows itself)."""
    return None if array is None else pl.BlockSpec(array.shape, lambda *_: (0,) * array.ndim)


def pallas_grouped_matmul(x: jax.Array, w: jax.Array | QuantArray, group_sizes: jax.Array, *,
                          interpret: bool = False) -> jax.Array:
    """``x [M, K]`` by groups times ``w [G, N, K]`` (float, or a QuantArray of 8-bit experts with
    ``scale [G, N]``), by the Pallas kernel; returns ``[M, N]`` in ``x``'s dtype, zeros past
    the groups. ``interpret`` (or ``model.kernels.interpreting_gpu_kernels``) runs it on the CPU."""
    M, K = x.shape
    N = w.shape[1]
    row_tile, col_tile, depth_tile = bucket(M, 16, ROW_TILE), bucket(N, 16, COL_TILE), bucket(K, 16, DEPTH_TILE)
    tiles = cdiv(M, row_tile)
    padded = jnp.pad(x, ((0, tiles * row_tile - M), (0, 0)))
    group, tile, real = pair_plan(group_sizes, tiles, row_tile)
    bounds = group_bounds(group_sizes)
    values, scale = (w.q, w.scale.astype(jnp.float32)) if isinstance(w, QuantArray) else (w, None)
    operands = (padded, values, scale, bounds, group, tile, real)
    kernel = functools.partial(_kernel, row_tile=row_tile, col_tile=col_tile, depth_tile=depth_tile,
                               exact=x.dtype == jnp.float32)
    out = pl.pallas_call(
        kernel,
        grid=(group.shape[0], cdiv(N, col_tile)),
        in_specs=[_whole(a) for a in operands],
        out_specs=pl.BlockSpec((tiles * row_tile, N), lambda p, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((tiles * row_tile, N), x.dtype),
        interpret=interpret or gpu_kernels_interpreted(),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="raylm_grouped_matmul",
    )(*operands)
    # Rows no group claims were never stored (their memory is whatever it was): zeros.
    return jnp.where((jnp.arange(M) < bounds[-1, 1])[:, None], out[:M], 0)
