"""Whole KV blocks in and out of a runner's device pools, as offload payloads.

The engine publishes each block that became full to the offload tiers (``read``) and writes
blocks loaded from them back before a step computes (``write``). A block is ``[:, b]`` of every
pool array: K and V (or MLA's latents), an 8-bit pool's scales, a draft model's K and V under the
same block tables; ``cache.offload.BlockLayout`` lays those slices out as one flat payload. A
model whose sliding-window layers keep a KV group of their own has a payload per group.

On one CPU device the pools are host memory already: reads copy each block's slices straight
from NumPy views into the payloads (XLA's CPU gather is tens of times slower at this). Otherwise
a program gathers the blocks and bit-casts them to bytes on the device. Writes view the payloads
as each array's blocks on the host (``BlockLayout.decode``) and a program updates one block at a
time in place (a scatter over the blocks axis is ~10x slower on the CPU, bit-casting bytes in XLA
~30x). Programs move at most ``MAX_BLOCKS_PER_CALL`` blocks a
call, padded to a power of two with the null block (it holds no token's K/V), so a replica
compiles a handful of them, at start-up with its other programs.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from raylm.cache.offload.block_layout import BlockLayout
from raylm.model.decoder.kv_pool import GroupedKV
from raylm.model.runtime.buckets import bucket

if TYPE_CHECKING:
    from raylm.workers.runner.model_runner import ModelRunner

MAX_BLOCKS_PER_CALL = 64


def _as_bytes(blocks: jax.Array) -> jax.Array:
    """``[n, ...]`` of any type as ``[n, bytes]`` uint8, bit for bit."""
    flat = blocks.reshape(blocks.shape[0], -1)
    return jax.lax.bitcast_convert_type(flat, jnp.uint8).reshape(blocks.shape[0], -1)


@functools.partial(jax.jit, static_argnames=("layout",))
def _gather(arrays: list[jax.Array], block_ids: jax.Array, *, layout: BlockLayout) -> jax.Array:
    """The payloads ``[n, layout.nbytes]`` of ``block_ids``."""
    return jnp.concatenate([_as_bytes(jnp.moveaxis(array[:, block_ids], 1, 0)) for array in arrays], axis=1)


def _scatter(arrays: list[jax.Array], block_ids: jax.Array, blocks: list[jax.Array]) -> list[jax.Array]:
    """``arrays`` with blocks ``block_ids`` set from ``blocks`` (each ``[n, layers, ...]``), one
    block at a time in place."""
    out = []
    for array, values in zip(arrays, blocks):

        def put(i: int, pool: jax.Array, values: jax.Array = values) -> jax.Array:
            return jax.lax.dynamic_update_slice_in_dim(pool, values[i][:, None], block_ids[i], axis=1)

        out.append(jax.lax.fori_loop(0, block_ids.shape[0], put, array))
    return out


class PoolBlocks:
    """Reads and writes blocks of ``runner``'s pools (the target's, and a draft model's), per KV
    group: a model whose sliding-window layers keep a group of their own (``GroupedKV``) has
    blocks of each, with layouts of their own (a draft model reads the full group's tables)."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.num_groups = 2 if isinstance(runner.kv, GroupedKV) else 1
        self._treedefs, self.layouts, self._scatters, devices = [], [], [], []
        for group in range(self.num_groups):
            arrays, treedef = jax.tree.flatten(self._pools(group))
            self._treedefs.append(treedef)
            self.layouts.append(BlockLayout.of(arrays))
            self._scatters.append(jax.jit(_scatter, donate_argnums=0, out_shardings=[a.sharding for a in arrays]))
            devices += [a.devices() for a in arrays]
        self.layout = self.layouts[0]  # the full group's (the only one of most models)
        self._host_views = all(len(d) == 1 and next(iter(d)).platform == "cpu" for d in devices)

    def _pools(self, group: int) -> tuple[Any, ...]:
        """KV group ``group``'s pools: the full group's with the draft model's, or the sliding group's."""
        kv, draft = self.runner.kv, self.runner.draft
        if group == 1:
            return (kv.sliding,)
        return kv.full if self.num_groups > 1 else kv, draft.kv if draft is not None else None

    def read(self, block_ids: Sequence[int], group: int = 0) -> np.ndarray:
        """The payloads ``[n, layouts[group].nbytes]`` (uint8) of KV group ``group``'s blocks
        ``block_ids``, as the pools hold them now."""
        arrays, layout = jax.tree.leaves(self._pools(group)), self.layouts[group]
        if self._host_views:  # the views are dropped before the next step donates the pools
            return layout.encode([np.asarray(a) for a in arrays], block_ids)
        out = []
        for start in range(0, len(block_ids), MAX_BLOCKS_PER_CALL):
            part = block_ids[start:start + MAX_BLOCKS_PER_CALL]
            out.append(np.asarray(_gather(arrays, _padded_ids(part), layout=layout))[:len(part)])
        return np.concatenate(out) if len(out) > 1 else out[0]

    def write(self, writes: Sequence[tuple[int, np.ndarray]], group: int = 0) -> None:
        """Put each (block id, payload) into KV group ``group``'s pools."""
        layout = self.layouts[group]
        for start in range(0, len(writes), MAX_BLOCKS_PER_CALL):
            part = writes[start:start + MAX_BLOCKS_PER_CALL]
            ids = _padded_ids([block_id for block_id, _ in part])
            payloads = np.zeros((len(ids), layout.nbytes), np.uint8)
            for row, (_, payload) in enumerate(part):
                payloads[row] = payload
            arrays = self._scatters[group](jax.tree.leaves(self._pools(group)), ids, layout.decode(payloads))
            self._set(group, arrays)

    def warm_up(self) -> None:
        """Compile the programs for every block count (reading and rewriting the null block)."""
        for group in range(self.num_groups):
            n = 1
            while n <= MAX_BLOCKS_PER_CALL:
                self.write([(0, payload) for payload in self.read([0] * n, group)], group)
                n *= 2

    def _set(self, group: int, arrays: list[jax.Array]) -> None:
        runner = self.runner
        if group == 1:
            (sliding,) = jax.tree.unflatten(self._treedefs[1], arrays)
            runner.kv = runner.kv._replace(sliding=sliding)
            return
        kv, draft_kv = jax.tree.unflatten(self._treedefs[0], arrays)
        runner.kv = runner.kv._replace(full=kv) if self.num_groups > 1 else kv
        if draft_kv is not None:
            runner.draft.kv = draft_kv


def _padded_ids(block_ids: Sequence[int]) -> np.ndarray:
    ids = np.zeros(bucket(len(block_ids), 1, MAX_BLOCKS_PER_CALL), np.int32)
    ids[:len(block_ids)] = block_ids
    return ids
