"""router/tools.py and its use by the parser and the response builder: which tools a request
offers, the prompt they make, the grammar that forces calls, and calls read back from replies
(whole and streamed)."""

from __future__ import annotations

import json

import pytest

from raylm.router.errors import OpenAIError
from raylm.router.protocol import RequestParser
from raylm.router.responses import ResponseBuilder
from raylm.router.tools import (
    ToolUse,
    forced_calls_grammar,
    held_back,
    parse_tool_calls,
    parse_tool_use,
    template_messages,
)
from raylm.workers.core.grammar import GrammarCompiler
from raylm.workers.wire.replica_protocol import ChoiceDelta, GenerateChunk

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def parser(tokenizer):
    return RequestParser(tokenizer, ["m"], 2048)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_malformed_tools_are_refused_by_name(body, param):
    with pytest.raises(OpenAIError) as err:
        parse_tool_use(body)
    assert err.value.status == 400 and err.value.param == param


def test_tool_choice_forms():
    assert parse_tool_use({}) is None and parse_tool_use({"tools": [WEATHER], "tool_choice": "none"}) is None
    assert parse_tool_use({"tools": [WEATHER]}).choice == "auto"
    use = parse_tool_use({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}},
                          "parallel_tool_calls": False})
    assert (use.choice, use.names, use.parallel) == ("add", ["get_weather", "add"], False)


def test_a_template_without_tools_gets_them_in_the_system_message_and_the_history_as_text():
    use = parse_tool_use({"tools": [WEATHER]})
    history = [{"role": "system", "content": "Be brief."}, *ASK,
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "content": "18 C, sunny", "tool_call_id": "c1"}]
    messages, extra = template_messages(history, use, template_takes_tools=False)
    assert extra == {}
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.\n\nYou may call")
    assert json.dumps(WEATHER) in messages[0]["content"]
    assert messages[2] == {"role": "assistant",
                           "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert messages[3] == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    templated, extra = template_messages(history, use, template_takes_tools=True)
    assert extra == {"tools": [WEATHER]} and templated[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert templated[3]["role"] == "tool"


def _call(call_id, name: str = "get_weather", arguments: str = '{"city": "Paris"}') -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CALLED = [*ASK, {"role": "assistant", "content": None, "tool_calls": [_call("c1"), _call("c2", "add", '{"a": 1}')]}]


@pytest.mark.parametrize("messages, param", [
    ([*CALLED, {"role": "tool", "content": "18 C"}], "messages[2].tool_call_id"),
    ([*CALLED, {"role": "tool", "content": "18 C", "tool_call_id": ""}], "messages[2].tool_call_id"),
    ([*CALLED, {"role": "tool", "content": "18 C", "tool_call_id": 1}], "messages[2].tool_call_id"),
    ([*CALLED, {"role": "tool", "content": "18 C", "tool_call_id": "c9"}], "messages[2].tool_call_id"),
    ([{"role": "tool", "content": "18 C", "tool_call_id": "c1"}, *ASK], "messages[0].role"),
    ([*ASK, {"role": "assistant", "content": "Let me see."}, {"role": "tool", "content": "18 C", "tool_call_id": "c1"}],
     "messages[2].role"),
    ([*CALLED, {"role": "tool", "content": "18 C", "tool_call_id": "c1"}, {"role": "user", "content": "And?"},
      {"role": "tool", "content": "3", "tool_call_id": "c2"}], "messages[4].role"),
    ([*ASK, {"role": "assistant", "content": None, "tool_calls": [_call(7)]}], "messages[1].tool_calls[0].id"),
])
def test_a_tool_message_must_answer_a_call_of_the_assistant_message_before_it(parser, messages, param):
    """OpenAI's rule: a tool result carries the id of a call the preceding assistant turn made."""
    with pytest.raises(OpenAIError) as err:
        parser.parse_chat({"model": "m", "messages": messages, "tools": [WEATHER, ADD]})
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_results_of_parallel_calls_in_any_order_pass(parser):
    history = [*CALLED, {"role": "tool", "content": "3", "tool_call_id": "c2"},
               {"role": "tool", "content": "18 C", "tool_call_id": "c1"},
               {"role": "assistant", "content": "", "tool_calls": [_call("c3")]},
               {"role": "tool", "content": "19 C", "tool_call_id": "c3"}]
    parsed = parser.parse_chat({"model": "m", "messages": history, "tools": [WEATHER, ADD]})
    assert parser.tokenizer.decode(parsed.prompts[0]).count("<tool_response>") == 3


def test_required_and_named_grammars_admit_exactly_well_formed_calls(tokenizer):
    compiler = GrammarCompiler(tokenizer, 49152, frozenset({0, 2}))
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

    def accepts(use: ToolUse, text: str) -> bool:
        matcher = compiler.matcher(forced_calls_grammar(use))
        ids = tokenizer.encode(text)
        return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()

    required = parse_tool_use({"tools": [WEATHER, ADD], "tool_choice": "required"})
    assert accepts(required, call) and accepts(required, weather) and accepts(required, f"{call}\n{weather}")
    assert not accepts(required, '<tool_call>\n{"name": "add", "arguments": {"a": "one", "b": 2}}\n</tool_call>')
    assert not accepts(required, "Sure! " + call)
    named = parse_tool_use({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}})
    assert accepts(named, call) and not accepts(named, weather) and not accepts(named, f"{call}\n{call}")
    assert forced_calls_grammar(parse_tool_use({"tools": [WEATHER]})) is None  # auto: free


def test_calls_are_read_back_and_anything_else_stays_content():
    use = parse_tool_use({"tools": [WEATHER, ADD]})
    content, calls = parse_tool_calls(
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', use)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    for text in ("No tools needed.", '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
                 "<tool_call>{not json</tool_call>", '<tool_call>\n{"name": "add", "argum'):
        assert parse_tool_calls(text, use) == (text, [])
    assert [held_back(t) for t in ("abc", "abc<tool", "abc<tool_call>{", "a<")] == [3, 3, 3, 1]


def _chunks(texts: list[str], finish: str = "stop") -> list[GenerateChunk]:
    return [GenerateChunk("r", [ChoiceDelta(0, t, [1], None, finish if i == len(texts) - 1 else None)], 5, 0,
                          i == len(texts) - 1) for i, t in enumerate(texts)]


def test_the_response_builder_reports_calls_whole_and_streamed(parser):
    parsed = parser.parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER]})
    pieces = ["I will look", " it up.\n<tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
              "\n</tool_call>"]
    whole = ResponseBuilder(parsed, "id", 0, parser.tokenizer)
    for chunk in _chunks(pieces):
        whole.add(0, chunk)
    choice = whole.final()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "I will look it up."
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}

    streamed = ResponseBuilder(parsed, "id", 0, parser.tokenizer)
    deltas = [streamed.stream_delta(i, d) for chunk in _chunks(pieces) for i, d in streamed.add(0, chunk)]
    sent = [d["choices"][0]["delta"] for d in deltas if d is not None]
    assert "".join(d.get("content", "") for d in sent) == "I will look it up.\n"
    assert [d["choices"][0]["finish_reason"] for d in deltas if d is not None][-1] == "tool_calls"
    entries = [t for d in sent for t in d.get("tool_calls", [])]
    # The name as soon as it is written, then the arguments as they grow (OpenAI's stream shape).
    assert entries[0] == {"index": 0, "id": entries[0]["id"], "type": "function",
                          "function": {"name": "get_weather", "arguments": ""}}
    pieces_sent = [t["function"]["arguments"] for t in entries[1:]]
    assert all(t["index"] == 0 and set(t) == {"index", "function"} for t in entries[1:])
    assert "".join(pieces_sent) == choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'

    cut = ResponseBuilder(parsed, "id", 0, parser.tokenizer)  # max_tokens ran out inside a second call
    for chunk in _chunks([*pieces, '\n<tool_call>\n{"name": "get_w'], finish="length"):
        cut.add(0, chunk)
    choice = cut.final()["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["message"]["tool_calls"]) == 1

    plain = ResponseBuilder(parsed, "id", 0, parser.tokenizer)  # no call: everything is content
    deltas = [plain.stream_delta(i, d) for chunk in _chunks(["Paris is", " sunny <tool"]) for i, d in plain.add(0, chunk)]
    assert "".join(d["choices"][0]["delta"].get("content", "") for d in deltas if d) == "Paris is sunny <tool"
    assert deltas[-1]["choices"][0]["finish_reason"] == "stop"


def _streamed_calls(builder: ResponseBuilder, texts: list[str], finish: str = "stop") -> tuple[list, str | None]:
    """Every tool_calls entry a stream sends, and its last finish_reason."""
    deltas = [d for chunk in _chunks(texts, finish) for i, delta in builder.add(0, chunk)
              if (d := builder.stream_delta(i, delta)) is not None]
    entries = [t for d in deltas for t in d["choices"][0]["delta"].get("tool_calls", [])]
    return entries, deltas[-1]["choices"][0]["finish_reason"]


def _joined(entries: list[dict]) -> dict[int, dict[str, str]]:
    """Stream entries put together per call index, as a client does."""
    calls: dict[int, dict[str, str]] = {}
    for t in entries:
        call = calls.setdefault(t["index"], {"id": "", "name": "", "arguments": ""})
        call["id"] += t.get("id", "")
        call["name"] += t.get("function", {}).get("name", "")
        call["arguments"] += t["function"].get("arguments", "")
    return calls


@pytest.mark.parametrize("split", [1, 3, 7, 1000])
def test_streamed_calls_put_together_equal_the_whole_reply(parser, split):
    """Parallel calls streamed in pieces of any size join into the calls of the non-streamed
    reply; a call written arguments-first (no name to announce early) comes out whole at the end."""
    parsed = parser.parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER, ADD]})
    reply = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Saint-\\"Malo\\" }"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": {"nested": [2, 3]}}}\n</tool_call>\n'
             '<tool_call>{"arguments": {"a": 5, "b": 6}, "name": "add"}</tool_call>')
    texts = [reply[k:k + split] for k in range(0, len(reply), split)]
    whole = ResponseBuilder(parsed, "id", 0, parser.tokenizer)
    for chunk in _chunks(texts):
        whole.add(0, chunk)
    expected = whole.final()["choices"][0]["message"]["tool_calls"]
    entries, finish = _streamed_calls(ResponseBuilder(parsed, "id", 0, parser.tokenizer), texts)
    joined = _joined(entries)
    assert finish == "tool_calls" and sorted(joined) == [0, 1, 2]
    assert [(c["name"], c["arguments"]) for c in joined.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in expected]
    assert json.loads(joined[1]["arguments"]) == {"a": 1, "b": {"nested": [2, 3]}}
    assert all(c["id"].startswith("call_") for c in joined.values())


def test_a_stream_cut_short_inside_a_call_finishes_with_length(parser):
    parsed = parser.parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER]})
    entries, finish = _streamed_calls(ResponseBuilder(parsed, "id", 0, parser.tokenizer),
                                      ['<tool_call>\n{"name": "get_weather", ', '"arguments": {"city": "Par'], "length")
    assert finish == "length" and _joined(entries)[0]["arguments"] == '{"city": "Par'
    # A name that is not an offered function is never announced: the reply stays content.
    builder = ResponseBuilder(parsed, "id", 0, parser.tokenizer)
    text = '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>'
    entries, finish = _streamed_calls(builder, [text])
    assert entries == [] and finish == "stop" and builder.choices[0].reply.streamed == len(text)


def test_forced_calls_cannot_be_combined_with_structured_output(parser):
    with pytest.raises(OpenAIError) as err:
        parser.parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
                           "response_format": {"type": "json_object"}})
    assert err.value.param == "tool_choice"
    parsed = parser.parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER], "tool_choice": "required"})
    assert parsed.params.structured_output.kind == "grammar" and parsed.tool_use.choice == "required"
