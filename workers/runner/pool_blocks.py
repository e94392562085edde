"""Whole KV blocks in and out of a runner's device pools, as offload payloads.

The engine publishes each block that became full to the offload tiers (``read``) and writes
blocks loaded from them back before a step computes (``write``). A block is ``[:, b]`` of every
pool array: K and V (or MLA's latents), an 8-bit pool's scales, a draft model's K and V under the
same block tables; ``cache.offload.BlockLayout`` lays those slices out as one flat payload.

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
    """Reads and writes blocks of ``runner``'s pools (the target's, and a draft model's)."""

    def __init__(self, runner: ModelRunner):
        if isinstance(runner.kv, GroupedKV):
            raise ValueError("KV offload keeps one block table per sequence; a model that interleaves sliding-window "
                             "(or chunked) and full-attention layers keeps two (Gemma 2/3, gpt-oss, Llama 4): serve "
                             "it without engine.kv_offload")
        self.runner = runner
        arrays, self._treedef = jax.tree.flatten(self._pools())
        self.layout = BlockLayout.of(arrays)
        self._host_views = all(len(a.devices()) == 1 and next(iter(a.devices())).platform == "cpu" for a in arrays)
        self._scatter = jax.jit(_scatter, donate_argnums=0, out_shardings=[array.sharding for array in arrays])

    def _pools(self) -> tuple[Any, Any]:
        draft = self.runner.draft
        return self.runner.kv, draft.kv if draft is not None else None

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """The payloads ``[n, layout.nbytes]`` (uint8) of ``block_ids``, as the pools hold them now."""
        arrays = jax.tree.leaves(self._pools())
        if self._host_views:  # the views are dropped before the next step donates the pools
            return self.layout.encode([np.asarray(a) for a in arrays], block_ids)
        out = []
        for start in range(0, len(block_ids), MAX_BLOCKS_PER_CALL):
            part = block_ids[start:start + MAX_BLOCKS_PER_CALL]
            out.append(np.asarray(_gather(arrays, _padded_ids(part), layout=self.layout))[:len(part)])
        return np.concatenate(out) if len(out) > 1 else out[0]

    def write(self, writes: Sequence[tuple[int, np.ndarray]]) -> None:
        """Put each (block id, payload) into the pools."""
        for start in range(0, len(writes), MAX_BLOCKS_PER_CALL):
            part = writes[start:start + MAX_BLOCKS_PER_CALL]
            ids = _padded_ids([block_id for block_id, _ in part])
            payloads = np.zeros((len(ids), self.layout.nbytes), np.uint8)
            for row, (_, payload) in enumerate(part):
                payloads[row] = payload
            self._set(self._scatter(jax.tree.leaves(self._pools()), ids, self.layout.decode(payloads)))

    def warm_up(self) -> None:
        """Compile the programs for every block count (reading and rewriting the null block)."""
        n = 1
        while n <= MAX_BLOCKS_PER_CALL:
            self.write([(0, payload) for payload in self.read([0] * n)])
            n *= 2

    def _set(self, arrays: list[jax.Array]) -> None:
        kv, draft_kv = jax.tree.unflatten(self._treedef, arrays)
        self.runner.kv = kv
        if draft_kv is not None:
            self.runner.draft.kv = draft_kv


def _padded_ids(block_ids: Sequence[int]) -> np.ndarray:
    ids = np.zeros(bucket(len(block_ids), 1, MAX_BLOCKS_PER_CALL), np.int32)
    ids[:len(block_ids)] = block_ids
    return ids
