"""Asyncio front of the engine: a background thread steps it; callers stream per-request outputs.

The engine is not thread-safe, so every mutation (add, abort) is handed to the engine
thread through a command queue and applied between steps.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Sequence, TypeVar

from model import LoadedModel
from workers.engine import LLMEngine, make_engine
from workers.outputs import RequestOutput
from workers.sampling_params import SamplingParams

T = TypeVar("T")


class AsyncEngine:
    """``async for out in engine.generate(prompt, params, request_id)`` streams deltas."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = threading.Event()
        self.last_step_time: float | None = None
        self.step_started: float | None = None  # set while a step runs: a stuck step shows here
        self.error: BaseException | None = None
        self.step_observer: Callable[[int, float], None] | None = None  # (tokens, seconds) per step
        self._thread = threading.Thread(target=self._loop, name="raylm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str | LoadedModel, **engine_args: Any) -> "AsyncEngine":
        return cls(make_engine(model, **engine_args))

    # -- engine thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopped.is_set():
            try:
                block = not self.engine.has_unfinished_requests()
                command = self._commands.get(timeout=0.05) if block else self._commands.get_nowait()
                command()
                while True:
                    self._commands.get_nowait()()
            except queue.Empty:
                pass
            if self.engine.has_unfinished_requests():
                self.step_started = self.step_started_at = time.monotonic()
                try:
                    outputs = self.engine.step()
                except BaseException as err:  # a broken engine must fail requests, not hang them
                    self.error = err
                    for request_id in list(self.engine.requests):
                        self.engine.abort(request_id)
                        self._deliver(request_id, err)
                    continue
                finally:
                    self.step_started = None
                self.last_step_time = time.monotonic()
                if self.step_observer is not None:
                    self.step_observer(self.engine.last_step_tokens, self.last_step_time - self.step_started_at)
                for out in outputs:
                    self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)

    # -- public API ---------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Stream this request's outputs; cancelling the iteration aborts it and frees its blocks."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = (loop, outputs)
        added: asyncio.Future = loop.create_future()

        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt if isinstance(prompt, str) else list(prompt), params, priority)
                loop.call_soon_threadsafe(added.set_result, None)
            except BaseException as err:
                loop.call_soon_threadsafe(added.set_exception, err)

        finished = False
        try:
            self._submit(add)
            await added
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(lambda: self.engine.abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Abort a request from outside its stream: its blocks are freed and its stream ends
        with a final output whose unfinished completions say ``finish_reason="abort"``."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def command() -> None:
            final = self.engine.abort(request_id)
            if final is not None:
                self._deliver(request_id, final)
            loop.call_soon_threadsafe(done.set_result, None)

        self._submit(command)
        await done

    async def abort_all(self) -> int:
        """Abort every request (a replica shutting down); returns how many there were."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def command() -> None:
            request_ids = list(self.engine.requests)
            for request_id in request_ids:
                self._deliver(request_id, self.engine.abort(request_id))
            loop.call_soon_threadsafe(done.set_result, len(request_ids))

        self._submit(command)
        return await done

    async def stats(self) -> dict:
        return await self.run_in_engine(lambda engine: engine.stats())

    async def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps (reads see a consistent state)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def command() -> None:
            try:
                result = fn(self.engine)
            except BaseException as err:
                loop.call_soon_threadsafe(done.set_exception, err)
            else:
                loop.call_soon_threadsafe(done.set_result, result)

        self._submit(command)
        return await done

    def check_health(self, stuck_after_s: float) -> None:
        """Raise if the engine thread died, a step failed, or one step has run for ``stuck_after_s``."""
        if not self._thread.is_alive():
            raise RuntimeError("the engine thread is not running")
        if self.error is not None:
            raise RuntimeError(f"an engine step failed: {self.error!r}")
        started = self.step_started
        if started is not None and time.monotonic() - started > stuck_after_s:
            raise RuntimeError(f"one engine step has been running for over {stuck_after_s:.0f} s")

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)
