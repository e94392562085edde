"""Each row's LoRA delta added to a projection's result by a C++ kernel on CPU.

``model/kernels/lora_delta.cc`` reads each row's adapter in place in the slot buffers
(model/decoder/lora_slots.py), once per call however many rows share it, and adds the deltas into the
base result (the call's result aliases it). XLA's gathered form copied every row's adapter out
of the slots on every step and ran a dozen small ops per group of targets: at rank 64 a
single stream decoded at a third of the base model's speed on the bundled model (0.35x,
docs/performance.md). The kernel sums like the dense kernel (model/kernels/dense.py), in an order that
does not depend on the batch, so a row's delta is the same bits alone or beside other adapters.
The slots are one array for every layer (``PackedLoraWeights``: a step's argument per layer
and target cost the bundled model's single stream as much as its adapter's arithmetic), and may
be bfloat16 or int8 (``engine.lora_dtype``): the kernel widens them exactly as it reads them
(int8 with a scale per row of ``A`` and per output of ``B``), a half or a quarter of the bytes
of float32 slots. Like the other kernels it is built by ``pip install``;
the caller keeps XLA's form for other backends, sharded programs (XLA cannot partition a custom
call) and other operand types (``takes``).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from raylm.model.kernels import CpuKernel, traced_target

_KERNEL = CpuKernel("lora_delta", "RaylmLoraAdd", "raylm_lora_add")


def available() -> bool:
    """Whether the C++ kernel is built and registered with JAX (CPU only)."""
    return _KERNEL.available()


SLOT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.int8))


def takes(y: jax.Array, x: jax.Array, weights: jax.Array) -> bool:
    """Whether the kernel computes with these operands: float32 ``y`` and ``x``, and the packed
    slots ``weights`` float32, bfloat16 or int8."""
    return y.dtype == x.dtype == jnp.float32 and jnp.dtype(weights.dtype) in SLOT_DTYPES


def lora_add(y: jax.Array, x: jax.Array, slots: jax.Array, weights: jax.Array, scales: jax.Array, *, groups: int,
             rank: int, a_offset: int, b_offsets: Sequence[int], outputs: Sequence[int], a_scale_offset: int = 0,
             b_scale_offsets: Sequence[int] = ()) -> jax.Array:
    """``y [M, N]`` plus, for each row ``m`` with ``slots[m] = s >= 1``, ``(x[m] A^T) B_t^T`` of
    buffer ``s - 1`` for every target ``t``, by the kernel; raises if it is unavailable.

    ``x [M, K]``; ``weights [n, S]``: buffer ``b``'s adapter in row ``b``, holding at ``a_offset``
    the ``T`` targets' ``A [T * rank, K]`` and at ``b_offsets[t]`` target ``t``'s ``B^T [rank,
    outputs[t]]`` (model/decoder/lora_slots.py packs them so); see ``takes`` for the types. int8 weights
    have float32 ``scales [n, S2]``: ``A``'s per row at ``a_scale_offset``, each ``B``'s per output
    at ``b_scale_offsets[t]`` (for float weights ``scales`` is ignored, ``[n, 0]`` will do). ``y``'s
    columns are ``groups`` groups, target ``t`` owning ``outputs[t] / groups`` consecutive columns of
    each after the earlier targets' (the fused QKV's layout: a group per KV head)."""
    _KERNEL.require()
    if not takes(y, x, weights):
        raise ValueError(f"lora_add takes float32 y and x and float32, bfloat16 or int8 weights, got "
                         f"{[str(array.dtype) for array in (y, x, weights)]}")
    call = jax.ffi.ffi_call(traced_target(_KERNEL.target), jax.ShapeDtypeStruct(y.shape, y.dtype),
                            input_output_aliases={0: 0})
    return call(y, x, slots.astype(jnp.int32), weights, scales, groups=groups, rank=rank, a_offset=a_offset,
                b_offsets=np.asarray(b_offsets, np.int64), outputs=np.asarray(outputs, np.int64),
                a_scale_offset=a_scale_offset, b_scale_offsets=np.asarray(b_scale_offsets, np.int64))
