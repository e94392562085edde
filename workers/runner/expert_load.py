"""An MoE model's tokens routed per (sparse layer, expert), counted on the device: every
program adds its step's (``raylm.model.decoder.forward``), so the load metric costs no transfer
per step; ``take`` reads and restarts the count."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from raylm.model.config.model_config import ModelConfig


class ExpertLoad:
    """The device count (``counts``, donated to each program and kept from its result)."""

    def __init__(self, config: ModelConfig, mesh: Mesh):
        self._shape = (len(config.moe_layers), config.moe.num_experts)
        self._mesh = mesh
        self.counts = self._zeros()

    def argument(self) -> dict[str, Any]:
        """A program's ``expert_load`` argument."""
        return {"expert_load": self.counts}

    def take(self) -> np.ndarray:
        """Tokens routed per (sparse layer, expert) since the last call, ``[layers, E]`` (one
        small transfer, waiting for the step in flight); the device count restarts from zero,
        so its int32 never overflows."""
        counts = np.asarray(jax.device_get(self.counts), np.int64)
        self.counts = self._zeros()
        return counts

    def _zeros(self) -> jax.Array:
        return jax.device_put(np.zeros(self._shape, np.int32), NamedSharding(self._mesh, PartitionSpec()))
