"""The Messages API through the real engine: a tiny random Qwen3 checkpoint answers a
``/v1/messages`` request restated by router/anthropic/request.py, and its reply is shaped by
router/anthropic/reply.py. What the model writes is random; a named ``tool_choice`` makes the
grammar force a call, which must come back as a ``tool_use`` block with a schema-valid input."""

from __future__ import annotations

import copy

from raylm.router.anthropic.reply import MessageBuilder
from raylm.router.anthropic.request import chat_body
from raylm.router.protocol import RequestParser
from raylm.workers.engine.llm import LLM
from raylm.workers.wire.replica_protocol import ChoiceDelta, GenerateChunk
from tests.router.test_agents_tiny_model import tiny  # noqa: F401 (the module's checkpoint fixture)
from tests.router.test_tool_formats import TEMPLATES

WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}


def test_named_tool_choice_comes_back_as_a_tool_use_block(tiny: LLM):  # noqa: F811
    tokenizer = copy.copy(tiny.get_tokenizer())
    tokenizer.chat_template = TEMPLATES["hermes"]
    parser = RequestParser(tokenizer, ["m"], 512)
    body = {"model": "m", "max_tokens": 64, "system": "Use the tools.", "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]}]}
    parsed = parser.parse_chat(chat_body(body, parser.reasoning_parser, tokenizer.chat_template))
    out = tiny.generate([{"prompt_token_ids": parsed.prompts[0]}], parsed.params)[0].outputs[0]
    builder = MessageBuilder(parsed, "msg_1", tokenizer)
    events = builder.add(GenerateChunk("r", [ChoiceDelta(0, out.text, list(out.token_ids), None, out.finish_reason)],
                                       len(parsed.prompts[0]), 0, True))
    message = builder.message()
    uses = [b for b in message["content"] if b["type"] == "tool_use"]
    assert len(uses) >= 1 and uses[0]["name"] == "get_weather" and uses[0]["input"]["city"] in ("Paris", "Oslo")
    assert message["stop_reason"] == "tool_use" and message["usage"]["output_tokens"] == len(out.token_ids)
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"][-1] == "tool_use"
