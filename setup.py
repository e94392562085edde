"""Builds the optional C++ CPU kernels in model/kernels; all other metadata is in pyproject.toml.

The kernels include XLA's FFI headers, which ship inside jaxlib (a build requirement). The
extension is optional: without a C++ compiler or those headers the install still succeeds,
and at run time ``model.paged_decode.available()`` is False and the jnp path is used.
Plain ``-O3`` keeps the binary portable; the hot function is multiversioned (AVX-512 / AVX2
clones chosen at load time) inside the source.
"""

import importlib.util
import pathlib

from setuptools import Extension, setup


def _xla_ffi_include_dir() -> str | None:
    """jaxlib's header directory, found without importing jaxlib (that loads XLA)."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = pathlib.Path(spec.submodule_search_locations[0]) / "include"
    return str(include) if (include / "xla" / "ffi" / "api" / "ffi.h").exists() else None


include_dir = _xla_ffi_include_dir()
if include_dir is None:
    print("raylm: jaxlib's XLA FFI headers not found; skipping the C++ CPU kernels (jnp paths will run)")
kernels = [
    Extension(
        "model.kernels._paged_decode_attention",
        sources=["model/kernels/paged_decode_attention.cc"],
        language="c++",
        # -isystem: XLA's own headers warn under Python's default flags; ours should not be lost.
        extra_compile_args=["-std=c++17", "-O3", "-fopenmp-simd", "-isystem", include_dir],
        optional=True,
    )
] if include_dir else []

setup(ext_modules=kernels)
