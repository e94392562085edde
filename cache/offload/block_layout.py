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
from collections.abc import Sequence

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

    def encode(self, arrays: list[np.ndarray], blocks: Sequence[int]) -> np.ndarray:
        """Payloads ``[n, nbytes]`` (uint8) of blocks ``blocks`` of arrays shaped ``[layers,
        blocks, ...]`` (a pool itself, or blocks gathered from one). Each block's slice is copied
        once, straight into its payload row."""
        self._check(arrays, "arrays")
        out = np.empty((len(blocks), self.nbytes), np.uint8)
        offset = 0
        for array, (shape, dtype) in zip(arrays, self.slices):
            size = math.prod(shape) * dtype.itemsize
            for row, block in enumerate(blocks):
                out[row, offset:offset + size].view(dtype).reshape(shape)[...] = array[:, block]
            offset += size
        return out

    def decode(self, payloads: np.ndarray) -> list[np.ndarray]:
        """Each pool array's blocks ``[n, layers, ...]`` (block-major, contiguous) from ``[n,
        nbytes]`` payloads: views of one copy per array, in the order the payload holds them."""
        if payloads.ndim != 2 or payloads.shape[1] != self.nbytes or payloads.dtype != np.uint8:
            raise ValueError(f"payloads must be uint8 [n, {self.nbytes}], got {payloads.dtype} {list(payloads.shape)}")
        n, arrays, offset = payloads.shape[0], [], 0
        for shape, dtype in self.slices:
            size = math.prod(shape) * dtype.itemsize
            arrays.append(np.ascontiguousarray(payloads[:, offset:offset + size]).view(dtype).reshape(n, *shape))
            offset += size
        return arrays

    def _check(self, arrays: list[np.ndarray], what: str) -> None:
        if len(arrays) != len(self.slices):
            raise ValueError(f"{what}: {len(arrays)} arrays for a layout of {len(self.slices)}")
        for array, (shape, dtype) in zip(arrays, self.slices):
            if (array.shape[0], *array.shape[2:]) != shape or np.dtype(array.dtype) != dtype:
                raise ValueError(f"{what}: an array {array.dtype} {list(array.shape)} does not match "
                                 f"{dtype} {list(shape)} with a blocks axis")
