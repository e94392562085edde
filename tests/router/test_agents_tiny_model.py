"""Tool calls and reasoning through the real engine: a tiny random Qwen3 checkpoint (its
vocabulary with ``<think>`` / ``</think>`` and the families' call markers as tokens) writes
under the grammar each request gets from the router; the router reads the reply back. What
the model writes is random; only the grammar makes it a call in the family's format."""

from __future__ import annotations

import copy
import json

import pytest
from tokenizers import AddedToken

from raylm.model.loaders.load import load_model
from raylm.router.harmony import MARKERS as HARMONY_MARKERS
from raylm.router.protocol import RequestParser
from raylm.router.responses import ResponseBuilder
from raylm.router.tool_format_deepseek import MARKERS as DEEPSEEK_MARKERS
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from raylm.workers.wire.replica_protocol import ChoiceDelta, GenerateChunk
from tests.checkpoints import TINY_VOCAB, build_tiny_checkpoint, tiny_tokenizer
from tests.router.test_harmony import TEMPLATE as HARMONY_TEMPLATE
from tests.router.test_tool_formats import ADD, TEMPLATES, WEATHER

R1_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> LLM:
    path, _ = build_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("agents") / "m", vocab_size=TINY_VOCAB + 24)
    tokenizer = tiny_tokenizer(TINY_VOCAB)
    # As in Qwen's vocabulary: the tags are tokens, not special ones; as in Mistral's, DeepSeek's,
    # GLM's and gpt-oss's: their markers are special tokens.
    tokenizer.add_tokens([AddedToken(t, special=False) for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")])
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in (
        "[TOOL_CALLS]", "[ARGS]", *DEEPSEEK_MARKERS, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
        *HARMONY_MARKERS)])
    tokenizer.save(str(path / "tokenizer.json"))
    return LLM(load_model(path), max_model_len=512, num_kv_blocks=64)


def _reply(llm: LLM, template: str, body: dict) -> tuple[dict, SamplingParams]:
    """The chat reply the router makes of what the engine writes for ``body``, and the params
    the router gave the engine."""
    tokenizer = copy.copy(llm.get_tokenizer())
    tokenizer.chat_template = template
    parser = RequestParser(tokenizer, ["m"], 512)
    parsed = parser.parse_chat({"model": "m", "messages": ASK, **body})
    out = llm.generate([{"prompt_token_ids": parsed.prompts[0]}], parsed.params)[0].outputs[0]
    builder = ResponseBuilder(parsed, "id", 0, tokenizer)
    builder.add(0, GenerateChunk("r", [ChoiceDelta(0, out.text, list(out.token_ids), None, out.finish_reason)], 3, 0,
                                 True))
    return builder.final(), parsed.params


@pytest.mark.parametrize("family", [f for f in TEMPLATES if f != "pythonic_bare"])  # its grammar is pythonic's
def test_calls_forced_in_each_format_are_read_back(tiny, family):
    named = {"type": "function", "function": {"name": "get_weather"}}
    template = TEMPLATES[family].replace("{{ tools | tojson }}", "")  # short prompts: the tiny model's context is 512
    reply, params = _reply(tiny, template, {"tools": [WEATHER, ADD], "tool_choice": named, "max_tokens": 150,
                                             "temperature": 0})
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather" and arguments["city"] in ("Paris", "Oslo")
    # The markers that are special tokens here must survive decoding (and those that are plain
    # tokens were written as those tokens: the grammar names them).
    assert params.skip_special_tokens == (not family.startswith(("mistral", "deepseek", "glm45")))
    if family in ("hermes", "glm45", "qwen3_coder"):
        assert f"<[{tiny.get_tokenizer().token_to_id('<tool_call>')}]>" in params.structured_output.spec


def test_a_thinking_reply_is_free_until_its_thoughts_end_then_follows_the_schema(tiny):
    close = tiny.get_tokenizer().token_to_id("</think>")
    reply, _ = _reply(tiny, R1_TEMPLATE, {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA}}, "max_tokens": 200, "temperature": 1.0, "seed": 1,
        "logit_bias": {str(close): 4}})  # nudges the random model to end its thoughts
    message = reply["choices"][0]["message"]
    assert json.loads(message["content"])["answer"] in ("yes", "no"), message
    assert message["reasoning_content"]  # free text the grammar let through (random tokens)
    usage = reply["usage"]
    assert 1 < usage["completion_tokens_details"]["reasoning_tokens"] < usage["completion_tokens"]


@pytest.mark.parametrize("schema", [False, True], ids=["free-answer", "json-answer"])
def test_a_thinking_budget_ends_the_thoughts_at_that_many_tokens(tiny, schema):
    """Random thoughts, never ended by the model (no nudge), end at the budget: the grammar
    forces </think>; the answer follows, free or under the JSON schema."""
    body = {"max_tokens": 60, "temperature": 1.0, "seed": 2, "thinking_token_budget": 7}
    if schema:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    reply, params = _reply(tiny, R1_TEMPLATE, body)
    message, usage = reply["choices"][0]["message"], reply["usage"]
    assert "[max_tokens=7]" in params.structured_output.spec
    # (reasoning_tokens counts the thoughts and their closing tag)
    assert message["reasoning_content"] and usage["completion_tokens_details"]["reasoning_tokens"] == 7 + 1
    assert usage["completion_tokens"] > 8  # the thoughts, </think>, then an answer
    if schema:
        assert json.loads(message["content"])["answer"] in ("yes", "no"), message


def test_a_thinking_budget_is_refused_where_it_cannot_hold(tiny):
    from raylm.router.errors import OpenAIError

    for template, body in [(R1_TEMPLATE, {"thinking_token_budget": 0}),
                           ("{% for m in messages %}{{ m.content }}{% endfor %}", {"thinking_token_budget": 5})]:
        with pytest.raises(OpenAIError) as err:
            _reply(tiny, template, {"max_tokens": 8, **body})
        assert err.value.status == 400 and err.value.param == "thinking_token_budget"


def test_a_harmony_call_forced_after_the_thoughts_is_read_back(tiny):
    """gpt-oss's format: the thoughts (free text, nudged to end) in the analysis channel, then
    the call in the commentary channel, both from the one grammar."""
    end = tiny.get_tokenizer().token_to_id("<|end|>")
    reply, params = _reply(tiny, HARMONY_TEMPLATE.replace("{{ tools | tojson }}", ""), {
        "tools": [WEATHER, ADD], "tool_choice": "required", "max_tokens": 150, "temperature": 1.0, "seed": 1,
        "logit_bias": {str(end): 4}})
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and params.skip_special_tokens is False, choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] in ("get_weather", "add") and isinstance(json.loads(call["function"]["arguments"]),
                                                                             dict)
    assert choice["message"]["reasoning_content"], choice  # the thoughts came first (random text)
    assert 0 < reply["usage"]["completion_tokens_details"]["reasoning_tokens"] < reply["usage"]["completion_tokens"]
