"""A background response's stream read again (``GET /v1/responses/{id}?stream=true`` with
``starting_after``; router/responses_api/resume.py), in-process over the scripted fake worker: a
client that lost its stream midway picks it up live, and what it read before plus what it reads
after are exactly the stream's bytes; a response whose replica died ends its resumed stream with
``error`` and ``response.failed``; other responses and bad sequence numbers are refused."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from raylm.router.openai_service import OpenAIService
from tests.fake_worker import HANG, FakeWorker, asgi_request, fake_settings, openai_client, token_chunks

openai = pytest.importorskip("openai")

REPLY = "Picked up where it left off."


def _service(tokenizer) -> OpenAIService:
    service = OpenAIService(FakeWorker(token_chunks(tokenizer, REPLY)), fake_settings(), tokenizer)
    service.admission.set_capacity(4)
    return service


def _events(body: bytes) -> list[dict]:
    return [json.loads(part.split("data: ", 1)[1]) for part in body.decode().split("\n\n") if part]


async def _post_background_stream(service: OpenAIService, **disconnect) -> bytes:
    body = json.dumps({"model": "m", "input": "Work", "background": True, "stream": True}).encode()
    answer = await asgi_request(service.asgi_app(), "POST", "/v1/responses", body,
                                {"content-type": "application/json"}, **disconnect)
    return answer.body


def test_a_stream_lost_midway_resumes_live_and_adds_up_to_the_whole_stream(tokenizer):
    service = _service(tokenizer)
    gate = asyncio.Event()
    chunks = token_chunks(tokenizer, REPLY)
    service.worker.script = chunks[:2] + [gate] + chunks[2:]

    async def scenario():
        app = service.asgi_app()
        before = await _post_background_stream(service, disconnect_after_body_parts=3)
        seen = _events(before)
        response_id, last = seen[0]["response"]["id"], seen[-1]["sequence_number"]
        for _ in range(100):  # until the generating task flushed past what the client read
            if service.response_store.events_after("", response_id, last)["events"]:
                break
            await asyncio.sleep(0.05)
        resuming = asyncio.create_task(asgi_request(
            app, "GET", f"/v1/responses/{response_id}?stream=true&starting_after={last}", b""))
        await asyncio.sleep(0.5)
        assert not resuming.done(), "the resumed stream waits for the rest of the reply"
        gate.set()
        after = (await resuming).body
        whole = (await asgi_request(app, "GET", f"/v1/responses/{response_id}?stream=true", b"")).body
        client = openai_client(service)
        tail = [e async for e in await client.responses.retrieve(response_id, stream=True, starting_after=last)]
        return seen, before, after, whole, tail, await client.responses.retrieve(response_id)

    seen, before, after, whole, tail, stored = asyncio.run(scenario())
    assert before + after == whole
    events = _events(whole)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == "response.completed" and len(seen) < len(events) - 3
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == REPLY
    assert [e.sequence_number for e in tail] == [e["sequence_number"] for e in _events(after)]
    assert tail[-1].response.output_text == stored.output_text == REPLY and stored.status == "completed"


def test_a_resumed_stream_of_a_response_whose_replica_died_ends_failed(tokenizer):
    """The replica generating it stopped saying it lives: the resumed stream's first read stores it
    failed, and the stream ends as a live one would have: ``error`` then ``response.failed``,
    numbered after the events it had flushed."""
    from raylm.router.responses_api.service import STALE_AFTER_S

    service = _service(tokenizer)
    service.worker.script = token_chunks(tokenizer, REPLY)[:2] + [HANG]

    async def scenario():
        client = openai_client(service)
        live = await client.responses.create(model="m", input="Work", background=True)
        for _ in range(100):
            record = service.response_store.get("", live.id)
            if len(record["events"]) >= 4:
                break
            await asyncio.sleep(0.05)
        orphan = {**record, "response": {**record["response"], "id": "resp_orphan"},
                  "alive_at": time.time() - STALE_AFTER_S - 1}
        service.response_store.put("", "resp_orphan", orphan)
        events = [e async for e in await client.responses.retrieve("resp_orphan", stream=True, starting_after=1)]
        await client.responses.cancel(live.id)
        return record["events"], events, await client.responses.retrieve("resp_orphan")

    flushed, events, stored = asyncio.run(scenario())
    assert [e.sequence_number for e in events] == list(range(2, len(flushed) + 2))
    assert [e.type for e in events[-2:]] == ["error", "response.failed"] and "stopped" in events[-2].message
    assert stored.status == "failed"


def test_only_background_responses_stream_again_from_a_sequence_number(tokenizer):
    service = _service(tokenizer)

    async def scenario():
        client = openai_client(service)
        plain = await client.responses.create(model="m", input="Work")
        background = await client.responses.create(model="m", input="Work", background=True)
        params = []
        for response_id, after in ((plain.id, None), (background.id, "-1"), (background.id, "two")):
            query = "stream=true" + (f"&starting_after={after}" if after is not None else "")
            answer = await asgi_request(service.asgi_app(), "GET", f"/v1/responses/{response_id}?{query}", b"")
            params.append((answer.status, json.loads(answer.body)["error"]["param"]))
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve("resp_missing", stream=True)
        return params

    assert asyncio.run(scenario()) == [(400, "stream"), (400, "starting_after"), (400, "starting_after")]
