"""Maps the top-level folders onto the one import name ``raylm`` and builds the optional C++ CPU
kernels in model/kernels; all other metadata is in pyproject.toml.

``raylm`` is a namespace package: the repository keeps its top-level folders (model/, cache/,
workers/, router/, cluster/, deploy/, benchmarks/) and the install maps each onto
``raylm.<folder>``, so a user's own ``model.py`` or ``cache.py`` never shadows ours.

The kernels include XLA's FFI headers, which ship inside jaxlib (a build requirement). The
extension is optional: without a C++ compiler or those headers the install still succeeds,
and at run time ``model.kernels.paged_decode.available()`` / ``model.kernels.dense.available()`` are False
and the jnp / XLA paths are used.
Plain ``-O3`` keeps the binaries portable; the hot functions are multiversioned (AVX-512 / AVX2
clones chosen at load time) inside the source.
"""

import importlib.util
import os
import pathlib

from setuptools import Extension, find_packages, setup

FOLDERS = ("model", "cache", "workers", "router", "cluster", "deploy", "benchmarks")


def _xla_ffi_include_dir() -> str | None:
    """jaxlib's header directory, found without importing jaxlib (that loads XLA)."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = pathlib.Path(spec.submodule_search_locations[0]) / "include"
    return str(include) if (include / "xla" / "ffi" / "api" / "ffi.h").exists() else None


# RAYLM_BUILD_KERNELS=0 builds without them (a platform without a C++ compiler; a quick wheel).
include_dir = _xla_ffi_include_dir() if os.environ.get("RAYLM_BUILD_KERNELS", "1") != "0" else None
if include_dir is None:
    print("raylm: building without the C++ CPU kernels (jnp paths will run): RAYLM_BUILD_KERNELS=0, "
          "or jaxlib's XLA FFI headers not found")


def _kernel(name: str, includes: tuple[str, ...] = ()) -> Extension:
    """``includes``: other kernels' sources that this one compiles in (a rebuild follows them)."""
    return Extension(
        f"raylm.model.kernels._{name}",
        sources=[f"model/kernels/{name}.cc"],
        depends=["model/kernels/bfloat16.h", "model/kernels/column_items.h", "model/kernels/ffi_shape.h",
                 "model/kernels/float16.h", "model/kernels/fp8_e4m3.h", "model/kernels/gguf_blocks.h",
                 "model/kernels/lane_loads.h", "model/kernels/wide_lanes.h", "model/kernels/prompt_gemm.inc",
                 *(f"model/kernels/{i}.cc" for i in includes)],
        language="c++",
        # -isystem: XLA's own headers warn under Python's default flags; ours should not be lost.
        # -Wno-psabi: GCC notes that 8-lane vectors change the ABI of the non-AVX clone's
        # internal helpers, which nothing outside the library calls.
        extra_compile_args=["-std=c++17", "-O3", "-fopenmp-simd", "-Wno-psabi", "-isystem", include_dir],
        optional=True,
    )


kernels = [
    _kernel("paged_decode_attention"), _kernel("dense_matmul"), _kernel("kv_write"),
    _kernel("grouped_matmul", includes=("dense_matmul",)), _kernel("int8_matmul"),
    _kernel("lora_delta", includes=("dense_matmul",)), _kernel("fusion_barrier"),
    _kernel("argmax"),
] if include_dir else []

packages = [f"raylm.{folder}.{sub}" for folder in FOLDERS for sub in find_packages(folder)]
packages += [f"raylm.{folder}" for folder in FOLDERS]
setup(
    packages=packages,
    package_dir={package: package.removeprefix("raylm.").replace(".", "/") for package in packages},
    ext_modules=kernels,
)
