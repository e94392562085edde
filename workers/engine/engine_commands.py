"""The engine thread's typed commands: every mutation and read of the engine is one of these,
queued by ``AsyncEngine`` and run between steps by its one dispatch site, and every caller waits
on its ``Reply``, a future on the caller's own event loop settled from the engine thread."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any, Callable

from raylm.workers.core.lora_adapters import LoRARequest
from raylm.workers.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from raylm.workers.engine.llm_engine import LLMEngine


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Set ``future``'s outcome unless its caller already gave up on it (a cancelled future
    raises InvalidStateError when set)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def consume_error(future: asyncio.Future) -> None:
    """Mark a shared future's error as seen (asyncio logs an error nobody retrieved)."""
    if not future.cancelled():
        future.exception()


def call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """Run ``fn`` on the caller's loop; a loop already closed has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        pass


@dataclasses.dataclass
class Reply:
    """The caller's end of a command: a future on the caller's loop, settled from any thread."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future

    @classmethod
    def on_running_loop(cls) -> "Reply":
        loop = asyncio.get_running_loop()
        return cls(loop, loop.create_future())

    def resolve(self, result: Any) -> None:
        call_soon(self.loop, _settle, self.future, result, None)

    def fail(self, error: BaseException) -> None:
        call_soon(self.loop, _settle, self.future, None, error)


@dataclasses.dataclass
class Add:
    """Queue a request; a request the engine refuses fails with InvalidRequestError."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    reply: Reply
    embed: bool = False
    lora_request: LoRARequest | None = None


@dataclasses.dataclass
class Abort:
    """Stop one request and free its blocks; its stream ends with a final ``abort`` output."""

    request_id: str
    reply: Reply | None  # None: a stream's own clean-up, which nobody awaits


@dataclasses.dataclass
class AbortAll:
    """Stop every request (a replica shutting down); replies how many there were."""

    reply: Reply


@dataclasses.dataclass
class RunInEngine:
    """Run ``fn(engine)`` between steps (reads see a consistent state); replies its result."""

    fn: Callable[[LLMEngine], Any]
    reply: Reply


@dataclasses.dataclass
class Compiled:
    """The compile thread (``workers/engine/background_compile.py``) compiled ``shape``'s program,
    or failed to (``error``: the warm-up ends there, and what it left compiles on first use)."""

    shape: tuple[str, tuple[int, ...]]
    error: Exception | None = None
    reply: None = None


@dataclasses.dataclass
class Shutdown:
    """Free every request's blocks and stop the thread; always the last command queued."""

    reply: None = None


Command = Add | Abort | AbortAll | RunInEngine | Compiled | Shutdown
