"""Each row's LoRA delta added to a projection's result by a C++ kernel on CPU.

``model/kernels/lora_delta.cc`` reads each row's adapter in place in the slot buffers
(model/lora_weights.py), once per call however many rows share it, and adds the deltas into the
base result (the call's result aliases it). XLA's gathered form copied every row's adapter out
of the slots on every step and ran a dozen small ops per group of targets: at rank 64 a
single stream decoded at a third of the base model's speed on the bundled model (0.35x,
docs/performance.md). The kernel sums like the dense kernel (model/dense.py), in an order that
does not depend on the batch, so a row's delta is the same bits alone or beside other adapters.
The slots may be bfloat16 (``engine.lora_dtype``): the kernel widens them exactly as it reads
them, half the bytes of float32 slots. Like the other kernels it is built by ``pip install``;
the caller keeps XLA's form for other backends, sharded programs (XLA cannot partition a custom
call) and other operand types (``takes``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from model.kernels import CpuKernel

_KERNEL = CpuKernel("lora_delta", "RaylmLoraAdd", "raylm_lora_add")


def available() -> bool:
    """Whether the C++ kernel is built and registered with JAX (CPU only)."""
    return _KERNEL.available()


def takes(y: jax.Array, x: jax.Array, weights: list[jax.Array]) -> bool:
    """Whether the kernel computes with these operands: float32 ``y`` and ``x``, and the slots'
    ``weights`` all float32 or all bfloat16."""
    kinds = {jnp.dtype(w.dtype) for w in weights}
    return y.dtype == x.dtype == jnp.float32 and len(kinds) == 1 and kinds <= {jnp.dtype(jnp.float32),
                                                                               jnp.dtype(jnp.bfloat16)}


def lora_add(y: jax.Array, x: jax.Array, a: jax.Array, slots: jax.Array, bs: list[jax.Array], groups: int) -> jax.Array:
    """``y [M, N]`` plus, for each row ``m`` with ``slots[m] = s >= 1``, ``(x[m] A^T) B_t^T`` of
    buffer ``s - 1`` for every target ``t``, by the kernel; raises if it is unavailable.

    ``x [M, K]``, ``a [n, T * R, K]`` (the ``T`` targets' ``A`` side by side), ``bs``: ``T``
    arrays ``[n, R, O_t]`` (``B`` transposed); see ``takes`` for the types. ``y``'s columns are ``groups`` groups, target ``t``
    owning ``O_t / groups`` consecutive columns of each after the earlier targets' (the fused
    QKV's layout: a group per KV head)."""
    _KERNEL.require()
    if not takes(y, x, [a, *bs]):
        raise ValueError(f"lora_add takes float32 y and x and float32 or bfloat16 weights, got "
                         f"{[str(array.dtype) for array in (y, x, a, *bs)]}")
    call = jax.ffi.ffi_call(_KERNEL.target, jax.ShapeDtypeStruct(y.shape, y.dtype), input_output_aliases={0: 0})
    return call(y, x, a, slots.astype(jnp.int32), *bs, groups=groups)
