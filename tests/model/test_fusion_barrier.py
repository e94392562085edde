"""``model.kernels.fusion_barrier``: arrays pass through unchanged, and a program computes them once.

The second test is the reason the barrier exists: XLA CPU fused RoPE's cos and sin into every
layer's rotations and evaluated them per element of q and k. It counts the transcendental ops
in the optimized program, with the barrier and without it (so it can fail).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from raylm.model.decoder import layers
from raylm.model.decoder.layers import Rope, apply_rope, rope_cos_sin
from raylm.model.kernels import fusion_barrier

needs_kernel = pytest.mark.skipif(
    not fusion_barrier.available(),
    reason="C++ kernel not built (no compiler or jaxlib headers at install); arrays pass unchanged",
)


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8, jnp.int32])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5, 64)])
def test_materialized_arrays_are_the_same_bits(dtype, shape: tuple[int, ...]) -> None:
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape) * 50, jnp.float32).astype(dtype)
    y = jnp.asarray(np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape))
    out = jax.jit(lambda a, b: fusion_barrier.materialized(a * 2, b + 1))(x, y)
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(x * 2))
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(y + 1))


def _layers_program(positions: jax.Array, q: jax.Array, k: jax.Array) -> jax.Array:
    """Four 'layers' rotating q and k by the same tables, as the model's forward does."""
    rope = Rope(np.float32(1.0) / (10000.0 ** (np.arange(0, 64, 2, dtype=np.float32) / 64)))
    cos, sin = rope_cos_sin(positions, rope)
    for _ in range(4):
        q = apply_rope(q, cos, sin) * 1.5
        k = apply_rope(k, cos, sin) + q[:, :, :2]
    return q.sum() + k.sum()


def _transcendentals() -> int:
    """cos and sin ops in the optimized program."""
    rng = np.random.default_rng(1)
    positions = jnp.asarray(rng.integers(0, 4000, (16, 1)), jnp.int32)
    q = jnp.asarray(rng.standard_normal((16, 1, 6, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((16, 1, 2, 64)), jnp.float32)
    program = jax.jit(lambda *args: _layers_program(*args))  # traced afresh: `materialized` may be patched
    text = program.lower(positions, q, k).compile().as_text()
    return len(re.findall(r"\b(?:cosine|sine)\(", text))


@needs_kernel
def test_rope_tables_are_computed_once_per_program(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _transcendentals() == 2  # one cos, one sin
    monkeypatch.setattr(layers, "materialized", lambda *arrays: arrays)
    assert _transcendentals() > 2  # what XLA does without the barrier: one of each per rotation
