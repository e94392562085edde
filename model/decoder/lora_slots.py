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

Where the CPU kernels run (an unsharded program on CPU, float32), model/kernels/lora_delta.py's kernel
adds the deltas, reading each used adapter once in place, and the slots are packed
(``PackedLoraWeights``): every layer's buffers in one array ``[n, S]``, a slot's adapter in its row,
so that a step passes one argument instead of one per layer and target (on the bundled model the
330 arguments cost a single stream ~0.8 ms a step, as much as a rank-8 adapter's arithmetic).
Elsewhere XLA computes them, in one of
two forms chosen per program by its static shapes: with no more rows than slots each row
gathers its own adapter (punica's BGMV: it reads only the adapters its rows use); with more
rows than slots every row is multiplied by all slots' ``A`` as one matrix and the other slots'
columns are zeroed before ``B`` (each weight read once, instead of a gathered copy per row).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from raylm.model.config.model_config import ModelConfig
from raylm.model.kernels import on_cpu
from raylm.model.kernels.lora_delta import SLOT_DTYPES, lora_add, takes
from raylm.model.kernels.lora_delta import available as kernel_available
from raylm.model.loaders.lora_adapter import TARGETS, LoraAdapter, layer_targets

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

# Packed pieces start at multiples of this many values (a 64-byte line of float32).
_PACKED_ALIGN = 16


def _aligned(size: int) -> int:
    return -(-size // _PACKED_ALIGN) * _PACKED_ALIGN


# A packed ``B [R, O]`` is stored in tiles of this many output columns, each tile's ``R`` rows
# contiguous (``[ceil(O / 64), R, 64]``, the last tile's columns past ``O`` zero): the kernel
# sums a tile over the ranks, and read in place from ``[R, O]`` that was ``R`` lines ``O``
# values apart per tile, more streams than the CPU's prefetchers follow (int8 and bfloat16
# slots at rank 64: 1.2x the time of contiguous tiles). Must equal lora_expand.h's kExpandTile.
B_TILE = 64


def _tiled_size(shape: tuple[int, ...]) -> int:
    """Values of a packed ``B`` of ``shape`` (``[R, out...]``) in tiles."""
    return shape[0] * -(-int(np.prod(shape[1:])) // B_TILE) * B_TILE


def _tile(b: Any, lead: int) -> Any:
    """``b [*lead dims, R, out...]`` in tiles, flattened after the lead dims (numpy or jnp)."""
    xp = np if isinstance(b, np.ndarray) else jnp
    rank, outputs = b.shape[lead], int(np.prod(b.shape[lead + 1:]))
    tiles = -(-outputs // B_TILE)
    flat = b.reshape(*b.shape[:lead], rank, outputs)
    flat = xp.pad(flat, [(0, 0)] * (lead + 1) + [(0, tiles * B_TILE - outputs)])
    tiled = flat.reshape(*b.shape[:lead], rank, tiles, B_TILE)
    return xp.moveaxis(tiled, lead + 1, lead).reshape(*b.shape[:lead], -1)


def _untile(values: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``values [n, _tiled_size(shape)]`` back to ``[n, *shape]``."""
    rank, outputs = shape[0], int(np.prod(shape[1:]))
    tiles = -(-outputs // B_TILE)
    flat = jnp.moveaxis(values.reshape(values.shape[0], tiles, rank, B_TILE), 1, 2)
    return flat.reshape(values.shape[0], rank, tiles * B_TILE)[:, :, :outputs].reshape(values.shape[0], *shape)


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where one layer's buffers lie in a packed slot's row: ``a`` by group and ``b`` by target,
    each ``(name, offset, shape without the slot axis, offset of its int8 scales)``: an ``A``
    has a scale per row (``shape[0]``), a ``B`` one per output (``shape[1:]``). An ``A`` is laid
    out as its shape says, a ``B`` in tiles of ``B_TILE`` outputs (``_tile``)."""

    a: tuple[tuple[str, int, tuple[int, ...], int], ...]
    b: tuple[tuple[str, int, tuple[int, ...], int], ...]


class PackedLayerSlots(NamedTuple):
    """One layer's view of ``PackedLoraWeights`` (traced code only; not a program argument)."""

    buffer: jax.Array  # [n, S]
    scales: jax.Array  # [n, S2]: int8 slots' scales ([n, 0] for float slots)
    layout: PackedLayout

    def unpacked(self) -> LayerSlots:
        """The layer's buffers as ``LayerSlots`` (slices of the packed array, int8 ones scaled to
        float32: for XLA's form)."""
        n = self.buffer.shape[0]
        int8 = self.buffer.dtype == jnp.int8

        def piece(offset: int, shape: tuple[int, ...], scale_offset: int, per_row: bool) -> jax.Array:
            if per_row:  # an A
                values = self.buffer[:, offset : offset + int(np.prod(shape))].reshape(n, *shape)
            else:
                values = _untile(self.buffer[:, offset : offset + _tiled_size(shape)], shape)
            if not int8:
                return values
            count = shape[0] if per_row else int(np.prod(shape[1:]))
            scale = self.scales[:, scale_offset : scale_offset + count]
            scale = scale.reshape(n, count, *[1] * (len(shape) - 1)) if per_row else scale.reshape(n, 1, *shape[1:])
            return values.astype(jnp.float32) * scale

        return LayerSlots({g: piece(o, shape, so, True) for g, o, shape, so in self.layout.a},
                          {t: piece(o, shape, so, False) for t, o, shape, so in self.layout.b})


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PackedLoraWeights:
    """Every layer's slot buffers packed in one array ``buffer [n, S]`` (model/kernels/lora_delta.py's
    kernel reads each piece in place at its offset), int8 ones with their float32 ``scales [n,
    S2]`` (``[n, 0]`` otherwise); ``layouts`` (static) says where."""

    buffer: jax.Array
    scales: jax.Array
    layouts: tuple[PackedLayout, ...]

    def __len__(self) -> int:
        return len(self.layouts)

    def __getitem__(self, layer: int) -> PackedLayerSlots:
        return PackedLayerSlots(self.buffer, self.scales, self.layouts[layer])

    def tree_flatten(self) -> tuple[tuple[jax.Array, jax.Array], tuple[PackedLayout, ...]]:
        return (self.buffer, self.scales), self.layouts

    @classmethod
    def tree_unflatten(cls, layouts: tuple[PackedLayout, ...], children: tuple[jax.Array, jax.Array]
                       ) -> "PackedLoraWeights":
        return cls(*children, layouts)


def _int8_per(values: np.ndarray, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """``values`` as int8 with a float32 scale per index of the other axes (absmax / 127; 0 for
    all-zero ones): the values and the scales (``axes`` kept as size 1)."""
    scale = (np.abs(values).max(axis=axes, keepdims=True) / 127.0).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)
    return np.clip(np.rint(values / safe), -127, 127).astype(np.int8), scale


def pack_lora_weights(weights: LoraWeights, slot_axis: bool = True, dtype: jnp.dtype | None = None
                      ) -> PackedLoraWeights:
    """``weights`` packed: each layer's ``a`` then ``b`` buffers (by name) flattened after the slot
    axis (each ``b`` in tiles, ``_tile``) and laid end to end, each piece starting at a multiple
    of 16 values. With ``slot_axis`` False, ``weights`` is one slot's contents (``slot_values``)
    and the result's buffer is ``[S]``.
    ``dtype`` int8 (NumPy ``weights`` only) quantizes each ``A`` per row and each ``B`` per output
    (the scales beside, in ``scales``); otherwise the values keep their type."""
    lead = 1 if slot_axis else 0
    host = all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(weights))
    xp = np if host else jnp
    int8 = dtype is not None and jnp.dtype(dtype) == jnp.int8
    if int8 and not host:
        raise ValueError("int8 LoRA slots are packed from host (NumPy) values")
    pieces, scale_pieces, layouts, offset, scale_offset = [], [], [], 0, 0
    for layer in weights:
        placed = []
        for part, per_row in ((layer.a, True), (layer.b, False)):
            entries = []
            for name, array in sorted(part.items()):  # sorted, as JAX orders a dict's keys
                shape = tuple(int(d) for d in array.shape[lead:])
                size = int(np.prod(shape))
                flat = array.reshape(*array.shape[:lead], size)
                entry_scale = 0
                if int8:
                    # A [rows, in...]: a scale per row; B [R, out...]: a scale per output.
                    grid = array.reshape(*array.shape[:lead], shape[0], -1)
                    values, scale = _int8_per(grid.astype(np.float32), (lead + 1,) if per_row else (lead,))
                    flat = values.reshape(*array.shape[:lead], size)
                    scale = scale.reshape(*array.shape[:lead], -1)
                    entry_scale = scale_offset
                    count = scale.shape[-1]
                    scale_pieces.append(np.pad(scale, [(0, 0)] * lead + [(0, _aligned(count) - count)]))
                    scale_offset += _aligned(count)
                if not per_row:  # a B: in tiles
                    flat = _tile(flat.reshape(array.shape), lead)
                    size = _tiled_size(shape)
                pieces.append(xp.pad(flat, [(0, 0)] * lead + [(0, _aligned(size) - size)]))
                entries.append((name, offset, shape, entry_scale))
                offset += _aligned(size)
            placed.append(tuple(entries))
        layouts.append(PackedLayout(*placed))
    buffer = xp.concatenate(pieces, axis=lead)
    scales = (np.concatenate(scale_pieces, axis=lead) if int8
              else xp.zeros((*buffer.shape[:lead], 0), np.float32))
    return PackedLoraWeights(buffer, scales, tuple(layouts))


def kernel_layout(cpu_kernels: bool, activation_dtype: jnp.dtype, lora_dtype: jnp.dtype) -> bool:
    """Whether a replica keeps its slots packed for the CPU kernel: its programs run the CPU
    kernels (unsharded, on CPU), the kernel is built, and it takes these types."""
    return (cpu_kernels and kernel_available() and jnp.dtype(activation_dtype) == jnp.float32
            and jnp.dtype(lora_dtype) in SLOT_DTYPES)


class LoraBatch(NamedTuple):
    """What ``model.decoder.forward.forward`` needs for LoRA: the slots (per layer, or packed), and each
    row's slot (``[B]``)."""

    weights: LoraWeights | PackedLoraWeights
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
    """The logical axis names of one layer's buffers (for ``model.runtime.sharding``): each ``A`` split
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
    """One layer's slots and the rows' slots: the deltas ``model.decoder.forward`` adds to its matmuls."""

    weights: LayerSlots | PackedLayerSlots
    slots: jax.Array  # [B]
    kernel: bool  # the program is unsharded: the CPU kernel may add the deltas

    def add(self, group: str, y: jax.Array, x: jax.Array) -> jax.Array:
        """``y [B, S, out...]``, the base result of ``group``'s projection (fused as the model
        keeps it: QKV ``[KVH, G + 2, Dh]``, gate/up ``[2, I]``), plus each row's delta for
        ``x [B, S, in...]``: by the kernel where the slots are packed and it takes the types,
        else by XLA."""
        # The fused output's leading dims that every target shares: QKV's KV heads.
        groups = y.shape[2] if group == "qkv" else 1
        B, S = x.shape[:2]

        def by_xla(y: jax.Array, x: jax.Array, weights: LayerSlots | PackedLayerSlots, slots: jax.Array) -> jax.Array:
            if isinstance(weights, PackedLayerSlots):
                weights = weights.unpacked()
            bs = tuple(weights.b[t] for t in GROUPS[group])
            deltas = [d.reshape(B, S, groups, -1) for d in _deltas(x, weights.a[group], slots, bs)]
            return (y + jnp.concatenate(deltas, axis=-1).reshape(y.shape)).astype(y.dtype)

        packed = self.weights
        if not (isinstance(packed, PackedLayerSlots) and self.kernel and kernel_available()
                and takes(y, x, packed.buffer)):
            return by_xla(y, x, self.weights, self.slots)
        a_offset, a_shape, a_scale_offset = next((o, shape, so) for g, o, shape, so in packed.layout.a if g == group)
        b = {t: (o, shape, so) for t, o, shape, so in packed.layout.b}
        members = GROUPS[group]
        int8 = packed.buffer.dtype == jnp.int8

        def by_kernel(y: jax.Array, x: jax.Array, buffer: jax.Array, scales: jax.Array, slots: jax.Array) -> jax.Array:
            out = lora_add(y.reshape(B * S, -1), x.reshape(B * S, -1), jnp.repeat(slots, S), buffer, scales,
                           groups=groups, rank=a_shape[0] // len(members), a_offset=a_offset,
                           b_offsets=[b[t][0] for t in members], outputs=[int(np.prod(b[t][1][1:])) for t in members],
                           a_scale_offset=a_scale_offset, b_scale_offsets=[b[t][2] for t in members] if int8 else [])
            return out.reshape(y.shape)

        def by_xla_packed(y: jax.Array, x: jax.Array, buffer: jax.Array, scales: jax.Array, slots: jax.Array
                          ) -> jax.Array:
            return by_xla(y, x, PackedLayerSlots(buffer, scales, packed.layout), slots)

        return on_cpu(y, x, packed.buffer, packed.scales, self.slots, cpu=by_kernel, default=by_xla_packed)


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
