"""Every exit path of a request gives back what it took: router slots and worker calls.

The router's OpenAI service runs in-process over a scripted fake worker handle, driven through
its ASGI app, so each path (success, client error, worker error before and during a stream,
worker death, disconnect while queued / while streaming / before the first token, queue
timeout, a failure in the router's own accounting) is taken on purpose and the ledger checked
after it: no lease, no slot, every worker call finished or cancelled exactly once.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from ray.exceptions import RayActorError

from raylm.router.openai_service import OpenAIService
from raylm.workers.wire.replica_protocol import ChoiceDelta, GenerateChunk, InvalidRequestError
from tests.fake_worker import HANG, FakeWorker, chunk, fake_settings, ledger_problems, post_json


@pytest.fixture
def service(tokenizer):
    svc = OpenAIService(FakeWorker(), fake_settings(queue_timeout_s=0.3), tokenizer)
    svc.admission.set_capacity(4)
    return svc


async def _call(app, body: dict, **kwargs) -> tuple[int, bytes]:
    answer = await post_json(app, body, **kwargs)
    return answer.status, answer.body


def _assert_ledger_clean(service: OpenAIService) -> None:
    problems = ledger_problems(service)
    assert not problems, problems


BODY = {"model": "m", "prompt": "Hello", "max_tokens": 2}

PATHS = {
    "success": ([chunk("a"), chunk("b", finished=True)], {}, 200),
    "success streaming": ([chunk("a"), chunk("b", finished=True)], {"stream": True}, 200),
    "client error": ([], {"max_tokens": "many"}, 400),
    "worker refuses the request": ([InvalidRequestError("bad ids")], {}, 400),
    "worker error before output": ([RuntimeError("boom")], {}, 500),
    "worker error mid-stream": ([chunk("a"), RuntimeError("boom")], {"stream": True}, 200),
    "worker death mid-response": ([chunk("a"), RayActorError()], {}, 503),
    "worker death mid-stream": ([chunk("a"), RayActorError()], {"stream": True}, 200),
    "replica shut down": ([chunk("a"), GenerateChunk("r", [ChoiceDelta(0, "", [], None, "abort")], 3, 0, True)],
                          {}, 503),
}


@pytest.mark.parametrize("name", list(PATHS))
def test_exit_path_releases_everything(service, name):
    script, extra, status = PATHS[name]
    service.worker.script = script
    got, body = asyncio.run(_call(service.asgi_app(), {**BODY, **extra}))
    assert got == status, body
    if status >= 400:
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    if "mid-stream" in name:  # an error after the stream started is an error event, never a clean end
        assert b'"error"' in body
    _assert_ledger_clean(service)


def test_disconnect_mid_stream_cancels_the_worker_call(service):
    service.worker.script = [chunk("a"), chunk("b"), HANG]
    status, body = asyncio.run(_call(service.asgi_app(), {**BODY, "stream": True}, disconnect_after_body_parts=2))
    assert status == 200 and b"[DONE]" not in body
    assert service.worker.calls[0].cancels == 1
    _assert_ledger_clean(service)


def test_disconnect_before_the_first_token(service):
    service.worker.script = [HANG]
    asyncio.run(_call(service.asgi_app(), BODY, disconnect_after_s=0.2))
    assert service.worker.calls[0].cancels == 1
    _assert_ledger_clean(service)


def test_disconnect_and_timeout_while_queued(service):
    service.admission.set_capacity(0)
    service.worker.script = [chunk("a", finished=True)]
    asyncio.run(_call(service.asgi_app(), BODY, disconnect_after_s=0.1))  # gone while waiting
    status, body = asyncio.run(_call(service.asgi_app(), BODY))  # waits past queue_timeout_s
    assert status == 503 and json.loads(body)["error"]["code"] == "queue_timeout"
    assert not service.worker.calls
    _assert_ledger_clean(service)


def test_non_ascii_user_is_served_and_counted(service):
    """The bug that wedged servers: a tenant tag Ray's metrics cannot encode failed after admission."""
    service.worker.script = [chunk("a", finished=True)]
    for user in ["josé", "😀", "שלום", "e\u0301", "a\u200bb", "x" * 500]:
        status, body = asyncio.run(_call(service.asgi_app(), {**BODY, "user": user}))
        assert status == 200, body
    assert service.queue.counters["josé"] > 0
    _assert_ledger_clean(service)


def test_a_failure_in_the_routers_own_accounting_still_releases(service, monkeypatch):
    def broken(tenant: str, tokens: int) -> None:
        raise RuntimeError("metrics backend down")

    monkeypatch.setattr(service.metrics, "tenant_tokens", broken)
    service.worker.script = [chunk("a", finished=True)]
    status, body = asyncio.run(_call(service.asgi_app(), BODY))
    assert status == 500 and "Traceback" not in body.decode()
    _assert_ledger_clean(service)
