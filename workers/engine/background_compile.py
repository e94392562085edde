"""A served engine's background warm-up, on a thread of its own beside the engine thread.

``LLMEngine(background_warmup=True)`` compiles the programs a request alone takes before it is
built; this thread compiles the rest, in the engine's order (``workers/runner/warmup_order.py``),
while the engine thread keeps stepping. On the engine thread each of them cost the steps behind
it the whole compile, about a second even from a warm persistent cache (JAX traces and lowers a
program to find its cache key), and a request that came then waited seconds; here the compile
shares the CPU with the steps instead (docs/performance.md, "Start-up"). The engine thread only
learns what is compiled, through its command queue (``Compiled``), and stops holding prompt
chunks to the buckets compiled so far. A step that needs a program the thread has not reached
compiles it itself, as an engine without warm-up does; the thread then finds it in JAX's caches.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

from raylm.workers.engine.engine_commands import Compiled

if TYPE_CHECKING:
    from raylm.workers.runner.model_runner import ModelRunner


class BackgroundCompile:
    """Compiles ``shapes`` one after another with ``runner.compile`` and reports each to the
    engine thread with ``report`` (``AsyncEngine``'s queue); stops at the first failure."""

    def __init__(self, runner: ModelRunner, num_scheduler_steps: int, shapes: list[tuple[str, tuple[int, ...]]],
                 report: Callable[[Compiled], None]):
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._compile, args=(runner, num_scheduler_steps, list(shapes), report),
                                        name="raylm-compile", daemon=True)
        self._thread.start()

    def _compile(self, runner: ModelRunner, num_scheduler_steps: int, shapes: list[tuple[str, tuple[int, ...]]],
                 report: Callable[[Compiled], None]) -> None:
        for shape in shapes:
            if self._stopping.is_set():
                return
            try:
                runner.compile(num_scheduler_steps, shape)
            except Exception as err:  # the engine thread logs it and ends the warm-up
                report(Compiled(shape, err))
                return
            report(Compiled(shape))

    def stop(self, timeout: float) -> None:
        """Compile nothing more, and wait up to ``timeout`` seconds for a compile under way."""
        self._stopping.set()
        self._thread.join(timeout)
