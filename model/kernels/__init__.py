"""C++ CPU kernels called from JAX through ``jax.ffi``; setup.py builds them at install time.

The built libraries are plain shared objects (loaded with ctypes, not imported); their
Python wrappers and jnp fallbacks live in ``model`` (``model.paged_decode``, ``model.dense``).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import pathlib
from typing import NamedTuple

import jax

logger = logging.getLogger(__name__)

_DIRECTORY = pathlib.Path(__file__).parent


@functools.cache
def unavailable_reason(library: str, symbol: str, target: str) -> str | None:
    """Load ``_<library>.*.so`` and register its handler ``symbol`` as the CPU FFI target
    ``target``, once per process; ``None`` on success, else why not (logged once, so a missing
    build is visible but not fatal: callers fall back to their jnp path)."""
    stem = _DIRECTORY / f"_{library}"
    built = [p for s in importlib.machinery.EXTENSION_SUFFIXES if (p := stem.with_suffix(s)).exists()]
    if not built:
        reason = (
            f"{stem}.*.so was not built (no C++ compiler or jaxlib headers when the package "
            "was installed); reinstall with `pip install -e .` to build it"
        )
    else:
        try:
            handler = getattr(ctypes.CDLL(str(built[0])), symbol)
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
            return None
        except (OSError, AttributeError) as e:
            reason = f"cannot load {built[0]}: {e}"
    logger.warning("%s kernel unavailable, using the jnp path: %s", library, reason)
    return reason


class CpuKernel(NamedTuple):
    """One kernel library: its file stem under model/kernels, handler symbol and FFI target."""

    library: str
    symbol: str
    target: str

    def available(self) -> bool:
        """Whether the library is built and registered with JAX (CPU only)."""
        return unavailable_reason(*self) is None

    def require(self) -> None:
        """Raise ``RuntimeError`` saying why if the kernel cannot run here."""
        if reason := unavailable_reason(*self):
            raise RuntimeError(f"{self.library} kernel unavailable: {reason}")
