"""A one-line progress display on stderr for start-up work (compiling shape buckets)."""

from __future__ import annotations

import sys
import time
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


class StderrProgress:
    """Iterate ``StderrProgress(label)(items)`` to print ``label: i/n (elapsed)`` as items pass."""

    def __init__(self, label: str):
        self.label = label

    def __call__(self, items: Iterable[T]) -> Iterator[T]:
        items = list(items)
        start = time.monotonic()
        for i, item in enumerate(items, 1):
            yield item
            print(f"\r{self.label}: {i}/{len(items)} ({time.monotonic() - start:.0f}s)", end="", file=sys.stderr,
                  flush=True)
        print(file=sys.stderr)
