"""Whether the backend runs the 8-bit floats (float8_e4m3fn) that fp8 weights and an fp8 KV
cache are stored in.

XLA's backends differ in which element types they compile: CPU widens fp8 in software,
recent GPUs have it natively, and an older accelerator or a plugin may have no lowering for
it at all. A setting the backend cannot run must stop the replica at start-up with the
setting's name, not surface as a compile error deep inside warm-up or a user's first request.
The probe runs the operations the fp8 paths are made of (scale and store as e4m3fn, widen,
multiply) once per device, and compares the result with the host's exact answer.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

_PROBE_INPUT = np.linspace(-3.0, 3.0, 4 * 32, dtype=np.float32).reshape(4, 32)


def _probe(x: np.ndarray, device: jax.Device) -> np.ndarray:
    """Store ``x`` as e4m3fn, widen it back and multiply it by its transpose, on ``device``."""

    def program(x: jax.Array) -> jax.Array:
        widened = x.astype(jnp.float8_e4m3fn).astype(jnp.float32)
        return widened @ widened.T

    return np.asarray(jax.jit(program)(jax.device_put(x, device)))


@functools.lru_cache(maxsize=None)
def _fp8_problem(device: jax.Device) -> str | None:
    """Why ``device`` cannot run fp8 (None: it can)."""
    try:
        got = _probe(_PROBE_INPUT, device)
    except Exception as error:  # what XLA raises for a missing lowering varies by backend and version
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"compiling float8_e4m3fn failed: {first_line}"
    widened = _PROBE_INPUT.astype(jnp.float8_e4m3fn).astype(np.float32)  # numpy's (ml_dtypes) conversion
    if not np.allclose(got, widened @ widened.T, rtol=1e-5, atol=1e-5):
        return "float8_e4m3fn values come back wrong"
    return None


def check_fp8(settings: Sequence[str], device: jax.Device | None = None) -> None:
    """Raise ``ValueError`` naming ``settings`` (e.g. ``model.quantization: fp8``) when
    ``device`` (default: the first device) cannot run fp8; nothing to check for no settings."""
    if not settings:
        return
    device = device or jax.devices()[0]
    problem = _fp8_problem(device)
    if problem is not None:
        raise ValueError(
            f"{' and '.join(settings)}: this backend ({device.platform}, {device.device_kind}) cannot run "
            f"8-bit floats ({problem}). Use int8 instead, which every backend runs"
        )
