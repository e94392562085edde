"""A replica's LoRA adapter slots on the device, and each row's delta computed from its own slot.

The slots are fixed buffers, allocated once: for every layer and every target matrix
(``model.lora.TARGETS``) ``a [n, R, in...]`` and ``b [out..., n, R]`` (``n`` = ``max_loras``,
``R`` = ``max_lora_rank``; an adapter of lower rank is padded with zeros, its scale is in ``b``).
Filling a slot writes arrays of the same shapes, so no program is compiled per adapter, and a
batch's rows carry their slot as data (``slots [B]``): 0 is the base model (no delta), slot
``s >= 1`` is buffer ``s - 1``. The delta ``x A_s^T B_s^T`` is added to the base matmul's result
whatever computed it (XLA's dot, the CPU kernels, 8-bit or GGUF block weights).

Two ways to compute it, chosen per program by its static shapes, the same numbers either way:
with no more rows than slots each row gathers its own adapter (punica's BGMV: it reads only the
adapters its rows use, which keeps single-stream decode close to the base model's cost); with
more rows than slots every row is multiplied by all slots' ``A`` as one matrix and the other
slots' columns are zeroed before ``B`` (each weight read once, as one matmul the CPU kernel
runs, instead of a gathered copy of ``A`` and ``B`` per row).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.dense import dense
from model.lora import TARGETS, LoraAdapter, layer_targets


class LoraPair(NamedTuple):
    """One target matrix's slots: ``a [n, R, in...]``, ``b [out..., n, R]``."""

    a: jax.Array
    b: jax.Array


LoraWeights = tuple  # per layer: dict target name -> LoraPair (the targets of model.lora.layer_targets)


class LoraBatch(NamedTuple):
    """What ``model.forward.forward`` needs for LoRA: the slots, and each row's slot (``[B]``)."""

    weights: LoraWeights
    slots: jax.Array


def lora_shapes(config: ModelConfig, num_slots: int, max_rank: int) -> dict[str, tuple[tuple, tuple]]:
    """Per target: the shapes of its ``a`` and ``b`` slot buffers."""
    return {name: ((num_slots, max_rank, *t.in_shape(config)), (*t.out_shape(config), num_slots, max_rank))
            for name, t in TARGETS.items()}


def lora_axes() -> dict[str, LoraPair]:
    """Per target: the logical axis names of ``a`` and ``b`` (for ``model.sharding``)."""
    return {name: LoraPair(("lora_slots", "lora_rank", *t.in_axes), (*t.out_axes, "lora_slots", "lora_rank"))
            for name, t in TARGETS.items()}


def create_lora_weights(config: ModelConfig, num_slots: int, max_rank: int, dtype: jnp.dtype) -> LoraWeights:
    """Empty (zero) slots for every layer's targets (a mixture-of-experts layer has no MLP slots)."""
    shapes = lora_shapes(config, num_slots, max_rank)
    return tuple({name: LoraPair(jnp.zeros(shapes[name][0], dtype), jnp.zeros(shapes[name][1], dtype))
                  for name in layer_targets(config, layer)} for layer in range(config.num_layers))


def slot_values(adapter: LoraAdapter | None, config: ModelConfig, max_rank: int, dtype: np.dtype) -> LoraWeights:
    """One slot's contents for ``adapter``: every layer's targets, zero where it adapts nothing,
    its rank padded to ``max_rank`` (all zeros for None)."""
    shapes = lora_shapes(config, 1, max_rank)
    out = []
    for layer in range(config.num_layers):
        pairs = {}
        for name in layer_targets(config, layer):
            a_shape, b_shape = shapes[name]
            a, b = np.zeros(a_shape[1:], dtype), np.zeros(b_shape[:-2] + b_shape[-1:], dtype)
            found = None if adapter is None else adapter.weights.get((layer, name))
            if found is not None:
                a[: adapter.rank], b[..., : adapter.rank] = found
            pairs[name] = LoraPair(a, b)
        out.append(pairs)
    return tuple(out)


@functools.partial(jax.jit, donate_argnames=("weights",))
def write_slot(weights: LoraWeights, index: jax.Array, values: LoraWeights) -> LoraWeights:
    """``weights`` with buffer ``index`` (slot ``index + 1``) replaced by ``values`` (one
    program for every slot and adapter; the buffers are updated in place)."""
    return jax.tree.map(
        lambda pair, new: LoraPair(pair.a.at[index].set(new.a), pair.b.at[..., index, :].set(new.b)),
        weights, values, is_leaf=lambda x: isinstance(x, LoraPair),
    )


class LayerLora(NamedTuple):
    """One layer's slots and the rows' slots: the deltas ``model.forward`` adds to its matmuls."""

    pairs: dict[str, LoraPair]
    slots: jax.Array  # [B]
    kernel: bool  # the program is unsharded: the masked form's matmuls may take the CPU kernel

    def qkv(self, h: jax.Array) -> jax.Array:
        """The fused QKV's delta ``[B, S, KVH, G + 2, Dh]``."""
        q, k, v = (self.delta(name, h) for name in ("q_proj", "k_proj", "v_proj"))
        return jnp.concatenate([q, k[:, :, :, None], v[:, :, :, None]], axis=3)

    def gate_up(self, h: jax.Array) -> jax.Array:
        """The fused gate/up's delta ``[B, S, 2, I]``."""
        return jnp.stack([self.delta("gate_proj", h), self.delta("up_proj", h)], axis=2)

    def delta(self, target: str, x: jax.Array) -> jax.Array:
        """``x [B, S, in...]`` times row ``b``'s adapter in ``target``: ``[B, S, out...]``."""
        a, b = self.pairs[target]
        n, rank = a.shape[:2]
        in_dims, out_dims = a.ndim - 2, b.ndim - 2
        slots = self.slots
        if x.shape[0] <= n:  # gathered per row
            index = jnp.maximum(slots - 1, 0)
            i, o = "xyz"[:in_dims], "klm"[:out_dims]
            xa = jnp.einsum(f"bs{i},br{i}->bsr", x, a[index]) * (slots > 0).astype(x.dtype)[:, None, None]
            return jnp.einsum(f"bsr,{o}br->bs{o}", xa, jnp.take(b, index, axis=-2))
        xa = dense(x, a.reshape(n * rank, *a.shape[2:]), in_dims, kernel=self.kernel)  # [B, S, n * R]
        own = (slots[:, None] == jnp.arange(1, n + 1)[None, :]).astype(xa.dtype)  # [B, n]
        xa = xa * jnp.repeat(own, rank, axis=1)[:, None, :]
        return dense(xa, b.reshape(*b.shape[:out_dims], n * rank), kernel=self.kernel)
