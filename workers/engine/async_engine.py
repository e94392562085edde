"""Asyncio front of the engine: a background thread steps it; callers stream per-request outputs.

The engine is not thread-safe, so every mutation and read is a typed command (``Add``,
``Abort``, ``AbortAll``, ``RunInEngine``, ``Shutdown``) queued to the engine thread and run
between steps by one dispatch site. Whatever happens there (a command raises, a step fails,
the engine is shut down, the thread dies) every caller's future is resolved and every open
stream ends: nobody waits forever on an engine that will never answer.

A served engine warms up in the background (``LLMEngine(background_warmup=True)``): it compiles
the programs a request alone takes before it is constructed, and a compile thread the rest while
it steps (``workers/engine/background_compile.py``), so a new or replacement replica serves
seconds sooner and no request waits for a whole compile. Until its larger prompt programs are compiled, prompts run in
the chunks compiled so far. A runner that cannot compile beside its steps (a multi-host leader, a
pipeline) compiles them on the engine thread, one whenever it has nothing to step, and after a
step that held a prompt to the compiled chunks, so steady load cannot keep them small.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence, TypeVar

from raylm.workers.core.engine_stats import EngineStats
from raylm.workers.core.grammar import GrammarError
from raylm.workers.core.lora_adapters import LoRARequest
from raylm.workers.core.request_output import CompletionOutput, RequestOutput
from raylm.workers.core.sampling_params import BeamSearchParams, SamplingParams
from raylm.workers.engine.background_compile import BackgroundCompile
from raylm.workers.engine.beam_search import BeamSearch
from raylm.workers.engine.engine_commands import (
    Abort,
    AbortAll,
    Add,
    Command,
    Compiled,
    Reply,
    RunInEngine,
    Shutdown,
    call_soon,
    consume_error,
)
from raylm.workers.wire.replica_protocol import InvalidRequestError

if TYPE_CHECKING:
    from raylm.model.loaders.load import LoadedModel
    from raylm.workers.engine.llm_engine import LLMEngine

T = TypeVar("T")

logger = logging.getLogger("ray.serve")

IDLE_WAIT_S = 1.0  # an idle engine thread re-checks that it should keep running this often
COMPILE_STOP_WAIT_S = 30.0  # a shut-down engine waits this long for a background compile under way


class EngineShutdownError(RuntimeError):
    """The engine was shut down (or its thread died) and takes no more commands."""


class EngineStepError(RuntimeError):
    """An engine step failed: a server fault, not the request's (the step's error is the cause)."""


class AsyncEngine:
    """``async for out in engine.generate(prompt, params, request_id)`` streams deltas."""

    def __init__(self, llm_engine: LLMEngine):
        self.llm_engine = llm_engine
        self._commands: queue.Queue[Command] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # orders ``_closed`` against queueing a command
        self._closed = False  # no command is queued any more
        self._running = True  # the engine thread keeps looping
        self._observer_failed = False
        self._last_reads: dict[str, Any] = {}  # ``read_in_engine``'s last answer per key
        self._pending_reads: dict[str, asyncio.Future] = {}  # and its read in flight, if any
        self.last_step_time: float | None = None
        # Set while a step or a warm-up compile runs: a stuck step shows here, and a busy engine
        # thread in the routing reports (``LLMWorker.record_routing_stats``).
        self.step_started: float | None = None
        self.error: BaseException | None = None
        self.step_observer: Callable[[int, float], None] | None = None  # (tokens, seconds) per step
        self._compiler = None if not (llm_engine.warmup_pending and llm_engine.runner.compiles_off_thread) else \
            BackgroundCompile(llm_engine.runner, llm_engine.args.num_scheduler_steps, llm_engine.warmup_pending,
                              self._submit)
        self._thread = threading.Thread(target=self._loop, name="raylm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_model(cls, model: str | LoadedModel, **engine_args: Any) -> "AsyncEngine":
        from raylm.workers.engine.llm_engine import make_engine  # JAX: loaded when an engine is built

        return cls(make_engine(model, background_warmup=True, **engine_args))

    # -- engine thread ------------------------------------------------------------------------------
    def _loop(self) -> None:
        reason = "the engine was shut down"
        try:
            while self._running:
                self._run_commands()
                if self._running and self.llm_engine.has_unfinished_requests():
                    self._step()
                    if self._running and self._compiler is None and self.llm_engine.chunks_wait_for_compile:
                        self._warm_up_next()  # the larger prompt program a running prompt waits for
                elif self._running and self._warms_up_here:
                    self._warm_up_next()
        except BaseException as err:  # a bug in the loop itself: say so, and fail every caller below
            logger.exception("the engine thread died")
            self.error = err
            reason = f"the engine thread died: {err!r}"
        finally:
            self._close(reason)
            if self._compiler is not None:
                self._compiler.stop(COMPILE_STOP_WAIT_S)
            self.llm_engine.close()  # on this thread: no step is using the offload tiers now

    def _run_commands(self) -> None:
        """Run the queued commands; with nothing to step, wait for one first."""
        try:
            if not (self.llm_engine.has_unfinished_requests() or self._warms_up_here):
                self._dispatch(self._commands.get(timeout=IDLE_WAIT_S))
            while self._running:
                self._dispatch(self._commands.get_nowait())
        except queue.Empty:
            pass

    def _dispatch(self, command: Command) -> None:
        """The one place commands run: the caller gets the result or the exception, and nothing
        a command raises reaches the loop."""
        try:
            result = self._execute(command)
        except Exception as err:
            if command.reply is None:
                logger.exception("engine command %s failed", type(command).__name__)
            else:
                command.reply.fail(err)
            return
        if command.reply is not None:
            command.reply.resolve(result)

    def _execute(self, command: Command) -> Any:
        match command:
            case Add(request_id, prompt, params, priority, _, embed, lora_request):
                try:
                    self.llm_engine.add_request(request_id, prompt, params, priority, embed=embed,
                                                lora_request=lora_request)
                except ValueError as err:  # the request itself is bad: a client error, unlike a step's
                    raise InvalidRequestError(str(err)) from err
            case Abort(request_id):
                final = self.llm_engine.abort(request_id)
                if final is not None:
                    self._deliver(request_id, final)
            case AbortAll():
                request_ids = list(self.llm_engine.requests)
                for request_id in request_ids:
                    self._deliver(request_id, self.llm_engine.abort(request_id))
                return len(request_ids)
            case RunInEngine(fn):
                return fn(self.llm_engine)
            case Compiled(shape, None):
                self.llm_engine.compiled(shape)
            case Compiled(shape, error):
                logger.error("background warm-up failed at %s; %d program(s) left to compile on first use", shape,
                             len(self.llm_engine.warmup_pending), exc_info=error)
                self.llm_engine.end_warmup()
            case Shutdown():
                self._running = False
                for request_id in list(self.llm_engine.requests):
                    self.llm_engine.abort(request_id)
        return None

    @property
    def _warms_up_here(self) -> bool:  # the engine thread compiles what the warm-up left (no compile thread)
        return self._compiler is None and bool(self.llm_engine.warmup_pending)

    def _warm_up_next(self) -> None:
        """Compile one program the background warm-up left; a failure is logged and ends it
        (a step that needs the program compiles it, and reports any error, itself)."""
        self.step_started = time.monotonic()
        try:
            self.llm_engine.warm_up_next()
        except Exception:
            logger.exception("background warm-up failed; %d program(s) left to compile on first use",
                             len(self.llm_engine.warmup_pending))
            self.llm_engine.end_warmup()
        finally:
            self.step_started = None

    def _step(self) -> None:
        self.step_started = started = time.monotonic()
        try:
            outputs = self.llm_engine.step()
        except Exception as err:  # a broken step must fail its requests, not hang them
            self.error = err
            logger.exception("an engine step failed; failing its %d request(s)", len(self.llm_engine.requests))
            self._fail_requests(err)
            return
        finally:
            self.step_started = None
        self.last_step_time = time.monotonic()
        for out in outputs:
            self._deliver(out.request_id, out)
        self._observe_step(self.llm_engine.last_step_tokens, self.last_step_time - started)

    def _fail_requests(self, cause: Exception) -> None:
        """After a failed step: free every request's blocks and end its stream with the error."""
        for request_id in list(self.llm_engine.requests):
            try:
                self.llm_engine.abort(request_id)
            except Exception:
                logger.exception("freeing request %r after the failed step failed too", request_id)
            error = EngineStepError(f"an engine step failed: {cause!r}")
            error.__cause__ = cause
            self._deliver(request_id, error)

    def _observe_step(self, tokens: int, seconds: float) -> None:
        """Feed the step observer (metrics); its failure must not stop the engine, and is
        logged once rather than at the step rate."""
        if self.step_observer is None:
            return
        try:
            self.step_observer(tokens, seconds)
        except Exception:
            if not self._observer_failed:
                logger.exception("the step observer failed (logged once; the engine keeps running)")
            self._observer_failed = True

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            call_soon(loop, q.put_nowait, item)

    def _close(self, reason: str) -> None:
        """Refuse new commands, fail the queued ones and end every open stream with
        EngineShutdownError(reason). Idempotent; safe from any thread."""
        with self._lock:
            self._closed = True
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command.reply is not None:
                command.reply.fail(EngineShutdownError(reason))
        for request_id in list(self._streams):
            self._deliver(request_id, EngineShutdownError(reason))

    def _submit(self, command: Command) -> None:
        """Queue ``command``; once the engine is closed it fails at once instead."""
        with self._lock:
            if not self._closed:
                self._commands.put(command)
                return
        if command.reply is not None:
            command.reply.fail(EngineShutdownError("the engine is shut down; it takes no more requests"))

    # -- public API ---------------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        embed: bool = False,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream this request's outputs; cancelling the iteration aborts it and frees its blocks.
        ``embed``: the request wants its prompt's embedding (the final output's ``embedding``);
        ``lora_request``: generate with that LoRA adapter (``LLMEngine.add_request``).

        Raises InvalidRequestError if the engine refuses the request, EngineStepError if a step
        fails while it runs, EngineShutdownError if the engine stops first.
        """
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.structured_output is not None:  # compile off the engine thread (cached per grammar)
            try:
                await asyncio.to_thread(self.llm_engine.grammars.prepare, params.structured_output)
            except GrammarError as err:
                raise InvalidRequestError(str(err)) from None
        outputs: asyncio.Queue = asyncio.Queue()
        added = Reply.on_running_loop()
        self._streams[request_id] = (added.loop, outputs)
        finished = False
        try:
            self._submit(Add(request_id, prompt if isinstance(prompt, str) else list(prompt), params, priority, added,
                             embed, lora_request))
            await added.future
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
                self._submit(Abort(request_id, reply=None))

    async def beam_search(self, prompt_ids: Sequence[int], params: BeamSearchParams, request_id: str,
                          lora_request: LoRARequest | None = None) -> list[CompletionOutput]:
        """The ``beam_width`` best continuations by beam search (``workers/engine/beam_search.py``):
        each step, every live beam runs as a one-token request (with ``lora_request``'s
        adapter); cancelling aborts them all."""
        search = BeamSearch(params, self.llm_engine.eos_ids)
        step_params = params.step_params()
        ids = itertools.count()

        async def candidates(tokens: tuple[int, ...]) -> dict[int, float]:
            final = None
            async for output in self.generate([*prompt_ids, *tokens], step_params, f"{request_id}-{next(ids)}",
                                              lora_request=lora_request):
                final = output
            return final.outputs[0].logprobs[0]

        while not search.done:
            search.advance(await asyncio.gather(*(candidates(beam.tokens) for beam in search.live)))
        return search.outputs(self.llm_engine.tokenizer)

    async def abort(self, request_id: str) -> None:
        """Abort a request from outside its stream: its blocks are freed and its stream ends
        with a final output whose unfinished completions say ``finish_reason="abort"``."""
        reply = Reply.on_running_loop()
        self._submit(Abort(request_id, reply))
        await reply.future

    async def abort_all(self) -> int:
        """Abort every request (a replica shutting down); returns how many there were."""
        reply = Reply.on_running_loop()
        self._submit(AbortAll(reply))
        return await reply.future

    async def stats(self) -> EngineStats:
        """The engine's counters, read on the engine thread between steps."""
        return await self.run_in_engine(lambda engine: engine.stats())

    async def run_in_engine(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps (reads see a consistent state)."""
        reply = Reply.on_running_loop()
        self._submit(RunInEngine(fn, reply))
        return await reply.future

    async def read_in_engine(self, key: str, fn: Callable[[LLMEngine], T], wait_s: float) -> T:
        """``run_in_engine(fn)`` for periodic readers (Serve's autoscaling and routing callbacks).
        While the engine thread is busy for over ``wait_s`` (a long step, a compile on first
        use), the reader gets the last answer under ``key`` instead of waiting: the autoscaler
        and the router keep the last known load, where a timed-out read would leave them none
        exactly when the replica is overloaded. The read still runs once the thread is free,
        once however many readers asked meanwhile; a key never answered yet is waited for."""
        pending = self._pending_reads.get(key)
        if pending is None or pending.done() or pending.get_loop() is not asyncio.get_running_loop():
            pending = asyncio.ensure_future(self.run_in_engine(functools.partial(self._remember, key, fn)))
            pending.add_done_callback(consume_error)  # a caller that took the last answer never sees it
            self._pending_reads[key] = pending
        if key not in self._last_reads:
            return await asyncio.shield(pending)
        try:
            return await asyncio.wait_for(asyncio.shield(pending), wait_s)
        except TimeoutError:
            return self._last_reads[key]

    def _remember(self, key: str, fn: Callable[[LLMEngine], T], engine: LLMEngine) -> T:
        """Run on the engine thread: ``fn(engine)``, kept as ``key``'s last answer."""
        self._last_reads[key] = result = fn(engine)
        return result

    def check_health(self, stuck_after_s: float) -> None:
        """Raise if the engine thread died, a step failed, or one step has run for ``stuck_after_s``."""
        if not self._thread.is_alive():
            raise RuntimeError("the engine thread is not running")
        if self.error is not None:
            raise RuntimeError(f"an engine step failed: {self.error!r}")
        started = self.step_started
        if started is not None and time.monotonic() - started > stuck_after_s:
            raise RuntimeError(f"one engine step has been running for over {stuck_after_s:.0f} s")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread after the commands already queued; every caller still waiting,
        and every later one, gets EngineShutdownError. A thread stuck in a step is not waited
        for beyond ``timeout_s``."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._commands.put(Shutdown())
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            logger.warning("the engine thread is still in a step after %.0f s; failing its callers now", timeout_s)
            self._running = False
        self._close("the engine was shut down")
