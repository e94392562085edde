"""A replica's LoRA adapter slots on the device, as the runner's programs take them.

``max_loras`` slots of rank ``max_lora_rank`` (``raylm.model.decoder.lora_slots`` computes each
row's delta from its slot). On the CPU kernel's path the slots are packed (one program argument
for every layer; int8 slots exist only packed, the kernel scales them); elsewhere they are per
layer, sharded with the base matrices. Filling a slot is one program for every slot and adapter.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from raylm.model.config.model_config import ModelConfig
from raylm.model.decoder.lora_slots import (
    LoraBatch,
    LoraWeights,
    PackedLoraWeights,
    create_lora_weights,
    kernel_layout,
    pack_lora_weights,
    slot_values,
    write_slot,
)
from raylm.model.loaders.lora_adapter import LoraAdapter
from raylm.model.runtime.sharding import shard_lora


class LoraSlots:
    """The device slots (``weights``) and how one is filled (``load``) and passed (``batch``)."""

    def __init__(self, config: ModelConfig, mesh: Mesh, model_dtype: jnp.dtype, cpu_kernels: bool,
                 num_slots: int, rank: int, dtype: str | None):
        self.config, self.rank = config, rank
        self.dtype = jnp.dtype(dtype) if dtype else jnp.dtype(model_dtype)
        self.packed = kernel_layout(cpu_kernels, model_dtype, self.dtype)
        if self.dtype == jnp.int8 and not self.packed:
            raise ValueError("lora_dtype int8 needs the CPU LoRA kernel: an unsharded replica on CPU with a "
                             "float32 model and the kernels built; use float32 or bfloat16 slots here")
        self._slot_dtype = jnp.dtype(jnp.float32) if self.dtype == jnp.int8 else self.dtype
        if self.packed:  # empty slots on the device, laid out as one slot's packed values
            empty = self._contents(None)
            self.weights: LoraWeights | PackedLoraWeights = jax.tree.map(
                lambda leaf: jnp.zeros((num_slots, *leaf.shape), leaf.dtype), empty)
        else:
            self.weights = shard_lora(create_lora_weights(config, num_slots, rank, self._slot_dtype), config, mesh)

    def load(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Fill slot ``slot`` with ``adapter`` (None: empty it)."""
        self.weights = write_slot(self.weights, np.int32(slot - 1), self._contents(adapter))

    def batch(self, slots: np.ndarray) -> dict[str, Any]:
        """A program's ``lora`` argument: the slots and each forward row's slot."""
        return {"lora": LoraBatch(self.weights, slots)}

    def _contents(self, adapter: LoraAdapter | None) -> LoraWeights | PackedLoraWeights:
        """One slot's values for ``adapter`` (None: empty), packed when the slots are."""
        values = slot_values(adapter, self.config, self.rank, self._slot_dtype)
        return pack_lora_weights(values, slot_axis=False, dtype=self.dtype) if self.packed else values
