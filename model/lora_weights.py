"""A replica's LoRA adapter slots on the device, and each row's delta computed from its own slot.

The slots are fixed buffers, allocated once. Per layer, the ``A`` matrices of targets that read
the same input are one buffer, their ranks side by side (q/k/v: ``[n, 3R, D]``, gate/up:
``[n, 2R, D]``, o and down alone), so one matmul computes ``x A^T`` for all of them; each
target keeps its ``B [n, R, out...]`` (``n`` = ``max_loras``, ``R`` = ``max_lora_rank``; an
adapter of lower rank is padded with zeros, its scale is in ``B``). Each buffer's matrices are
contiguous (a kernel reads one adapter in place), ``A``'s inputs last (``x A^T`` streams its
rows as a weight matrix's) and ``B``'s outputs last (``(x A^T) B^T`` is then ``R`` vector
updates of contiguous outputs, where ranks last would make each output a chain of ``R``
scalar products). Filling a slot writes arrays of the same shapes, so no program is compiled
per adapter, and a batch's rows carry their slot as data (``slots [B]``):
0 is the base model (no delta), slot ``s >= 1`` is buffer ``s - 1``. The delta ``x A_s^T
B_s^T`` is added to the base matmul's result whatever computed it (XLA's dot, the CPU kernels,
8-bit or GGUF block weights).

Where the CPU kernels run (an unsharded program on CPU, float32), model/lora_delta.py's kernel
adds the deltas, reading each used adapter once in place. Elsewhere XLA computes them, in one of
two forms chosen per program by its static shapes: with no more rows than slots each row
gathers its own adapter (punica's BGMV: it reads only the adapters its rows use); with more
rows than slots every row is multiplied by all slots' ``A`` as one matrix and the other slots'
columns are zeroed before ``B`` (each weight read once, instead of a gathered copy per row).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from model.kernels import on_cpu
from model.lora import TARGETS, LoraAdapter, layer_targets
from model.lora_delta import available as kernel_available, lora_add, takes


# Targets whose A share a buffer (they read the same input), in the order of their ranks in it.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


class LayerSlots(NamedTuple):
    """One layer's slots: ``a`` by group (``[n, len(group) * R, in...]``), ``b`` by target
    (``[n, R, out...]``); a mixture-of-experts layer has no MLP ones."""

    a: dict[str, jax.Array]
    b: dict[str, jax.Array]


LoraWeights = tuple  # LayerSlots per layer


class LoraBatch(NamedTuple):
    """What ``model.forward.forward`` needs for LoRA: the slots, and each row's slot (``[B]``)."""

    weights: LoraWeights
    slots: jax.Array


def _groups(config: ModelConfig, layer: int) -> dict[str, tuple[str, ...]]:
    targets = layer_targets(config, layer)
    return {group: members for group, members in GROUPS.items() if members[0] in targets}


def lora_shapes(config: ModelConfig, layer: int, num_slots: int, max_rank: int) -> LayerSlots:
    """The shapes of one layer's slot buffers."""
    return LayerSlots(
        {g: (num_slots, len(m) * max_rank, *TARGETS[m[0]].in_shape(config)) for g, m in _groups(config, layer).items()},
        {t: (num_slots, max_rank, *TARGETS[t].out_shape(config)) for t in layer_targets(config, layer)},
    )


def lora_axes(config: ModelConfig, layer: int) -> LayerSlots:
    """The logical axis names of one layer's buffers (for ``model.sharding``): each ``A`` split
    like its matrices' inputs, each ``B`` like its matrix's outputs."""
    return LayerSlots(
        {g: ("lora_slots", "lora_rank", *TARGETS[m[0]].in_axes) for g, m in _groups(config, layer).items()},
        {t: ("lora_slots", "lora_rank", *TARGETS[t].out_axes) for t in layer_targets(config, layer)},
    )


def create_lora_weights(config: ModelConfig, num_slots: int, max_rank: int, dtype: jnp.dtype) -> LoraWeights:
    """Empty (zero) slots for every layer."""
    return tuple(jax.tree.map(lambda shape: jnp.zeros(shape, dtype), lora_shapes(config, layer, num_slots, max_rank),
                              is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(d, int) for d in x))
                 for layer in range(config.num_layers))


def slot_values(adapter: LoraAdapter | None, config: ModelConfig, max_rank: int, dtype: np.dtype) -> LoraWeights:
    """One slot's contents for ``adapter`` (the buffers without their slot axis): every layer,
    zero where it adapts nothing, its rank padded to ``max_rank`` (all zeros for None)."""
    out = []
    for layer in range(config.num_layers):
        shapes = lora_shapes(config, layer, 1, max_rank)
        a = {g: np.zeros(shape[1:], dtype) for g, shape in shapes.a.items()}
        b = {t: np.zeros(shape[1:], dtype) for t, shape in shapes.b.items()}
        for group, members in _groups(config, layer).items():
            for j, target in enumerate(members):
                found = None if adapter is None else adapter.weights.get((layer, target))
                if found is not None:
                    a[group][j * max_rank : j * max_rank + adapter.rank], b[target][: adapter.rank] = found
        out.append(LayerSlots(a, b))
    return tuple(out)


@functools.partial(jax.jit, donate_argnames=("weights",))
def write_slot(weights: LoraWeights, index: jax.Array, values: LoraWeights) -> LoraWeights:
    """``weights`` with buffer ``index`` (slot ``index + 1``) replaced by ``values`` (one
    program for every slot and adapter; the buffers are updated in place)."""
    return jax.tree.map(lambda old, new: old.at[index].set(new), weights, values)


class LayerLora(NamedTuple):
    """One layer's slots and the rows' slots: the deltas ``model.forward`` adds to its matmuls."""

    weights: LayerSlots
    slots: jax.Array  # [B]
    kernel: bool  # the program is unsharded: the CPU kernel may add the deltas

    def add(self, group: str, y: jax.Array, x: jax.Array) -> jax.Array:
        """``y [B, S, out...]``, the base result of ``group``'s projection (fused as the model
        keeps it: QKV ``[KVH, G + 2, Dh]``, gate/up ``[2, I]``), plus each row's delta for
        ``x [B, S, in...]``."""
        a = self.weights.a[group]
        bs = [self.weights.b[t] for t in GROUPS[group]]
        # The fused output's leading dims that every target shares: QKV's KV heads.
        groups = y.shape[2] if group == "qkv" else 1
        B, S = x.shape[:2]

        def by_kernel(y: jax.Array, x: jax.Array, a: jax.Array, slots: jax.Array, *bs: jax.Array) -> jax.Array:
            flat = [b.reshape(*b.shape[:2], -1) for b in bs]
            rows = jnp.repeat(slots, S)
            out = lora_add(y.reshape(B * S, -1), x.reshape(B * S, -1), a.reshape(*a.shape[:2], -1), rows, flat, groups)
            return out.reshape(y.shape)

        def by_xla(y: jax.Array, x: jax.Array, a: jax.Array, slots: jax.Array, *bs: jax.Array) -> jax.Array:
            deltas = [d.reshape(B, S, groups, -1) for d in _deltas(x, a, slots, bs)]
            return (y + jnp.concatenate(deltas, axis=-1).reshape(y.shape)).astype(y.dtype)

        operands = (y, x, a, self.slots, *bs)
        if self.kernel and kernel_available() and takes(y, x, [a, *bs]):
            return on_cpu(*operands, cpu=by_kernel, default=by_xla)
        return by_xla(*operands)


def _deltas(x: jax.Array, a: jax.Array, slots: jax.Array, bs: tuple[jax.Array, ...]) -> list[jax.Array]:
    """``x [B, S, in...]`` times row ``b``'s adapter in each target (one matmul by their shared
    ``a [n, T * R, in...]``, then each ``B [n, R, out...]``) by XLA: ``[B, S, out...]`` per target."""
    n, rank = a.shape[0], a.shape[1] // len(bs)
    i = "xyz"[: a.ndim - 2]
    if x.shape[0] <= n:  # gathered per row
        index = jnp.maximum(slots - 1, 0)
        xa = jnp.einsum(f"bs{i},br{i}->bsr", x, a[index]) * (slots > 0).astype(x.dtype)[:, None, None]
        out = []
        for j, b in enumerate(bs):
            o = "klm"[: b.ndim - 2]
            out.append(jnp.einsum(f"bsr,br{o}->bs{o}", xa[..., j * rank : (j + 1) * rank], b[index]))
        return out
    B, S = x.shape[:2]
    xa = jnp.einsum(f"bs{i},nr{i}->bsnr", x, a)
    own = (slots[:, None] == jnp.arange(1, n + 1)[None, :]).astype(xa.dtype)  # [B, n]
    xa = xa.reshape(B, S, n, len(bs), rank) * own[:, None, :, None, None]
    out = []
    for j, b in enumerate(bs):
        o = "klm"[: b.ndim - 2]
        out.append(jnp.einsum(f"bsnr,nr{o}->bs{o}", xa[:, :, :, j], b))
    return out
