"""The engine thread under faults: every caller's future resolves, every block is freed, the
loop survives what a command or an observer raises, and a step failure is a server error."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time

import pytest

from raylm.deploy.status_command import state_summary
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.async_engine import AsyncEngine, EngineShutdownError, EngineStepError
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.engine.llm_engine import LLMEngine
from raylm.workers.serve.deployment import LLMWorker
from raylm.workers.wire.replica_protocol import (
    GenerateRequest,
    InvalidRequestError,
    ReplicaDrainingError,
    RoutingReport,
)

LONG = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
TIMEOUT_S = 20.0  # far above what any of these takes; only a hang reaches it


@pytest.fixture
def engine(tiny_gqa_model):
    engine = AsyncEngine(LLMEngine(tiny_gqa_model, EngineArgs(max_model_len=512, num_kv_blocks=200, max_num_seqs=8)))
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncEngine, prompt, params, request_id: str):
    return [out async for out in engine.generate(prompt, params, request_id)]


def _run(coro):
    """Run ``coro`` with a deadline, so a hang fails the test instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def _hold(engine: AsyncEngine, release: threading.Event) -> asyncio.Future:
    """Keep the engine thread busy in a command until ``release``: what is submitted meanwhile
    queues up and is run together."""
    running = threading.Event()

    def hold(_engine) -> None:
        running.set()
        release.wait(TIMEOUT_S)

    held = asyncio.ensure_future(engine.run_in_engine(hold))
    await asyncio.to_thread(running.wait, TIMEOUT_S)
    return held


def _serves_a_request(engine: AsyncEngine) -> None:
    out = _run(_collect(engine, [5, 6, 7], SHORT, "probe"))
    assert out[-1].finished and len(out[-1].outputs[0].token_ids) == 3


def test_a_failing_step_observer_neither_stops_the_engine_nor_loses_outputs(engine, caplog):
    def observer(tokens: int, seconds: float) -> None:
        raise RuntimeError("metrics backend down")

    engine.step_observer = observer
    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        _serves_a_request(engine)
        _serves_a_request(engine)
    engine.check_health(stuck_after_s=60)
    # Logged once with its traceback, not once per step (3 steps per request ran).
    logged = [r for r in caplog.records if "step observer failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None


def test_a_failing_command_fails_its_caller_only(engine, monkeypatch):
    def broken_abort(request_id: str):
        raise KeyError(request_id)

    with monkeypatch.context() as patch:
        patch.setattr(engine.llm_engine, "abort", broken_abort)
        with pytest.raises(KeyError, match="ghost"):
            _run(engine.abort("ghost"))
    with pytest.raises(ZeroDivisionError):
        _run(engine.run_in_engine(lambda e: 1 / 0))
    engine.check_health(stuck_after_s=60)
    _serves_a_request(engine)


def test_a_cancelled_caller_is_not_answered(engine):
    """Setting a cancelled future raises InvalidStateError in the caller's loop."""
    release = threading.Event()
    loop_errors: list[dict] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
        blocker = await _hold(engine, release)
        waiting = asyncio.ensure_future(engine.stats())
        await asyncio.sleep(0)
        waiting.cancel()
        release.set()
        await blocker
        await engine.stats()  # queued after the cancelled one: its answer was sent by now
        await asyncio.sleep(0.05)

    _run(main())
    assert loop_errors == []


def test_a_failed_step_is_a_server_error_that_frees_blocks_and_fails_health(engine, monkeypatch, caplog):
    def broken_step(plan):
        raise ValueError("shape mismatch inside the model")

    monkeypatch.setattr(engine.llm_engine.runner, "execute", broken_step)

    async def main():
        release = threading.Event()
        held = await _hold(engine, release)
        requests = [asyncio.ensure_future(_collect(engine, list(range(3, 40)), SHORT, f"r{i}")) for i in range(2)]
        await asyncio.sleep(0)  # both run up to their Add, queued behind the held command: one step
        release.set()
        await held
        results = await asyncio.gather(*requests, return_exceptions=True)
        return results, await engine.stats()

    with caplog.at_level(logging.ERROR, logger="ray.serve"):
        results, stats = _run(main())
    for err in results:
        assert isinstance(err, EngineStepError) and not isinstance(err, ValueError)
        assert isinstance(err.__cause__, ValueError)
    # Both requests were in the failing step: one log line with its traceback for both.
    logged = [r for r in caplog.records if "engine step failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None
    assert stats.pool.num_used_blocks == 0 and stats.running == 0 and stats.waiting == 0
    with pytest.raises(RuntimeError, match="an engine step failed"):
        engine.check_health(stuck_after_s=60)


def test_shutdown_ends_open_streams_and_refuses_later_commands(engine):
    async def main():
        stream = engine.generate(list(range(3, 30)), LONG, "long")
        await stream.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineShutdownError):
            async for _ in stream:
                pass
        with pytest.raises(EngineShutdownError):
            await engine.abort("long")
        with pytest.raises(EngineShutdownError):
            await engine.stats()
        with pytest.raises(EngineShutdownError):
            await _collect(engine, [5, 6], SHORT, "late")

    _run(main())
    assert engine.llm_engine.pool.num_used_blocks == 0 and not engine.llm_engine.requests
    with pytest.raises(RuntimeError, match="not running"):
        engine.check_health(stuck_after_s=60)


def test_shutdown_does_not_wait_on_a_stuck_step(engine):
    release = threading.Event()

    async def main():
        stuck = await _hold(engine, release)
        queued = asyncio.ensure_future(engine.stats())
        await asyncio.sleep(0)
        await asyncio.to_thread(engine.shutdown, 0.2)
        with pytest.raises(EngineShutdownError):
            await queued
        release.set()
        await stuck

    _run(main())
    engine._thread.join(TIMEOUT_S)
    assert not engine._thread.is_alive()


def test_a_dead_engine_thread_fails_its_callers_and_the_health_check(engine, monkeypatch):
    def broken(*args):
        raise SystemError("engine state corrupted")

    async def main():
        stream = engine.generate(list(range(3, 30)), LONG, "long")
        await stream.__anext__()
        monkeypatch.setattr(engine.llm_engine, "has_unfinished_requests", broken)
        with pytest.raises(EngineShutdownError, match="engine thread died"):
            async for _ in stream:
                pass
        with pytest.raises(EngineShutdownError):
            await engine.stats()

    _run(main())
    engine._thread.join(TIMEOUT_S)  # it fails its callers on its way out
    with pytest.raises(RuntimeError, match="not running"):
        engine.check_health(stuck_after_s=60)


class _NoMetrics:
    def inc(self, *args, **kwargs) -> None: ...
    def observe(self, *args, **kwargs) -> None: ...
    def set(self, *args, **kwargs) -> None: ...


class _BareWorker(LLMWorker.func_or_class):
    def __del__(self) -> None:  # Serve awaits the real (async) one; here nobody would
        pass


def _worker(engine: AsyncEngine) -> LLMWorker:
    """The Serve deployment's class without Serve: what ``generate`` needs, nothing more."""
    worker = object.__new__(_BareWorker)
    worker.engine, worker.draining, worker.metrics = engine, False, _NoMetrics()
    return worker


async def _worker_chunks(worker, prompt: list[int], request_id: str):
    request = GenerateRequest(request_id, prompt, SHORT)
    return [chunk async for chunk in worker.generate(request)]


def test_worker_reports_a_bad_request_as_invalid_and_a_failed_step_as_not(engine, monkeypatch):
    worker = _worker(engine)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        _run(_worker_chunks(worker, [5, 10**9], "bad"))

    def broken_step(plan):
        raise ValueError("shape mismatch inside the model")

    monkeypatch.setattr(engine.llm_engine.runner, "execute", broken_step)
    with pytest.raises(Exception) as caught:
        _run(_worker_chunks(worker, [5, 6, 7], "good"))
    assert not isinstance(caught.value, InvalidRequestError)  # the router answers 500, not 400
    assert isinstance(caught.value.__cause__, ValueError)


def test_worker_whose_engine_stopped_tells_the_client_to_retry(engine):
    """A request reaching a replica whose engine is gone is a 503 (retry elsewhere), not a 500."""
    worker = _worker(engine)
    engine.shutdown()
    with pytest.raises(ReplicaDrainingError, match="retry"):
        _run(_worker_chunks(worker, [5, 6, 7], "late"))


def test_a_periodic_read_gets_the_last_answer_while_the_engine_is_busy(engine):
    """Serve's autoscaling and routing callbacks must not time out (and leave the autoscaler
    with no report) while a step or a compile holds the engine thread."""
    reads: list[int] = []

    def read(_engine) -> int:
        reads.append(len(reads) + 1)
        return reads[-1]

    async def main():
        assert await engine.read_in_engine("load", read, wait_s=0.01) == 1  # never answered: waits
        release = threading.Event()
        held = await _hold(engine, release)
        answers = await asyncio.gather(*(engine.read_in_engine("load", read, wait_s=0.2) for _ in range(3)))
        assert answers == [1, 1, 1] and reads == [1]
        release.set()
        await held
        await engine.run_in_engine(lambda _engine: None)  # queued after the reads made while held
        assert reads == [1, 2]  # three readers, one read
        assert await engine.read_in_engine("load", read, wait_s=5) == 3

    _run(main())


def test_a_failing_periodic_read_fails_its_waiting_readers_and_logs_nothing_unretrieved(engine):
    loop_errors: list[dict] = []

    def broken(_engine):
        raise RuntimeError("no stats")

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: loop_errors.append(context))
        with pytest.raises(RuntimeError, match="no stats"):
            await engine.read_in_engine("broken", broken, wait_s=0.01)
        assert await engine.read_in_engine("fine", lambda _engine: 7, wait_s=1) == 7
        engine._last_reads["broken"] = 0  # an earlier answer: the failing read is not waited for
        release = threading.Event()
        held = await _hold(engine, release)
        assert await engine.read_in_engine("broken", broken, wait_s=0.05) == 0
        release.set()
        await held
        await engine.run_in_engine(lambda _engine: None)
        await asyncio.sleep(0.05)

    _run(main())
    assert loop_errors == []


def test_worker_stats_answer_while_the_engine_is_busy_and_say_for_how_long(engine):
    """Serve's autoscaling and routing callbacks (and ``raylm status``) get the last figures, and
    the routing report says how long the engine thread has been in its current step."""
    worker = _worker(engine)
    worker.node_id, worker.max_reported_hashes, worker.role, worker.stages = "node", 16, "both", []

    async def main():
        autoscaling, routing = await worker.record_autoscaling_stats(), await worker.record_routing_stats()
        assert routing["busy_s"] == 0.0
        release = threading.Event()
        held = await _hold(engine, release)
        engine.step_started = time.monotonic() - 30  # as ``_step`` sets it (the hold is a command)
        started = time.monotonic()
        assert await worker.record_autoscaling_stats() == autoscaling
        busy_routing = await worker.record_routing_stats()
        assert time.monotonic() - started < TIMEOUT_S / 2
        assert {**busy_routing, "busy_s": 0.0} == routing and 30 <= busy_routing["busy_s"] < 30 + TIMEOUT_S
        assert "in one step for 3" in state_summary(RoutingReport.from_dict(busy_routing).engine,
                                                    busy_routing["busy_s"])
        engine.step_started = None
        release.set()
        await held

    _run(main())


def test_status_shows_a_busy_engine_thread_only_past_a_second(engine):
    stats = _run(engine.stats())
    assert state_summary(stats) == state_summary(stats, 0.9) == "serving"
    assert state_summary(stats, 42.2) == "serving, in one step for 42 s (figures from before it)"
    warming = dataclasses.replace(stats, warmup_programs_left=3)
    assert state_summary(warming, 2) == "warming up (3 programs left), in one step for 2 s (figures from before it)"
