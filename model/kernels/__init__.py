"""Kernels per platform: C++ CPU kernels called from JAX through ``jax.ffi`` (setup.py builds
them at install time), Pallas kernels for GPUs (``model.kernels.pallas``), and how a traced
program picks between them and the portable jnp path (``on_cpu``, ``on_gpu``).

The built libraries are plain shared objects (loaded with ctypes, not imported); their
Python wrappers and jnp fallbacks live beside them (``model.kernels.paged_decode``, ``model.kernels.dense``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.machinery
import logging
import pathlib
from typing import Any, Callable, Iterator, NamedTuple

import jax

logger = logging.getLogger(__name__)

_DIRECTORY = pathlib.Path(__file__).parent


def _built(library: str) -> list[pathlib.Path]:
    """The built ``_<library>.*.so`` files (none where the build was skipped)."""
    stem = _DIRECTORY / f"_{library}"
    return [p for s in importlib.machinery.EXTENSION_SUFFIXES if (p := stem.with_suffix(s)).exists()]


@functools.cache
def unavailable_reason(library: str, symbol: str, target: str) -> str | None:
    """Load ``_<library>.*.so`` and register its handler ``symbol`` as the CPU FFI target
    ``target``, once per process; ``None`` on success, else why not (logged once, so a missing
    build is visible but not fatal: callers fall back to their jnp path)."""
    stem = _DIRECTORY / f"_{library}"
    built = _built(library)
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

    def c_function(self, name: str) -> Any:
        """The plain C function ``name`` of the kernel's library (ctypes; the library loaded once)."""
        self.require()
        return getattr(ctypes.CDLL(str(_built(self.library)[0])), name)


_every_platform = False  # set by ``lowering_for_every_platform``
_traced_targets: dict[str, str] = {}  # set by ``tracing_targets``


@contextlib.contextmanager
def tracing_targets(targets: dict[str, str]) -> Iterator[None]:
    """Inside, calls of each FFI target in ``targets`` are traced as calls of the target it maps
    to (registered by the caller with the same signature): deploy/benchmarks' ``*_kernel_ab``
    trace a commit's build of a kernel beside this tree's, through the same Python code."""
    global _traced_targets
    before, _traced_targets = _traced_targets, {**_traced_targets, **targets}
    try:
        yield
    finally:
        _traced_targets = before


def traced_target(target: str) -> str:
    """The FFI target a kernel's call of ``target`` traces (``target`` itself but inside
    ``tracing_targets``)."""
    return _traced_targets.get(target, target)


@functools.cache
def cpu_only_process() -> bool:
    """JAX's default backend is the CPU only when no accelerator is present (or ``JAX_PLATFORMS``
    excluded them): then every program this process lowers runs on the CPU."""
    return jax.default_backend() == "cpu"


@contextlib.contextmanager
def lowering_for_every_platform() -> Iterator[None]:
    """Inside, ``on_cpu`` traces every branch, as cross-platform lowering needs (a CPU process
    lowering or exporting its programs for an accelerator: ``.lower(lowering_platforms=...)``)."""
    global _every_platform
    before, _every_platform = _every_platform, True
    try:
        yield
    finally:
        _every_platform = before


def on_cpu(*args: Any, cpu: Callable[..., Any], default: Callable[..., Any]) -> Any:
    """``jax.lax.platform_dependent(*args, cpu=cpu, default=default)``, tracing ``cpu`` alone
    in a CPU-only process. ``platform_dependent`` traces every branch (the platform is chosen
    when the program is lowered), and at a replica's start the unused XLA branches were half of
    its engine's build time (6.5 s of 12.3 s from a warm compilation cache, bundled model).
    With an accelerator present, or inside ``lowering_for_every_platform``, both are kept."""
    if cpu_only_process() and not _every_platform:
        return cpu(*args)
    return jax.lax.platform_dependent(*args, cpu=cpu, default=default)


_interpreting_gpu_kernels = False  # set by ``interpreting_gpu_kernels``


@contextlib.contextmanager
def interpreting_gpu_kernels() -> Iterator[None]:
    """Inside, ``on_gpu`` traces its GPU branch alone, and the Pallas kernels it calls run in
    interpret mode: a CPU process (the test suite) runs the GPU kernels through whole programs.
    Programs jitted inside keep the choice in their compilation cache entries."""
    global _interpreting_gpu_kernels
    before, _interpreting_gpu_kernels = _interpreting_gpu_kernels, True
    try:
        yield
    finally:
        _interpreting_gpu_kernels = before


def gpu_kernels_interpreted() -> bool:
    """Whether Pallas GPU kernels traced now run in interpret mode (``interpreting_gpu_kernels``)."""
    return _interpreting_gpu_kernels


def on_gpu(*args: Any, gpu: Callable[..., Any], default: Callable[..., Any]) -> Any:
    """``jax.lax.platform_dependent(*args, cuda=gpu, default=default)``: ``gpu`` (a Pallas
    Triton kernel) where the program is lowered for an NVIDIA GPU, ``default`` elsewhere. A
    CPU-only process traces ``default`` alone (as ``on_cpu`` does), unless inside
    ``lowering_for_every_platform``; inside ``interpreting_gpu_kernels``, ``gpu`` alone."""
    if _interpreting_gpu_kernels:
        return gpu(*args)
    if cpu_only_process() and not _every_platform:
        return default(*args)
    return jax.lax.platform_dependent(*args, cuda=gpu, default=default)
