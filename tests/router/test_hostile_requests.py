"""Hostile and malformed requests against the router in-process: never a 5xx, always OpenAI
error JSON, and nothing held afterwards.

Thousands of seeded hostile requests (``benchmarks/hostile_requests.py``) plus hypothesis-drawn
JSON over the request schema go through the router's ASGI app over a fake worker, 16 at a
time against 4 run slots so admission queues too. The same generator drives the real server
in ``test_hostile_http.py`` and the 10,000-request soak benchmark.
"""

from __future__ import annotations

import asyncio
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raylm.benchmarks.hostile_requests import CHAT, CHAT_FIELDS, COMPLETION_FIELDS, COMPLETIONS, check_answer, generate
from raylm.router.openai_service import OpenAIService
from tests.fake_worker import FakeWorker, asgi_request, chunk, fake_settings, ledger_problems


def _service(tokenizer) -> OpenAIService:
    settings = fake_settings(max_request_bytes=64 * 1024)
    service = OpenAIService(FakeWorker([chunk("a"), chunk("b", finished=True)]), settings, tokenizer)
    service.admission.set_capacity(4)
    return service


async def _send_all(service: OpenAIService, requests, concurrency: int = 16) -> list[str]:
    app = service.asgi_app()
    problems: list[str] = []

    async def one(request) -> None:
        answer = await asgi_request(app, request.method, request.path, request.body, request.headers)
        problem = check_answer(request, answer.status, answer.headers, answer.body)
        if problem:
            problems.append(problem)

    for start in range(0, len(requests), concurrency):
        await asyncio.gather(*(one(r) for r in requests[start:start + concurrency]))
    return problems


def test_seeded_hostile_requests(tokenizer):
    service = _service(tokenizer)
    requests = generate(1500, "m", seed=18, max_request_bytes=service.settings.max_request_bytes)
    problems = asyncio.run(_send_all(service, requests))
    assert not problems, "\n".join(problems[:10])
    assert not ledger_problems(service), ledger_problems(service)
    assert service.worker.calls, "no request got through to the worker: the generator makes no valid ones"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from([CHAT, COMPLETIONS]), data=st.data())
def test_any_json_over_the_schema(tokenizer, path, data):
    fields = CHAT_FIELDS if path == CHAT else COMPLETION_FIELDS
    body = {"model": "m", "max_tokens": 2}
    body.update(data.draw(st.dictionaries(st.sampled_from(fields), _json, max_size=4)))
    if path == CHAT and data.draw(st.booleans()):
        body["messages"] = data.draw(st.lists(st.dictionaries(
            st.sampled_from(["role", "content", "name"]), st.sampled_from(["user", "assistant"]) | _json,
            max_size=3), max_size=3))
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = min(body["max_tokens"], 4)
    service = _service(tokenizer)
    from raylm.benchmarks.hostile_requests import HostileRequest

    request = HostileRequest("POST", path, json.dumps(body).encode(), {"content-type": "application/json"}, "hypothesis")
    problems = asyncio.run(_send_all(service, [request]))
    assert not problems, problems
    assert not ledger_problems(service)
