"""One KV block as bytes: how a replica's pool arrays become a tier's fixed-size payload and back.

A replica's KV lives in a few device arrays, each ``[layers, num_blocks, block_size, ...]``:
K and V (or MLA's latents alone), an 8-bit pool's scales, a draft model's K and V under the same
block tables. Block ``b`` of the replica is ``array[:, b]`` of each. A payload is those slices,
in the arrays' order, as one flat uint8 vector: a tier moves and checks one buffer per block and
never needs to know the model. The layout's ``signature`` enters the tier keys
(``identity.namespace``), so only a replica with the same layout ever decodes a payload.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Per pool array: the shape of one block's slice (``[layers, block_size, ...]``, the blocks
    axis removed) and its element type."""

    slices: tuple[tuple[tuple[int, ...], np.dtype], ...]

    @classmethod
    def of(cls, arrays: list) -> BlockLayout:
        """The layout of pool arrays shaped ``[layers, num_blocks, ...]`` (anything with
        ``shape`` and ``dtype``: device arrays, NumPy arrays, shape structs)."""
        slices = []
        for array in arrays:
            if len(array.shape) < 2:
                raise ValueError(f"a KV pool array has a layers and a blocks axis; got shape {array.shape}")
            slices.append(((array.shape[0], *array.shape[2:]), np.dtype(array.dtype)))
        return cls(tuple(slices))

    @property
    def nbytes(self) -> int:
        """Bytes of one block's payload."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.slices)

    @property
    def signature(self) -> str:
        """The layout in words, for the tier namespace: two layouts that differ never share blocks."""
        return ";".join(f"{dtype.name}{list(shape)}" for shape, dtype in self.slices)

    def encode(self, gathered: list[np.ndarray]) -> np.ndarray:
        """Payloads ``[n, nbytes]`` (uint8) of ``n`` blocks gathered from each pool array as
        ``[layers, n, ...]`` (``array[:, block_ids]``)."""
        self._check(gathered, "gathered")
        n = gathered[0].shape[1]
        parts = [np.ascontiguousarray(np.moveaxis(g, 1, 0)).reshape(n, -1).view(np.uint8) for g in gathered]
        return np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

    def decode(self, payloads: np.ndarray) -> list[np.ndarray]:
        """The inverse of ``encode``: ``[n, nbytes]`` payloads as each pool array's ``[layers, n, ...]``."""
        if payloads.ndim != 2 or payloads.shape[1] != self.nbytes or payloads.dtype != np.uint8:
            raise ValueError(f"payloads must be uint8 [n, {self.nbytes}], got {payloads.dtype} {list(payloads.shape)}")
        n, arrays, offset = payloads.shape[0], [], 0
        for shape, dtype in self.slices:
            size = math.prod(shape) * dtype.itemsize
            flat = np.ascontiguousarray(payloads[:, offset:offset + size]).view(dtype)
            arrays.append(np.moveaxis(flat.reshape(n, *shape), 0, 1))
            offset += size
        return arrays

    def _check(self, arrays: list[np.ndarray], what: str) -> None:
        if len(arrays) != len(self.slices):
            raise ValueError(f"{what}: {len(arrays)} arrays for a layout of {len(self.slices)}")
        for array, (shape, dtype) in zip(arrays, self.slices):
            if (array.shape[0], *array.shape[2:]) != shape or np.dtype(array.dtype) != dtype:
                raise ValueError(f"{what}: an array {array.dtype} {list(array.shape)} does not match "
                                 f"{dtype} {list(shape)} with a blocks axis")
