"""release_freed_heap gives freed heap pages back: what keeps a replica's resident memory at what
it holds after a load (model/runtime/host_memory.py), not at the load's peak."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# In a child: this process's heap holds whatever earlier tests freed.
_CHILD = textwrap.dedent("""
    import numpy as np
    from raylm.model.runtime.host_memory import release_freed_heap

    def rss_mib():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024

    big = np.ones(30 << 20, np.uint8)
    del big  # a freed 30 MiB map raises malloc's mmap threshold: what follows comes from the heap
    arrays = [np.ones(2 << 20, np.uint8) for _ in range(100)]  # 200 MiB of 2 MiB arrays, as a load's
    top = np.ones(2 << 20, np.uint8)  # above them: the heap's top cannot shrink when they go
    del arrays
    before = rss_mib()
    done = release_freed_heap()
    print(done, before - rss_mib(), top.sum() > 0)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/status"),
                    reason="glibc's heap and /proc are Linux's")
def test_freed_arrays_leave_the_resident_set():
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "True"
    assert float(out[1]) > 150, f"only {out[1]} MiB of 200 freed MiB left the resident set"
