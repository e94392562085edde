"""``/v1/responses`` through the router's HTTP API with the official ``openai`` client, in-process
over a fake worker that writes a scripted reply token by token: plain, with tools and a tool-output
turn, continued by ``previous_response_id``, with a JSON schema, streamed (event order and the
final object); stored responses retrieved, listed, deleted and invisible to another API key; bad
input refused in OpenAI's error shape with nothing stored."""

from __future__ import annotations

import asyncio
import json

import pytest

from raylm.router.auth import Secret
from raylm.router.openai_service import OpenAIService
from tests.fake_worker import HANG, FakeWorker, fake_settings, ledger_problems, openai_client, token_chunks
from tests.router.test_reasoning_http import ANSWER, THOUGHTS, qwen3_tokenizer  # noqa: F401 (a fixture)

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _service(tokenizer, reply: str, finish: str = "stop", **settings) -> OpenAIService:
    service = OpenAIService(FakeWorker(token_chunks(tokenizer, reply, finish)), fake_settings(**settings), tokenizer)
    service.admission.set_capacity(4)
    return service


def _prompt(service: OpenAIService, call: int = -1) -> str:
    return service.tokenizer.decode(service.worker.requests[call].prompt_token_ids, skip_special_tokens=False)


def _unparsed(value):
    if isinstance(value, dict):
        return {k: _unparsed(v) for k, v in value.items() if k not in ("parsed", "parsed_arguments")}
    return [_unparsed(v) for v in value] if isinstance(value, list) else value


def test_plain_response_is_stored_listed_and_deleted(tokenizer):
    service = _service(tokenizer, "Hello there.")

    async def scenario():
        client = openai_client(service)
        response = await client.responses.create(model="m", input="Say hello", instructions="Be brief.")
        fetched = await client.responses.retrieve(response.id)
        items = await client.responses.input_items.list(response.id)
        await client.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response.id)
        return response, fetched, items

    response, fetched, items = asyncio.run(scenario())
    assert response.status == "completed" and response.output_text == "Hello there."
    assert response.instructions == "Be brief." and response.usage.output_tokens == len(service.worker.script)
    assert fetched.model_dump() == response.model_dump()
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Say hello")]
    assert "Be brief." in _prompt(service) and "Say hello" in _prompt(service)


def test_tool_call_then_tool_output_turn_continues_the_conversation(tokenizer):
    service = _service(tokenizer, CALL)

    async def scenario():
        client = openai_client(service)
        first = await client.responses.create(model="m", input="Weather in Paris?", tools=[WEATHER])
        call = first.output[0]
        service.worker.script = token_chunks(tokenizer, "It is sunny in Paris.")
        second = await client.responses.create(
            model="m", previous_response_id=first.id, tools=[WEATHER],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"}])
        third = await client.responses.create(model="m", previous_response_id=second.id, input="And tomorrow?")
        return first, second, third

    first, second, third = asyncio.run(scenario())
    call = first.output[0]
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Paris"})
    assert second.previous_response_id == first.id and second.output_text == "It is sunny in Paris."
    prompt = _prompt(service)  # the third turn sees the whole conversation, in order
    order = [prompt.index(s) for s in ("Weather in Paris?", "get_weather", "18 C, sunny", "It is sunny", "tomorrow")]
    assert order == sorted(order)


def test_json_schema_format_constrains_the_reply(tokenizer):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    service = _service(tokenizer, '{"city": "Paris"}')
    response = asyncio.run(openai_client(service).responses.create(
        model="m", input="A city?", text={"format": {"type": "json_schema", "name": "place", "schema": schema}}))
    assert json.loads(response.output_text) == {"city": "Paris"}
    assert response.text.format.type == "json_schema"
    assert service.worker.requests[0].params.structured_output is not None


def test_stream_sends_the_semantic_events_in_order(tokenizer):
    service = _service(tokenizer, "Hi! " + CALL)

    async def scenario():
        client = openai_client(service)
        async with client.responses.stream(model="m", input="Weather?", tools=[WEATHER]) as stream:
            events = [event async for event in stream]
            final = await stream.get_final_response()
        return events, final, await client.responses.retrieve(final.id)

    events, final, stored = asyncio.run(scenario())
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text_kinds = [k for k in kinds if k.startswith("response.output_text") or k.startswith("response.function")]
    assert text_kinds.index("response.output_text.done") < text_kinds.index("response.function_call_arguments.delta")
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Hi! "
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arguments) == {"city": "Paris"}
    assert [o.type for o in final.output] == ["message", "function_call"] and final.output_text == "Hi! "
    assert final.model_dump() == events[-1].response.model_dump()
    assert stored.model_dump() == _unparsed(final.model_dump())  # the stream helper adds its parsed fields


def test_thoughts_stream_as_a_reasoning_item_before_the_message(qwen3_tokenizer):  # noqa: F811
    service = _service(qwen3_tokenizer, f"<think>{THOUGHTS}</think>\n\n{ANSWER}")

    async def scenario():
        async with openai_client(service).responses.stream(model="m", input="2 + 2?") as stream:
            return [event async for event in stream], await stream.get_final_response()

    events, final = asyncio.run(scenario())
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHTS
    reasoning, message = final.output
    assert (reasoning.type, reasoning.content[0].text, final.output_text) == ("reasoning", THOUGHTS, ANSWER)
    assert final.usage.output_tokens_details.reasoning_tokens > 0


def test_a_reply_cut_short_is_incomplete(tokenizer):
    service = _service(tokenizer, "A long", finish="length")
    response = asyncio.run(openai_client(service).responses.create(model="m", input="Go on", max_output_tokens=2))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_a_response_is_invisible_to_another_api_key(tokenizer):
    keys = Secret({"key-a": "alice", "key-b": "bob"})
    service = _service(tokenizer, "Secret plans.", api_keys=keys)

    async def scenario():
        alice, bob = openai_client(service), openai_client(service)
        alice.api_key, bob.api_key = "key-a", "key-b"
        response = await alice.responses.create(model="m", input="Plans?")
        for attempt in (bob.responses.retrieve(response.id), bob.responses.delete(response.id),
                        bob.responses.input_items.list(response.id),
                        bob.responses.create(model="m", input="More", previous_response_id=response.id)):
            with pytest.raises(openai.NotFoundError):
                await attempt
        return await alice.responses.retrieve(response.id)

    assert asyncio.run(scenario()).output_text == "Secret plans."
    assert len(service.worker.requests) == 1  # bob's continuation never reached a worker


@pytest.mark.parametrize("input_, param", [
    ([{"type": "web_search_call", "id": "x"}], "input[0].type"),
    ([{"type": "function_call_output", "call_id": "nope", "output": "1"}], "input[0].call_id"),
    ([{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
     "input[0].content"),
    ([], "input"),
])
def test_bad_input_is_refused_and_nothing_is_stored(tokenizer, input_, param):
    service = _service(tokenizer, "never")
    with pytest.raises(openai.BadRequestError) as caught:
        asyncio.run(openai_client(service).responses.create(model="m", input=input_))
    assert caught.value.body["param"] == param
    assert not service.worker.requests and len(service.response_store) == 0


def test_unknown_previous_response_and_oversize_input_are_refused(tokenizer):
    service = _service(tokenizer, "never", max_request_bytes=1000)

    async def scenario():
        client = openai_client(service)
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.create(model="m", input="hi", previous_response_id="resp_missing")
        with pytest.raises(openai.APIStatusError) as oversize:
            await client.responses.create(model="m", input="x" * 2000)
        return missing.value, oversize.value

    missing, oversize = asyncio.run(scenario())
    assert missing.body["param"] == "previous_response_id" and oversize.status_code == 413
    assert not service.worker.requests and len(service.response_store) == 0


def test_store_false_keeps_nothing(tokenizer):
    service = _service(tokenizer, "Ephemeral.")

    async def scenario():
        client = openai_client(service)
        response = await client.responses.create(model="m", input="hi", store=False)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(response.id)
        return response

    assert asyncio.run(scenario()).store is False and len(service.response_store) == 0


def test_background_response_completes_or_is_cancelled(tokenizer):
    service = _service(tokenizer, "Done in the background.")

    async def wait_until_done(client, response_id):
        for _ in range(200):
            response = await client.responses.retrieve(response_id)
            if response.status != "in_progress":
                return response
            await asyncio.sleep(0.01)

    async def scenario():
        client = openai_client(service)
        started = await client.responses.create(model="m", input="Work", background=True)
        finished = await wait_until_done(client, started.id)
        service.worker.script = token_chunks(tokenizer, "Never")[:1] + [HANG]
        hanging = await client.responses.create(model="m", input="Work forever", background=True)
        await asyncio.sleep(0.05)
        cancelled = await client.responses.cancel(hanging.id)
        await asyncio.sleep(0.05)
        service.worker.script = token_chunks(tokenizer, "Done.")
        with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
            await client.responses.cancel((await client.responses.create(model="m", input="x")).id)
        return started, finished, cancelled, await client.responses.retrieve(hanging.id)

    started, finished, cancelled, stored = asyncio.run(scenario())
    assert (started.status, started.background, started.output) == ("in_progress", True, [])
    assert finished.status == "completed" and finished.output_text == "Done in the background."
    assert cancelled.status == stored.status == "cancelled"
    assert ledger_problems(service) == []  # the hanging worker call was cancelled, its slot given back


def test_a_streamed_background_response_outlives_its_client(tokenizer):
    """background + stream: the events as a plain stream's (the response marked background),
    the result stored; a client that goes away after the first events leaves the response to
    finish and be fetched, where a plain stream would be stopped."""
    from tests.fake_worker import asgi_request

    service = _service(tokenizer, "Streamed in the background.")

    async def scenario():
        client = openai_client(service)
        stream = await client.responses.create(model="m", input="Work", background=True, stream=True)
        events = [event async for event in stream]
        stored = await client.responses.retrieve(events[0].response.id)
        service.worker.script = token_chunks(tokenizer, "Finished without its client.")
        body = json.dumps({"model": "m", "input": "Work", "background": True, "stream": True}).encode()
        answer = await asgi_request(service.asgi_app(), "POST", "/v1/responses", body,
                                    {"content-type": "application/json"}, disconnect_after_body_parts=1)
        first = json.loads(answer.body.decode().split("data: ", 1)[1].split("\n", 1)[0])
        for _ in range(200):
            left = await client.responses.retrieve(first["response"]["id"])
            if left.status != "in_progress":
                break
            await asyncio.sleep(0.01)
        return events, stored, first, left

    events, stored, first, left = asyncio.run(scenario())
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert events[0].response.background and events[0].response.status == "in_progress"
    assert stored.status == "completed" and stored.output_text == events[-1].response.output_text == (
        "Streamed in the background.")
    assert first["type"] == "response.created"
    assert left.status == "completed" and left.output_text == "Finished without its client."
    assert ledger_problems(service) == []


def test_a_background_response_whose_replica_died_reads_as_failed(tokenizer):
    """A background response left in_progress by a replica that stopped saying it lives (it died)
    is stored failed by the next read, on any replica; a live one is refreshed and stays."""
    import time

    from raylm.router.responses_api.service import STALE_AFTER_S

    service = _service(tokenizer, "never")

    async def scenario():
        client = openai_client(service)
        service.worker.script = token_chunks(tokenizer, "Slow")[:1] + [HANG]
        live = await client.responses.create(model="m", input="Work", background=True)
        record = service.response_store.get("", live.id)
        orphan = {**record, "response": {**record["response"], "id": "resp_orphan"},
                  "alive_at": time.time() - STALE_AFTER_S - 1}
        service.response_store.put("", "resp_orphan", orphan)
        await asyncio.sleep(1.2)  # one keep-alive
        refreshed = service.response_store.get("", live.id)["alive_at"]
        still = await client.responses.retrieve(live.id)
        failed = await client.responses.retrieve("resp_orphan")
        await client.responses.cancel(live.id)
        return record["alive_at"], refreshed, still, failed

    first, refreshed, still, failed = asyncio.run(scenario())
    assert refreshed > first and still.status == "in_progress"
    assert failed.status == "failed" and "stopped" in failed.error.message
    assert service.response_store.get("", "resp_orphan")["response"]["status"] == "failed"


def test_a_background_request_refused_up_front_stores_nothing(tokenizer):
    service = _service(tokenizer, "never")

    async def scenario():
        client = openai_client(service)
        params = []
        for extra in ({"extra_headers": {"x-priority": "urgent"}}, {"store": False}):
            with pytest.raises(openai.BadRequestError) as caught:
                await client.responses.create(model="m", input="hi", background=True, **extra)
            params.append(caught.value.body["param"])
        return params

    assert asyncio.run(scenario()) == ["priority", "background"]
    assert not service.worker.requests and len(service.response_store) == 0


def test_a_stream_that_fails_midway_ends_with_error_and_failed_events_and_stores_nothing(tokenizer):
    service = _service(tokenizer, "never")
    service.worker.script = token_chunks(tokenizer, "Half a")[:2] + [RuntimeError("the worker broke")]

    async def scenario():
        async with openai_client(service).responses.stream(model="m", input="hi") as stream:
            return [event async for event in stream]

    events = asyncio.run(scenario())
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-2:] == ["error", "response.failed"]
    assert "response.completed" not in kinds and "internal error" in events[-2].message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error" and "internal error" in failed.error.message
    assert len(service.response_store) == 0 and ledger_problems(service) == []
