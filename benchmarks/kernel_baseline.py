"""A commit's CPU kernel compiled beside this tree's, for A/B runs inside one process.

Kernel changes of a few percent are below what separate processes can resolve on a shared
machine (its speed drifts by tens of percent between minutes); loaded in one process, two builds
can run in alternating rounds instead (``dense_kernel_ab``, ``lora_kernel_ab``).
"""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Iterable
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]


def build_baseline(revision: str, source: str, out_dir: Path) -> Path:
    """``revision``'s ``model/kernels/<source>.cc`` (and the headers it includes, from the same
    commit) compiled as a shared library in ``out_dir``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "model/kernels"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out_dir)], input=archive, check=True)
    library = out_dir / f"_{source}.so"
    # setup.py's flags (its extra_compile_args; setup.py runs setup() when imported, so they are
    # repeated here) plus what a shared library needs.
    subprocess.run(["g++", "-std=c++17", "-O3", "-fopenmp-simd", "-Wno-psabi", "-fPIC", "-shared",
                    "-isystem", jax.ffi.include_dir(), str(out_dir / f"model/kernels/{source}.cc"), "-o", str(library)],
                   check=True)
    return library


def register_baseline(library: Path, handlers: dict[str, str]) -> None:
    """Registers ``library``'s handler symbols as CPU FFI targets (``handlers``: target -> symbol)."""
    handle = ctypes.CDLL(str(library))
    for target, symbol in handlers.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, symbol)), platform="cpu")


def require_builds(baseline: str, tree: str, targets: Iterable[str]) -> None:
    """Raises unless the lowered text of the baseline's program calls one of ``targets`` (the
    baseline's FFI targets) and this tree's calls none: a ``model.kernels.tracing_targets``
    mapping naming a target this tree no longer uses, or a trace of one program reused for the
    other (JAX caches traces by function, and the mapping is not part of the key), would
    otherwise time one build against itself."""
    def calls(lowered: str) -> bool:
        return any(f"custom_call @{target}(" in lowered for target in targets)

    if not calls(baseline) or calls(tree):
        raise SystemExit(f"the baseline's program must call one of {sorted(targets)} and this tree's none: is the "
                         f"tracing_targets mapping current, and does each program trace a function of its own?")
