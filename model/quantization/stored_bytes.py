"""What the matrices kept as stored (GGUF blocks, the integer mode's panels) say about
themselves alike: their input dims, whether they hold 4-bit nibbles, and their bytes."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


class StoredBytes:
    """A mixin for a pytree dataclass with 8-bit storage ``q`` (uint8 nibbles for 4-bit formats)
    and a static ``input_shape``: the dims a matmul contracts."""

    q: Any
    input_shape: tuple[int, ...]

    @property
    def num_input_dims(self) -> int:
        return len(self.input_shape)

    @property
    def nibbles(self) -> bool:
        """4-bit values (two a byte), else 8-bit."""
        return self.q.dtype == np.uint8

    @property
    def nbytes(self) -> int:
        """Every array the matrix keeps: the values and all their scales and offsets."""
        return int(sum(leaf.nbytes for leaf in jax.tree.leaves(self)))
