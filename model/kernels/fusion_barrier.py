"""Arrays that an XLA CPU program computes once, where XLA would recompute them in every consumer.

XLA's fusion copies a cheap-looking elementwise producer into each fusion that reads it, and
its CPU pipeline removes ``jax.lax.optimization_barrier`` before fusing. For RoPE that meant
the cos and sin of every position were evaluated again for every element of q and k, in each
of the model's layers: on the bundled model a 64-row decode step spent ~3 ms of its ~43 ms
(integer mode) there, a 512-token prompt chunk 16 ms. ``materialized`` passes the arrays
through a custom call (``model/kernels/fusion_barrier.cc``, a copy XLA cannot see through), so
they are computed once and read by every layer. The arrays are the same bits either way (a
copy), but XLA fuses the program around them differently, so results can move in their last
bits (the bundled model's logprobs by up to 1.1e-5; greedy tokens were the same). Off CPU, or
without the built kernel, the arrays pass unchanged.
"""

from __future__ import annotations

import jax

from raylm.model.kernels import CpuKernel, on_cpu

_KERNEL = CpuKernel("fusion_barrier", "RaylmFusionBarrier", "raylm_fusion_barrier")


def available() -> bool:
    """Whether the C++ kernel is built and registered with JAX (CPU only)."""
    return _KERNEL.available()


def _barrier(x: jax.Array) -> jax.Array:
    return jax.ffi.ffi_call(_KERNEL.target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def materialized(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """``arrays``, each computed once in the program rather than in each of its readers (CPU)."""
    if not available():
        return arrays
    return on_cpu(*arrays, cpu=lambda *xs: tuple(_barrier(x) for x in xs), default=lambda *xs: xs)
