"""Giving the host memory that loading freed back to the system.

Why: loading a checkpoint and packing it for a kernel (the integer mode's panels, a transcoded
GGUF tensor, a quantized copy) allocates and frees many arrays of a few MiB. glibc's ``malloc``
serves an allocation from its heaps once it is under the mmap threshold, which rises as large
blocks are freed (up to 32 MiB), and a heap keeps freed pages mapped. The process then stays
resident at what it held at its peak, not at what it holds: a random 3B Q4_K_M file served in the
integer mode held ~2.1 GiB more than in the exact mode, for the same bytes of weights.
``malloc_trim(0)`` returns every free page of every heap to the system. Elsewhere (musl, macOS)
there is nothing to call and nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():  # -> the C function, or None where the C library has none
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_heap() -> bool:
    """Return the C heap's free pages to the system (after a load, once its temporaries are
    dropped); returns whether the C library could do it. Takes milliseconds: call it after a
    load, never per step."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
