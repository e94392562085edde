"""Anthropic's Messages API (``/v1/messages``) with the official ``anthropic`` client, in-process
over a fake worker that writes a scripted reply token by token: a plain reply whole and
streamed (events in Anthropic's order), a tool_use reply and a tool_result turn, thinking
blocks with a Qwen3-style template, stop reasons, count_tokens, and errors in Anthropic's shape
(with ``x-api-key`` keys)."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
from tokenizers import AddedToken

from raylm.model.text.tokenizer import Tokenizer
from raylm.router.anthropic.request import chat_body
from raylm.router.auth import Secret
from raylm.router.errors import OpenAIError
from raylm.router.openai_service import OpenAIService
from raylm.workers.wire.replica_protocol import ChoiceDelta, GenerateChunk
from tests.fake_worker import FakeWorker, fake_settings, ledger_problems, token_chunks
from tests.router.test_reasoning_http import QWEN3_TEMPLATE

anthropic = pytest.importorskip("anthropic")

ASK = [{"role": "user", "content": "What is 2 + 2?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _service(tokenizer: Tokenizer, reply: str, finish: str = "stop", **settings) -> OpenAIService:
    service = OpenAIService(FakeWorker(token_chunks(tokenizer, reply, finish)), fake_settings(**settings), tokenizer)
    service.admission.set_capacity(4)
    return service


def _client(service: OpenAIService, api_key: str = "unused"):
    import httpx2  # the HTTP package this anthropic release is built on

    transport = httpx2.ASGITransport(app=service.asgi_app())
    return anthropic.AsyncAnthropic(base_url="http://router", api_key=api_key, max_retries=0,
                                    http_client=httpx2.AsyncClient(transport=transport, base_url="http://router"))


async def _whole_and_events(service: OpenAIService, **kwargs):
    client = _client(service)
    whole = await client.messages.create(model="m", max_tokens=64, **kwargs)
    stream = await client.messages.create(model="m", max_tokens=64, stream=True, **kwargs)
    return whole, [event async for event in stream]


def _event_kinds(events) -> list[str]:
    return [e.type + (f":{e.content_block.type}" if e.type == "content_block_start" else "")
            + (f":{e.delta.type}" if e.type == "content_block_delta" else "") for e in events]


def test_plain_reply_whole_and_streamed(tokenizer):
    service = _service(tokenizer, "Four, of course.")
    whole, events = asyncio.run(_whole_and_events(service, system="Be brief.", messages=ASK))
    assert whole.id.startswith("msg_") and (whole.type, whole.role, whole.model) == ("message", "assistant", "m")
    assert [(b.type, b.text) for b in whole.content] == [("text", "Four, of course.")]
    assert (whole.stop_reason, whole.stop_sequence) == ("end_turn", None)
    prompt = len(tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *ASK], True), add_special_tokens=False))
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (prompt, len(tokenizer.encode("Four, of course.",
                                                                                                  False)))
    kinds = _event_kinds(events)
    deltas = kinds.count("content_block_delta:text_delta")
    assert kinds == ["message_start", "content_block_start:text", *["content_block_delta:text_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"] and deltas > 1
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == "Four, of course."
    assert events[0].message.usage.input_tokens == prompt
    assert (events[-2].delta.stop_reason, events[-2].usage.output_tokens) == ("end_turn", whole.usage.output_tokens)


def test_raw_stream_names_each_event_and_pings_after_message_start(tokenizer):
    import httpx2

    async def names():
        app = _service(tokenizer, "Four.").asgi_app()
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://router") as http:
            answer = await http.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": ASK,
                                                           "stream": True})
        events = [part.split("\n") for part in answer.text.strip().split("\n\n")]
        assert all(json.loads(data[len("data: "):])["type"] == name[len("event: "):] for name, data in events)
        return [name[len("event: "):] for name, _ in events]

    assert asyncio.run(names())[:3] == ["message_start", "ping", "content_block_start"]


def test_stream_helper_accumulates_the_same_message(tokenizer):
    async def run():
        async with _client(_service(tokenizer, "Four.")).messages.stream(model="m", max_tokens=32,
                                                                        messages=ASK) as stream:
            return await stream.get_final_message()

    final = asyncio.run(run())
    assert [b.text for b in final.content] == ["Four."] and final.stop_reason == "end_turn"


def test_stop_reasons(tokenizer):
    cut = asyncio.run(_whole_and_events(_service(tokenizer, "Four and", "length"), messages=ASK))
    assert cut[0].stop_reason == "max_tokens" and cut[1][-2].delta.stop_reason == "max_tokens"
    stopped = _service(tokenizer, "x")
    stopped.worker.script = [GenerateChunk("r", [ChoiceDelta(0, "Four", [1], None, "stop", stop_reason="END")],
                                           prompt_tokens=3, num_cached_tokens=2, finished=True)]
    reply, events = asyncio.run(_whole_and_events(stopped, messages=ASK, stop_sequences=["END", "STOP"]))
    assert (reply.content[0].text, reply.stop_reason, reply.stop_sequence) == ("Four", "stop_sequence", "END")
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", "END")
    # Prompt tokens served from the prefix cache are cache reads, not input tokens, from the first event on.
    prompt = len(stopped.worker.requests[0].prompt_token_ids)
    for usage in (reply.usage, events[0].message.usage, events[-2].usage):
        assert (usage.input_tokens, usage.cache_read_input_tokens) == (prompt - 2, 2)
    assert stopped.worker.requests[0].params.stop == ["END", "STOP"]


def test_tool_use_reply_then_tool_result_turn(tokenizer):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    service = _service(tokenizer, "Let me look.\n" + call)
    whole, events = asyncio.run(_whole_and_events(service, messages=ASK, tools=[WEATHER],
                                                  tool_choice={"type": "auto"}))
    assert [b.type for b in whole.content] == ["text", "tool_use"] and whole.stop_reason == "tool_use"
    use = whole.content[1]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    kinds = [k for k in _event_kinds(events) if not k.startswith("content_block_delta")]
    assert kinds == ["message_start", "content_block_start:text", "content_block_stop",
                     "content_block_start:tool_use", "content_block_stop", "message_delta", "message_stop"]
    arguments = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                        and e.delta.type == "input_json_delta")
    assert json.loads(arguments) == {"city": "Paris"} and events[-2].delta.stop_reason == "tool_use"

    # The next turn answers the call; the result reaches the template as a tool message.
    answered = _service(tokenizer, "It is sunny in Paris.")
    history = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                       {"type": "tool_use", "id": use.id, "name": use.name,
                                                        "input": use.input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": [{"type": "text", "text": "sunny, 24C"}]}]}]
    reply = asyncio.run(_client(answered).messages.create(model="m", max_tokens=32, messages=history, tools=[WEATHER]))
    assert reply.content[0].text == "It is sunny in Paris." and reply.stop_reason == "end_turn"
    prompt = tokenizer.decode(answered.worker.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert "sunny, 24C" in prompt and '"city": "Paris"' in prompt


@pytest.fixture(scope="module")
def qwen3_tokenizer(tokenizer) -> Tokenizer:
    qwen3 = copy.copy(tokenizer)
    qwen3.backend = copy.deepcopy(tokenizer.backend)
    qwen3.backend.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    qwen3.chat_template = QWEN3_TEMPLATE
    return qwen3


def test_thinking_blocks_whole_and_streamed(qwen3_tokenizer):
    service = _service(qwen3_tokenizer, "<think>\nTwo and two.\n</think>\n\nFour.")
    thinking = {"type": "enabled", "budget_tokens": 32}
    whole, events = asyncio.run(_whole_and_events(service, messages=ASK, thinking=thinking))
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in whole.content] == [
        ("thinking", "\nTwo and two.\n"), ("text", "Four.")]
    # budget_tokens holds the thoughts (</think> is one token here): the grammar's thoughts rule.
    assert "[max_tokens=32]" in service.worker.requests[0].params.structured_output.spec
    kinds = [k for k in _event_kinds(events) if not k.startswith("content_block_delta")]
    assert kinds == ["message_start", "content_block_start:thinking", "content_block_stop",
                     "content_block_start:text", "content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == "\nTwo and two.\n"

    # Thinking off reaches the template as enable_thinking: false; earlier thoughts render in the history.
    off = _service(qwen3_tokenizer, "Four.")
    history = [*ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Sum.", "signature": ""},
                                                       {"type": "text", "text": "Four."}]}, *ASK]
    reply = asyncio.run(_client(off).messages.create(model="m", max_tokens=16, messages=history,
                                                     thinking={"type": "disabled"}))
    assert [b.type for b in reply.content] == ["text"]
    prompt = qwen3_tokenizer.decode(off.worker.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<think>\n\n</think>\n\n") and "<think>Sum.</think>Four." in prompt


def test_budget_tokens_bound_the_thoughts_only_where_they_end_with_one_token():
    thinking = {"model": "m", "max_tokens": 64, "messages": ASK, "thinking": {"type": "enabled", "budget_tokens": 40}}
    assert chat_body(thinking, "qwen3", QWEN3_TEMPLATE, budget_enforceable=True)["thinking_token_budget"] == 40
    assert "thinking_token_budget" not in chat_body(thinking, "qwen3", QWEN3_TEMPLATE, budget_enforceable=False)
    off = {**thinking, "thinking": {"type": "disabled"}}
    assert "thinking_token_budget" not in chat_body(off, "qwen3", QWEN3_TEMPLATE, budget_enforceable=True)


def test_thinking_refused_where_the_model_cannot(tokenizer):
    async def status():
        with pytest.raises(anthropic.BadRequestError) as err:
            await _client(_service(tokenizer, "x")).messages.create(
                model="m", max_tokens=16, messages=ASK, thinking={"type": "enabled", "budget_tokens": 8})
        return err.value

    err = asyncio.run(status())
    assert err.body["error"]["type"] == "invalid_request_error" and "does not think" in err.body["error"]["message"]


def test_count_tokens(tokenizer):
    count = asyncio.run(_client(_service(tokenizer, "x")).messages.count_tokens(model="m", messages=ASK))
    assert count.input_tokens == len(tokenizer.encode(tokenizer.apply_chat_template(ASK, True), False))


def test_errors_in_anthropics_shape(tokenizer):
    service = _service(tokenizer, "x", api_keys=Secret({"good": "team"}))

    async def failures():
        out = []
        for api_key, kwargs in [("bad", {}), ("good", {"model": "nope"}), ("good", {"max_tokens": 0}),
                                ("good", {"messages": [{"role": "user", "content": [{"type": "image"}]}]}),
                                ("good", {"max_tokens": 10_000})]:
            request = {"model": "m", "max_tokens": 16, "messages": ASK, **kwargs}
            with pytest.raises(anthropic.APIStatusError) as err:
                await _client(service, api_key).messages.create(**request)
            out.append((err.value.status_code, err.value.body["type"], err.value.body["error"]["type"]))
        return out

    assert asyncio.run(failures()) == [(401, "error", "authentication_error"), (404, "error", "not_found_error"),
                                       (400, "error", "invalid_request_error"), (400, "error", "invalid_request_error"),
                                       (400, "error", "invalid_request_error")]
    reply = asyncio.run(_client(service, "good").messages.create(model="m", max_tokens=16, messages=ASK))
    assert reply.content[0].text == "x"

    async def bearer(key: str) -> int:  # the key as OpenAI clients send it works too
        import httpx2

        transport = httpx2.ASGITransport(app=service.asgi_app())
        async with httpx2.AsyncClient(transport=transport, base_url="http://router") as http:
            answer = await http.post("/v1/messages/count_tokens", json={"model": "m", "messages": ASK},
                                     headers={"Authorization": f"Bearer {key}"})
        return answer.status_code

    assert asyncio.run(bearer("good")) == 200 and asyncio.run(bearer("bad")) == 401


def test_rate_limit_unknown_paths_and_methods_in_anthropics_shape(tokenizer):
    """A tenant past its rate limit gets Anthropic's 429 (the client's RateLimitError, with
    Retry-After); a path under /v1/messages the router lacks, or a wrong method, is Anthropic's
    not_found_error / a 405 in its shape, while the OpenAI paths keep OpenAI's."""
    import httpx2

    service = _service(tokenizer, "x", requests_per_minute=1)

    async def run():
        client = _client(service)
        await client.messages.create(model="m", max_tokens=8, messages=ASK)
        with pytest.raises(anthropic.RateLimitError) as limited:
            await client.messages.create(model="m", max_tokens=8, messages=ASK)
        transport = httpx2.ASGITransport(app=service.asgi_app())
        async with httpx2.AsyncClient(transport=transport, base_url="http://router") as http:
            missing = await http.post("/v1/messages/batches", json={})
            wrong_method = await http.get("/v1/messages")
            openai_missing = await http.post("/v1/nothing", json={})
        return limited.value, missing, wrong_method, openai_missing

    limited, missing, wrong_method, openai_missing = asyncio.run(run())
    assert limited.body == {"type": "error", "error": {"type": "rate_limit_error", "message": limited.body["error"]["message"]}}
    assert int(limited.response.headers["retry-after"]) >= 1
    assert (missing.status_code, missing.json()["type"], missing.json()["error"]["type"]) == (404, "error",
                                                                                               "not_found_error")
    assert (wrong_method.status_code, wrong_method.json()["type"]) == (405, "error")
    assert openai_missing.status_code == 404 and "type" not in openai_missing.json()  # OpenAI's {"error": {...}}


def test_overload_body_limit_and_midstream_failure(tokenizer):
    from ray.serve.exceptions import BackPressureError

    service = _service(tokenizer, "x", max_request_bytes=4096)

    async def run():
        client = _client(service)
        service.worker.script = [BackPressureError(num_queued_requests=1, max_queued_requests=1)]
        with pytest.raises(anthropic.APIStatusError) as busy:
            await client.messages.create(model="m", max_tokens=8, messages=ASK)
        with pytest.raises(anthropic.APIStatusError) as big:
            await client.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "x" * 5000}])
        service.worker.script = [*token_chunks(tokenizer, "Four and")[:1], RuntimeError("engine broke")]
        stream = await client.messages.create(model="m", max_tokens=8, messages=ASK, stream=True)
        with pytest.raises(anthropic.APIStatusError) as broke:
            _ = [event async for event in stream]
        return busy.value, big.value, broke.value

    busy, big, broke = asyncio.run(run())
    assert (busy.status_code, busy.body["error"]["type"]) == (503, "overloaded_error")
    assert (big.status_code, big.body["error"]["type"]) == (413, "request_too_large")
    assert broke.body["error"]["type"] == "api_error"
    assert not ledger_problems(service)


def test_history_blocks_become_chat_messages():
    body = {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Sys.", "cache_control": {}}],
            "metadata": {"user_id": "u1"}, "stop_sequences": ["END"], "top_k": 5,
            "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "messages": [*ASK, {"role": "assistant", "content": [
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "no such city",
                                              "is_error": True}, {"type": "text", "text": "Try again."}]}]}
    chat = chat_body(body, "none", None)
    assert chat["messages"] == [
        {"role": "system", "content": "Sys."}, *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: no such city"},
        {"role": "user", "content": "Try again."}]
    assert (chat["tool_choice"], chat["parallel_tool_calls"], chat["user"], chat["stop"], chat["top_k"]) == (
        "required", False, "u1", ["END"], 5)
    assert chat["tools"] == [{"type": "function", "function": {"name": "get_weather", "description": WEATHER[
        "description"], "parameters": WEATHER["input_schema"]}}]
    named = chat_body({**body, "tool_choice": {"type": "tool", "name": "get_weather"}}, "none", None)["tool_choice"]
    assert named == {"type": "function", "function": {"name": "get_weather"}}
    for bad, field in [({"top_logprobs": 2}, "top_logprobs"), ({"temperature": 1.5}, "temperature"),
                       ({"metadata": {"x": 1}}, "metadata"), ({"tools": [{"type": "bash_20250124", "name": "b"}]},
                                                              "tools.0")]:
        with pytest.raises(OpenAIError) as err:
            chat_body({**body, **bad}, "none", None)
        assert err.value.param == field


def test_text_documents_are_read_and_other_documents_refused():
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "The tide is high."},
           "title": "Tides", "context": "A note."}
    listed = {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "One. "},
                                                                             {"type": "text", "text": "Two."}]}}
    turn = [{"type": "text", "text": "Read:"}, doc, listed, {"type": "text", "text": "Summarize."}]
    chat = chat_body({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": turn}]}, "none", None)
    assert chat["messages"] == [{"role": "user", "content":
                                 "Read:\n\nTides\n\nA note.\n\nThe tide is high.\n\nOne. Two.\n\nSummarize."}]
    for bad, param in [({"source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}},
                        "messages.0.content.0.source.type"),
                       ({"citations": {"enabled": True}}, "messages.0.content.0.citations"),
                       ({"title": 3}, "messages.0.content.0.title")]:
        with pytest.raises(OpenAIError) as err:
            chat_body({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{**doc, **bad}]}]},
                      "none", None)
        assert err.value.param == param
