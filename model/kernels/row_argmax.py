"""Each row's argmax (greedy decoding's token) by a C++ kernel on CPU.

XLA CPU computes ``argmax`` over a decode batch's logits as reductions that each read the whole
[B, V] array on one thread: 2-4 ms of a 64-row decode step of the bundled model (~40 ms in the
integer mode). ``model/kernels/argmax.cc`` reads each row once, on both threads. Off CPU,
without the built kernel, or for other shapes and types, the caller's jnp formulation runs.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from raylm.model.kernels import CpuKernel, on_cpu

_KERNEL = CpuKernel("argmax", "RaylmArgmax", "raylm_argmax")


def available() -> bool:
    """Whether the C++ kernel is built and registered with JAX (CPU only)."""
    return _KERNEL.available()


def row_argmax(logits: jax.Array, portable: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """int32 ``[B]``: each row of float32 ``logits [B, V]``'s first maximum (its first NaN if it has
    one), by the kernel on CPU; ``portable(logits)`` elsewhere, which must give the same."""
    if logits.ndim != 2 or logits.dtype != jnp.float32 or not available():
        return portable(logits)
    kernel = jax.ffi.ffi_call(_KERNEL.target, jax.ShapeDtypeStruct(logits.shape[:1], jnp.int32))
    return on_cpu(logits, cpu=kernel, default=portable)
