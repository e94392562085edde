"""A worker replica's waits around a KV handoff: they call the engine's hooks off the event loop
with the timeout, and a hook that fails or hangs never fails the request (it costs a recompute)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from raylm.workers.serve.kv_handoff import publish_computed_kv, refresh_kv_mirror


class FakeEngine:
    """``flush_kv_publish`` / ``refresh_kv_tiers`` that record their calls, then raise or sleep as told."""

    def __init__(self, error: BaseException | None = None, sleep_s: float = 0.0):
        self.error, self.sleep_s = error, sleep_s
        self.calls: list[tuple[str, float, bool]] = []  # (hook, timeout, ran on the event loop's thread)
        self.loop_thread = threading.get_ident()

    def _hook(self, name: str, timeout: float) -> None:
        self.calls.append((name, timeout, threading.get_ident() == self.loop_thread))
        time.sleep(self.sleep_s)
        if self.error is not None:
            raise self.error

    def flush_kv_publish(self, timeout: float) -> None:
        self._hook("flush", timeout)

    def refresh_kv_tiers(self, timeout: float) -> None:
        self._hook("refresh", timeout)


HOOKS = {"flush": publish_computed_kv, "refresh": refresh_kv_mirror}


@pytest.mark.parametrize("hook", list(HOOKS))
def test_the_hook_runs_off_the_event_loop_with_the_timeout(hook):
    engine = FakeEngine()
    assert asyncio.run(HOOKS[hook](engine, 2.5, "r1")) is True
    assert engine.calls == [(hook, 2.5, False)]


@pytest.mark.parametrize("hook", list(HOOKS))
def test_a_failing_hook_is_reported_not_raised(hook, caplog):
    engine = FakeEngine(error=TimeoutError("the cluster tier did not answer"))
    assert asyncio.run(HOOKS[hook](engine, 1.0, "r2")) is False
    assert "r2" in caplog.text and "the cluster tier did not answer" in caplog.text


def test_a_hook_that_ignores_its_timeout_is_given_up_on():
    engine = FakeEngine(sleep_s=1.8)  # the hook was given 0.2 s; it is waited for 1 s more at most

    async def timed() -> tuple[bool, float]:
        started = time.monotonic()
        return await publish_computed_kv(engine, 0.2, "r3"), time.monotonic() - started

    published, waited_s = asyncio.run(timed())
    assert published is False and 1.0 <= waited_s < 1.6
