"""router/harmony.py and router/tool_format_harmony.py: gpt-oss's harmony replies told apart
into thoughts (the analysis channel), content (the final channel and preambles) and calls
(messages to ``functions.NAME``), whole and streamed at every split, over HTTP with the
official ``openai`` client, and calls forced by the format's grammar read back."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
from tokenizers import AddedToken

from raylm.model.text.tokenizer import Tokenizer
from raylm.router.harmony import MARKERS
from raylm.router.protocol import RequestParser
from raylm.router.responses import ResponseBuilder
from raylm.router.tool_format_harmony import HarmonyFormat
from raylm.router.tool_parsers import detect_tool_call_parser, tool_format
from raylm.router.tools import parse_tool_use
from raylm.workers.core.grammar import GrammarCompiler
from tests.fake_worker import openai_client
from tests.router.test_tool_formats import ADD, ASK, WEATHER, _accepts, _forced_text, _joined, _service, _stream

openai = pytest.importorskip("openai")

# What gpt-oss's template says (enough to be told apart), then the turns; its generation prompt
# opens the assistant's message.
TEMPLATE = ("{% if tools %}{{ tools | tojson }}{% endif %}{# <|channel|>commentary to=functions.x #}"
            "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
THOUGHTS = "The user wants weather and a sum."
CALLS = (f"<|channel|>analysis<|message|>{THOUGHTS}<|end|><|start|>assistant<|channel|>commentary<|message|>"
         "Checking both.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
         '<|message|>{"city": "Paris"}<|call|><|start|>assistant to=functions.add<|channel|>commentary json<|message|>'
         '{"a": 1, "b": 2}')
ANSWER = f"<|channel|>analysis<|message|>{THOUGHTS}<|end|><|start|>assistant<|channel|>final<|message|>Sunny; 3."
# reply, tools offered, then the whole reply's thoughts, content and calls
CASES = {
    "calls": (CALLS, True, THOUGHTS, "Checking both.", [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    "answer": (ANSWER, True, THOUGHTS, "Sunny; 3.", []),
    "cut in its thoughts": ("<|channel|>analysis<|message|>Hmm, <|en", False, "Hmm, <|en", "", []),
    "no channels": ('{"answer": "yes"}', False, None, '{"answer": "yes"}', []),
    "a recipient first": ('to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}', True, None, "",
                          [("add", {"a": 1, "b": 2})]),
    "text that starts like one": ("to=be or not", True, None, "to=be or not", []),
    "a call not offered": (CALLS.replace("functions.add", "functions.launch"), True, THOUGHTS,
                           'Checking both.\n\n{"a": 1, "b": 2}', [("get_weather", {"city": "Paris"})]),
}


@pytest.fixture(scope="module")
def harmony(tokenizer) -> Tokenizer:
    """The bundled tokenizer with gpt-oss's template and its markers as special tokens, as in
    gpt-oss's vocabulary."""
    out = copy.copy(tokenizer)
    out.backend = copy.deepcopy(tokenizer.backend)
    out.backend.add_special_tokens([AddedToken(t, special=True) for t in MARKERS])
    out.chat_template = TEMPLATE
    return out


def _parsed(harmony: Tokenizer, with_tools: bool):
    parser = RequestParser(harmony, ["m"], 4096)
    return parser, parser.parse_chat({"model": "m", "messages": ASK, **({"tools": [WEATHER, ADD]} if with_tools
                                                                         else {})})


def test_the_harmony_template_chooses_both_parsers(harmony):
    assert detect_tool_call_parser(TEMPLATE) == "harmony"
    parser, parsed = _parsed(harmony, False)
    assert parser.reasoning_parser == "harmony" and parsed.thoughts.channels
    assert parsed.params.skip_special_tokens is False  # its channels are special tokens
    with pytest.raises(ValueError, match="both parsers harmony"):
        RequestParser(harmony, ["m"], 4096, tool_call_parser="hermes")


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_at_every_split_a_reply_comes_apart_as_the_whole_one(case, harmony):
    reply, with_tools, thoughts, content, calls = CASES[case]
    parser, parsed = _parsed(harmony, with_tools)
    builder = ResponseBuilder(parsed, "id", 0, parser.tokenizer)
    _stream(builder, parser.tokenizer, [reply])
    message = builder.final()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"] or "") == (thoughts, content)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])] \
        == calls
    for cut in range(len(reply) + 1):
        builder = ResponseBuilder(parsed, "id", 0, parser.tokenizer)
        deltas = [d for i, piece in enumerate([reply[:cut], reply[cut:]]) for _, delta in builder.add(0, _chunk(
            piece, i == 1)) if (d := builder.stream_delta(0, delta))]
        sent = {key: "".join(d["choices"][0]["delta"].get(key, "") for d in deltas)
                for key in ("reasoning_content", "content")}
        assert sent == {"reasoning_content": thoughts or "", "content": content}, cut
        entries = [t for d in deltas for t in d["choices"][0]["delta"].get("tool_calls", [])]
        assert (_joined(entries) if entries else []) == calls, cut
        assert deltas[-1]["choices"][0]["finish_reason"] == ("tool_calls" if calls else "stop"), cut


def _chunk(text: str, last: bool):
    from raylm.workers.wire.replica_protocol import ChoiceDelta, GenerateChunk

    return GenerateChunk("r", [ChoiceDelta(0, text, [1], None, "stop" if last else None)], 3, 0, last)


def test_the_openai_client_gets_thoughts_content_and_calls_whole_and_streamed(harmony):
    service = _service(harmony, CALLS)

    async def both():
        client = openai_client(service)
        kwargs = dict(model="m", messages=ASK, tools=[WEATHER, ADD])
        return await client.chat.completions.create(**kwargs), [c async for c in await client.chat.completions.create(
            **kwargs, stream=True)]

    whole, chunks = asyncio.run(both())
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content == "Checking both."
    assert message.model_extra["reasoning_content"] == THOUGHTS
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == CASES["calls"][4]
    entries = [t.model_dump(exclude_none=True) for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert _joined(entries) == CASES["calls"][4]
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == THOUGHTS
    assert service.worker.requests[0].params.skip_special_tokens is False
    # The thoughts' tokens: up to the <|end|> closing them.
    ids = harmony.encode(CALLS, add_special_tokens=False)
    assert whole.usage.completion_tokens_details.reasoning_tokens == ids.index(harmony.token_to_id("<|end|>")) + 1


def test_calls_forced_by_the_harmony_grammar_are_read_back(harmony):
    fmt = tool_format("auto", harmony)
    compiler = GrammarCompiler(harmony, harmony.vocab_size, harmony.eos_token_ids)
    end = harmony.token_to_id("<|end|>")
    parser = RequestParser(harmony, ["m"], 4096)
    for choice, names in (("required", ("get_weather", "add")), ({"type": "function", "function": {"name": "add"}},
                                                                 ("add",))):
        parsed = parser.parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER, ADD], "tool_choice": choice})
        assert "<[" in parsed.params.structured_output.spec  # the markers forced as the special tokens
        thought = 0
        for seed in range(6):
            text = _forced_text(compiler, harmony, parsed.params.structured_output, seed, prefer=end)
            builder = ResponseBuilder(parsed, "id", 0, harmony)
            _stream(builder, harmony, [text])
            (call,) = builder.final()["choices"][0]["message"]["tool_calls"]
            assert call["function"]["name"] in names and isinstance(json.loads(call["function"]["arguments"]), dict)
            thought += text.startswith("<|channel|>analysis")
        assert 0 < thought < 6  # with and without thoughts first
    assert fmt.grammar(parse_tool_use({"tools": [WEATHER]})) is None  # auto: free


def test_where_the_markers_are_text_the_grammar_writes_them_as_text(tokenizer):
    """A vocabulary without harmony's tokens: the thoughts end at the first ``<|end|>`` text."""
    grammar = HarmonyFormat().grammar(parse_tool_use({"tools": [WEATHER], "tool_choice": "required"}))
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}'
    for text in (call, f"<|channel|>analysis<|message|>Oslo? <|end|><|start|>assistant{call}"):
        assert _accepts(compiler, tokenizer, grammar, text), text
    assert not _accepts(compiler, tokenizer, grammar, f"<|channel|>analysis<|message|>a<|end|>b<|end|>{call}")


def test_earlier_thoughts_reach_the_template_as_thinking(harmony):
    """gpt-oss's template shows a tool-call turn's ``thinking`` on the analysis channel and refuses
    one with both content and thinking; the turn as a reply gave it (thoughts, a preamble as
    content, a call) renders with its thoughts."""
    template = ("{% if tools %}{{ tools | tojson }}{% endif %}"
                "{% for m in messages %}{% if m.tool_calls is defined and m.tool_calls %}"
                "{% if m.content and m.thinking %}{{ raise_exception('Cannot pass both content and thinking') }}"
                "{% endif %}<|start|>assistant<|channel|>analysis<|message|>{{ m.content or m.thinking }}<|end|>"
                "<|start|>assistant to=functions.{{ m.tool_calls[0].function.name }}<|channel|>commentary json"
                "<|message|>{{ m.tool_calls[0].function.arguments }}<|call|>"
                "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
                "<|start|>assistant{# <|channel|>commentary to=functions.x #}")
    tokenizer = copy.copy(harmony)
    tokenizer.chat_template = template
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    messages = [*ASK, {"role": "assistant", "content": "Checking.", "reasoning_content": THOUGHTS, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    parsed = RequestParser(tokenizer, ["m"], 4096).parse_chat({"model": "m", "messages": messages, "tools": [ADD]})
    prompt = tokenizer.decode(parsed.prompts[0], skip_special_tokens=False)
    assert f"<|channel|>analysis<|message|>{THOUGHTS}<|end|>" in prompt and "Checking." not in prompt


def test_a_json_schema_applies_to_the_final_channel_after_the_thoughts(harmony):
    """Structured output on gpt-oss: thoughts first if the model starts them, then the final
    channel's message holds exactly the schema's JSON (the reply's content)."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    compiler = GrammarCompiler(harmony, harmony.vocab_size, harmony.eos_token_ids)
    end = harmony.token_to_id("<|end|>")
    parser = RequestParser(harmony, ["m"], 4096)
    parsed = parser.parse_chat({"model": "m", "messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "trip", "schema": schema}}})
    spec = parsed.params.structured_output.spec
    assert parsed.params.structured_output.kind == "grammar" and f"<[{harmony.token_to_id('<|channel|>')}]>" in spec
    thought = 0
    for seed in range(12):
        text = _forced_text(compiler, harmony, parsed.params.structured_output, seed, prefer=end)
        assert "<|channel|>final<|message|>" in text
        builder = ResponseBuilder(parsed, "id", 0, harmony)
        _stream(builder, harmony, [text])
        message = builder.final()["choices"][0]["message"]
        answer = json.loads(message["content"])
        assert set(answer) == {"city", "days"} and isinstance(answer["days"], int)
        thought += message.get("reasoning_content") is not None
    assert 0 < thought < 12  # with and without thoughts first
    choice = parser.parse_chat({"model": "m", "messages": ASK, "guided_choice": ["yes", "no"]})
    for seed in range(3):
        builder = ResponseBuilder(choice, "id", 0, harmony)
        _stream(builder, harmony, [_forced_text(compiler, harmony, choice.params.structured_output, seed, prefer=end)])
        assert builder.final()["choices"][0]["message"]["content"] in ("yes", "no")
    regex = parser.parse_chat({"model": "m", "messages": ASK, "guided_regex": "(yes|no)"})
    assert regex.params.structured_output.kind == "regex"  # the client's own: from the first token
