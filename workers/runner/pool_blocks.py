"""Whole KV blocks in and out of a runner's device pools, as offload payloads.

The engine publishes each block that became full to the offload tiers (``read``) and writes
blocks loaded from them back before a step computes (``write``). A block is ``[:, b]`` of every
pool array: K and V (or MLA's latents), an 8-bit pool's scales, a draft model's K and V under
the same block tables; ``cache.offload.BlockLayout`` turns those slices into one flat payload.
Both programs move at most ``MAX_BLOCKS_PER_CALL`` blocks a call, padded to a power of two
(padding reads and writes the null block, which holds no token's K/V), so a replica compiles
a handful of them, at start-up with its other programs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import jax
import numpy as np

from raylm.cache.offload.block_layout import BlockLayout
from raylm.model.decoder.kv_pool import GroupedKV
from raylm.model.runtime.buckets import bucket

if TYPE_CHECKING:
    from raylm.workers.runner.model_runner import ModelRunner

MAX_BLOCKS_PER_CALL = 64


@jax.jit
def _gather(arrays: list[jax.Array], block_ids: jax.Array) -> list[jax.Array]:
    return [array[:, block_ids] for array in arrays]


def _scatter(arrays: list[jax.Array], block_ids: jax.Array, values: list[jax.Array]) -> list[jax.Array]:
    return [array.at[:, block_ids].set(value) for array, value in zip(arrays, values)]


class PoolBlocks:
    """Reads and writes blocks of ``runner``'s pools (the target's, and a draft model's)."""

    def __init__(self, runner: ModelRunner):
        if isinstance(runner.kv, GroupedKV):
            raise ValueError("KV offload keeps one block table per sequence; a model that interleaves sliding-window "
                             "and full-attention layers keeps two (Gemma 2/3, gpt-oss, ...): serve it without "
                             "engine.kv_offload")
        self.runner = runner
        arrays, self._treedef = jax.tree.flatten(self._pools())
        self.layout = BlockLayout.of(arrays)
        shardings = [array.sharding for array in arrays]
        self._scatter = jax.jit(_scatter, donate_argnums=0, out_shardings=shardings)

    def _pools(self) -> tuple[Any, Any]:
        draft = self.runner.draft
        return self.runner.kv, draft.kv if draft is not None else None

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """The payloads ``[n, layout.nbytes]`` (uint8) of ``block_ids``, as the pools hold them now."""
        arrays = jax.tree.leaves(self._pools())
        out = []
        for start in range(0, len(block_ids), MAX_BLOCKS_PER_CALL):
            part = block_ids[start:start + MAX_BLOCKS_PER_CALL]
            ids = _padded_ids(part)
            gathered = [np.asarray(g)[:, :len(part)] for g in _gather(arrays, ids)]
            out.append(self.layout.encode(gathered))
        return np.concatenate(out) if len(out) > 1 else out[0]

    def write(self, writes: Sequence[tuple[int, np.ndarray]]) -> None:
        """Put each (block id, payload) into the pools."""
        for start in range(0, len(writes), MAX_BLOCKS_PER_CALL):
            part = writes[start:start + MAX_BLOCKS_PER_CALL]
            ids = _padded_ids([block_id for block_id, _ in part])
            payloads = np.zeros((len(ids), self.layout.nbytes), np.uint8)
            payloads[:len(part)] = np.stack([payload for _, payload in part])
            arrays = jax.tree.leaves(self._pools())
            self._set(self._scatter(arrays, ids, self.layout.decode(payloads)))

    def warm_up(self) -> None:
        """Compile both programs for every block count (reading and rewriting the null block)."""
        n = 1
        while n <= MAX_BLOCKS_PER_CALL:
            payloads = self.read([0] * n)
            self.write(list(zip([0] * n, payloads)))
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
