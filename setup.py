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


# The headers the kernels include (each kernel is one .cc, compiled on its own): a rebuild follows them.
KERNEL_HEADERS = [f"model/kernels/{header}" for header in (
    "attention_kernel.h", "attention_lanes.h", "attention_math.h", "attention_problem.h", "attention_rows.h",
    "bfloat16.h", "column_items.h", "dense_columns.h", "dense_lanes.h", "dense_tiles.h", "ffi_helpers.h", "float16.h",
    "fp8_e4m3.h", "gguf_blocks.h", "gguf_columns.h", "gguf_operands.h", "group_rows.h", "int8_amx.h",
    "int8_families.h", "int8_vnni.inc", "int8_avx2.inc", "int8_panels.h", "lane_loads.h", "lora_expand.h",
    "wide_lanes.h", "prompt_gemm.inc",
)]


def _kernel(name: str) -> Extension:
    return Extension(
        f"raylm.model.kernels._{name}",
        sources=[f"model/kernels/{name}.cc"],
        depends=KERNEL_HEADERS,
        language="c++",
        # -isystem: XLA's own headers warn under Python's default flags; ours should not be lost.
        # -Wno-psabi: GCC notes that 8-lane vectors change the ABI of the non-AVX clone's
        # internal helpers, which nothing outside the library calls.
        # -g0: no debug info (Python's flags ask for it), a third of the build's time.
        extra_compile_args=["-std=c++17", "-O3", "-g0", "-fopenmp-simd", "-Wno-psabi", "-isystem", include_dir],
        optional=True,
    )


# The slowest first: with a build job per core, the two attention libraries start at once.
kernels = [_kernel(name) for name in (
    "paged_decode_attention", "quantized_paged_decode_attention", "dense_matmul", "grouped_matmul", "lora_delta",
    "int8_matmul", "argmax", "kv_write", "fusion_barrier",
)] if include_dir else []

packages = [f"raylm.{folder}.{sub}" for folder in FOLDERS for sub in find_packages(folder)]
packages += [f"raylm.{folder}" for folder in FOLDERS]
setup(
    packages=packages,
    package_dir={package: package.removeprefix("raylm.").replace(".", "/") for package in packages},
    ext_modules=kernels,
    # The kernels are separate libraries: build them on every core (a fresh install waits on them).
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
)
