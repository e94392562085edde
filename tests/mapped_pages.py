"""How much of a file is mapped into this process now: the loaders must not leave a checkpoint's
pages counted in their RSS once they have copied a tensor out (Linux's /proc/self/smaps)."""

from __future__ import annotations

import mmap
import os

# Where the measure (and the loaders' unmapping, for GGUF) exists.
AVAILABLE = hasattr(mmap, "MADV_DONTNEED") and os.path.exists("/proc/self/smaps")


def mapped_kib(path: os.PathLike | str) -> int:
    """KiB of ``path``'s pages mapped into this process (its mappings' ``Rss`` in smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ... path"
                inside = line.rstrip().endswith(str(path))
            elif inside and head == "Rss:":
                total += int(line.split()[1])
    return total
