"""router/tool_formats.py: each family's tool-call format read back whole and streamed (split
at every position), over HTTP with the official ``openai`` client, and forced by its grammar:
the text a model writes under ``required`` / a named function (here a random one, any token
the grammar allows) is read back as calls of the offered functions."""

from __future__ import annotations

import ast
import asyncio
import copy
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken

from raylm.model.text.chat_template import render_chat_template
from raylm.model.text.tokenizer import Tokenizer
from raylm.router.errors import OpenAIError
from raylm.router.openai_service import OpenAIService
from raylm.router.protocol import RequestParser
from raylm.router.reasoning import ThoughtsStart
from raylm.router.reasoning_grammar import after_thoughts
from raylm.router.responses import ResponseBuilder
from raylm.router.tool_format_deepseek import MARKERS as DEEPSEEK_MARKERS
from raylm.router.tool_format_deepseek import DeepSeekFormat
from raylm.router.tool_format_pythonic import PythonicFormat
from raylm.router.tool_formats import MistralFormat
from raylm.router.tool_parsers import detect_tool_call_parser, tool_format
from raylm.router.tools import parse_tool_use
from raylm.workers.core.grammar import GrammarCompiler
from tests.fake_worker import FakeWorker, fake_settings, openai_client, token_chunks

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "unit": {"enum": ["C", "F"]}},
    "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris, and 1 + 2?"}]
_MESSAGES = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
             "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEMPLATES = {  # what each family's template says of tools (enough to be told apart), then the turns
    "hermes": "{% if tools %}<tools>{{ tools | tojson }}</tools> <tool_call></tool_call>{% endif %}" + _MESSAGES,
    "llama3_json": ('{% if tools %}{{ tools | tojson }} Respond in the format {"name": function name, '
                    '"parameters": dictionary of argument name and its value}.{% endif %}{# <|python_tag|> #}'
                    + _MESSAGES),
    "mistral": "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{# [TOOL_CALLS] #}"
               + _MESSAGES,
    "mistral_args": "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
                    "{# [TOOL_CALLS]name[ARGS]{...} #}" + _MESSAGES,
    "glm45": "{% if tools %}{{ tools | tojson }} <tool_call>{name}\n<arg_key>{k}</arg_key>\n<arg_value>{v}"
             "</arg_value></tool_call>{% endif %}" + _MESSAGES,
    "deepseek_v3": "{% if tools %}{{ tools | tojson }}{% endif %}{# <｜tool▁calls▁begin｜> ```json #}" + _MESSAGES,
    "deepseek_v31": "{% if tools %}{{ tools | tojson }}{% endif %}{# <｜tool▁calls▁begin｜> #}" + _MESSAGES,
    "pythonic": "{% if tools %}{{ tools | tojson }} [func_name1(param1=value1, param2=value2), func_name2(...)]"
                "{% endif %}{# <|python_start|> #}" + _MESSAGES,
    "pythonic_bare": "{% if tools %}{{ tools | tojson }} Use exact format: [func_name1(params_name1=params_value1, "
                     "params_name2=params_value2...), func_name2(params)]{% endif %}" + _MESSAGES,
    "qwen3_coder": "{% if tools %}{{ tools | tojson }} <tool_call>\n<function=f>\n<parameter=p>\nv\n</parameter>"
                   "\n</function>\n</tool_call>{% endif %}" + _MESSAGES,
}
# Llama 4's calls in JSON, as its official template writes them back (also a JSON list, or separated by ;).
PYTHONIC_JSON = ("pythonic_json", "pythonic_json_list", "pythonic_json_semicolon")
TEMPLATES.update({family: TEMPLATES["pythonic"] for family in PYTHONIC_JSON})
# Replies with parallel calls in each format, and the content before the calls.
REPLIES = {
    "hermes": ('Let me see.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "Let me see."),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "add", "parameters": {"a": 1, "b": 2}}', None),
    "mistral": ('Let me see.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2}}]', "Let me see."),
    "mistral_args": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', None),
    "glm45": ("Let me see.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
              "</tool_call>\n<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b</arg_key>\n"
              "<arg_value>2</arg_value>\n</tool_call>", "Let me see."),
    "deepseek_v3": ('Let me see.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
                    '{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n'
                    '{"a": 1, "b": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Let me see."),
    "deepseek_v31": ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
                     '<｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1, "b": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>', None),
    "pythonic": ('Let me see.<|python_start|>[get_weather(city="Paris"), add(a=1, b=2)]<|python_end|>', "Let me see."),
    "pythonic_bare": ("[get_weather(city='Paris'),\n add(a=1, b=2)]", None),
    "qwen3_coder": ("Let me see.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
                    "<parameter=b>\n2\n</parameter>\n</function>\n</tool_call>", "Let me see."),
    "pythonic_json": ('<|python_start|><|python_end|>{"name": "get_weather", "parameters": {"city": "Paris"}}'
                      '{"name": "add", "parameters": {"a": 1, "b": 2}}', None),
    "pythonic_json_list": ('Let me see.<|python_start|>[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                           '{"name": "add", "arguments": {"a": 1, "b": 2}}]<|python_end|>', "Let me see."),
    "pythonic_json_semicolon": ('<|python_start|>\n{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                                '{"name": "add", "parameters": {"a": 1, "b": 2}}<|python_end|>', None),
}
# Each reply made malformed (where the generic damage below does not touch it).
MALFORMED = {"glm45": ("</arg_value>", "", 1), "deepseek_v3": ("<｜tool▁calls▁end｜>", ""),
             "deepseek_v31": ("<｜tool▁calls▁end｜>", ""), "qwen3_coder": ("</parameter>", "", 1),
             "pythonic": ("a=1", "a=1,,"), "pythonic_bare": ("a=1", "1")}
EXPECTED = [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]


def _family_tokenizer(tokenizer: Tokenizer, family: str) -> Tokenizer:
    """The bundled tokenizer with the family's template and its markers as special tokens, as
    in those families' vocabularies."""
    out = copy.copy(tokenizer)
    out.backend = copy.deepcopy(tokenizer.backend)
    out.backend.add_special_tokens([AddedToken(t, special=True) for t in ("[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
                                                                          *DEEPSEEK_MARKERS, *PythonicFormat.markers)])
    out.chat_template = TEMPLATES[family]
    return out


@pytest.fixture(scope="module")
def tokenizers(tokenizer) -> dict[str, Tokenizer]:
    return {family: _family_tokenizer(tokenizer, family) for family in TEMPLATES}


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_the_format_follows_the_chat_template(tokenizers):
    assert [detect_tool_call_parser(TEMPLATES[f]) for f in TEMPLATES] == ["hermes", "llama3_json", "mistral",
                                                                          "mistral", "glm45", "deepseek_v3",
                                                                          "deepseek_v3", "pythonic", "pythonic",
                                                                          "qwen3_coder", "pythonic", "pythonic",
                                                                          "pythonic"]
    assert detect_tool_call_parser(None) == "hermes"
    assert not tool_format("auto", tokenizers["mistral"]).args_form
    assert tool_format("auto", tokenizers["mistral_args"]).args_form
    assert tool_format("auto", tokenizers["deepseek_v3"]).fenced and not tool_format("auto",
                                                                                     tokenizers["deepseek_v31"]).fenced


@pytest.mark.parametrize("family", list(REPLIES))
def test_replies_are_read_back_and_malformed_calls_stay_content(family, tokenizers):
    fmt = tool_format("auto", tokenizers[family])
    use = parse_tool_use({"tools": [WEATHER, ADD]})
    reply, content = REPLIES[family]
    got_content, calls = fmt.parse(reply, use)
    assert got_content == content and _calls(calls) == EXPECTED
    assert all(c["type"] == "function" and c["id"] for c in calls)
    if fmt.name == "mistral":  # the only ids Mistral's templates take back: 9 letters and digits
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    cut = [] if family == "hermes" else [reply[:-3]]  # Hermes keeps the calls complete before a cut one
    malformed = reply.replace(*MALFORMED.get(family, ('"a": 1', '"a": 1,,')))
    assert malformed != reply
    for bad in ("Just text.", reply.replace("get_weather", "launch"), malformed, *cut):
        assert fmt.parse(bad, use) == (bad, [])


def test_llama3_calls_after_the_python_tag(tokenizer):
    fmt = tool_format("llama3_json", tokenizer)
    use = parse_tool_use({"tools": [WEATHER, ADD]})
    content, calls = fmt.parse('Checking.<|python_tag|>{"name": "add", "arguments": {"a": 1, "b": 2}}', use)
    assert content == "Checking." and _calls(calls) == [("add", {"a": 1, "b": 2})]
    assert [fmt.held_back(t) for t in ("Paris is", "Paris <|pyth", " {", "")] == [8, 6, 1, 0]
    # Arguments written as a JSON string (as Llama templates write OpenAI's arguments text back):
    # their text, sent once the string closes, so the streamed pieces still join into it.
    reply = '{"name": "add", "parameters": " {\\"a\\": 1, \\"b\\": 2}"}'
    (call,) = fmt.parse(reply, use)[1]
    assert call["function"]["arguments"] == '{"a": 1, "b": 2}'
    for cut in range(len(reply) + 1):
        stream = fmt.stream(use)
        assert _raw(stream.deltas(reply[:cut], False) + stream.deltas(reply, True)) == ['{"a": 1, "b": 2}'], cut


def _stream(builder: ResponseBuilder, tokenizer: Tokenizer, pieces: list[str]) -> tuple[str, list[dict], str]:
    """Content, tool_calls entries and the last finish_reason a stream sends for ``pieces``."""
    from raylm.workers.wire.replica_protocol import ChoiceDelta, GenerateChunk

    chunks = [GenerateChunk("r", [ChoiceDelta(0, p, [1], None, "stop" if i == len(pieces) - 1 else None)], 3, 0,
                            i == len(pieces) - 1) for i, p in enumerate(pieces)]
    deltas = [d for c in chunks for i, delta in builder.add(0, c) if (d := builder.stream_delta(i, delta))]
    content = "".join(d["choices"][0]["delta"].get("content", "") for d in deltas)
    entries = [t for d in deltas for t in d["choices"][0]["delta"].get("tool_calls", [])]
    return content, entries, deltas[-1]["choices"][0]["finish_reason"]


def _raw(entries: list[dict]) -> list[str]:
    calls: dict[int, str] = {}
    for t in entries:
        calls[t["index"]] = calls.get(t["index"], "") + t["function"].get("arguments", "")
    return [arguments for _, arguments in sorted(calls.items())]


@pytest.mark.parametrize("family, first_call_end", [("hermes", "</tool_call>"), ("mistral_args", "[TOOL_CALLS]add"),
                                                    ("llama3_json", "}};"),
                                                    ("deepseek_v3", "<｜tool▁call▁end｜>"),
                                                    ("deepseek_v31", "<｜tool▁call▁end｜>"),
                                                    ("pythonic_json", '{"name": "add"'),
                                                    ("pythonic_json_list", ', {"name": "add"')])
def test_name_first_formats_stream_a_call_before_it_ends(family, first_call_end, tokenizers):
    """The name as soon as it is written, then the arguments as they grow (OpenAI's shape)."""
    parser = RequestParser(tokenizers[family], ["m"], 4096)
    parsed = parser.parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER, ADD]})
    reply = REPLIES[family][0]
    builder = ResponseBuilder(parsed, "id", 0, parser.tokenizer)
    opened = reply[: reply.index("Paris") + 2]  # inside the first call's arguments
    _, entries, _ = _stream(builder, parser.tokenizer, [opened, reply[len(opened): reply.index(first_call_end)], ""])
    assert entries[0]["function"] == {"name": "get_weather", "arguments": ""} and entries[0]["id"]
    assert entries[1] == {"index": 0, "function": {"arguments": '{"city": "Pa'}}


def _joined(entries: list[dict]) -> list[tuple[str, dict]]:
    calls: dict[int, dict[str, str]] = {}
    for t in entries:
        call = calls.setdefault(t["index"], {"name": "", "arguments": ""})
        call["name"] += t.get("function", {}).get("name", "")
        call["arguments"] += t["function"].get("arguments", "")
    return [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("family", list(REPLIES))
def test_streamed_at_every_split_the_calls_join_into_the_whole_reply_s(family, tokenizers):
    parser = RequestParser(tokenizers[family], ["m"], 4096)
    parsed = parser.parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER, ADD]})
    reply, content = REPLIES[family]
    whole = [c["function"]["arguments"] for c in parsed.tool_format.parse(reply, parsed.tool_use)[1]]
    for cut in range(len(reply) + 1):
        sent, entries, finish = _stream(ResponseBuilder(parsed, "id", 0, parser.tokenizer), parser.tokenizer,
                                        [reply[:cut], reply[cut:]])
        assert finish == "tool_calls" and _joined(entries) == EXPECTED, cut
        assert _raw(entries) == whole, cut  # the pieces join into the non-streamed reply's arguments text
        assert sent.strip() == (content or ""), cut
    plain = "Paris is sunny {not a call"
    sent, entries, finish = _stream(ResponseBuilder(parsed, "id", 0, parser.tokenizer), parser.tokenizer, [plain])
    assert (sent, entries, finish) == (plain, [], "stop")


def _service(tokenizer: Tokenizer, reply: str) -> OpenAIService:
    service = OpenAIService(FakeWorker(token_chunks(tokenizer, reply)), fake_settings(), tokenizer)
    service.admission.set_capacity(4)
    return service


@pytest.mark.parametrize("family", list(REPLIES))
def test_the_openai_client_gets_parallel_calls_whole_and_streamed(family, tokenizers):
    reply, content = REPLIES[family]
    service = _service(tokenizers[family], reply)

    async def both():
        client = openai_client(service)
        kwargs = dict(model="m", messages=ASK, tools=[WEATHER, ADD])
        return await client.chat.completions.create(**kwargs), [c async for c in await client.chat.completions.create(
            **kwargs, stream=True)]

    whole, chunks = asyncio.run(both())
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == EXPECTED
    entries = [t.model_dump(exclude_none=True) for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert _joined(entries) == EXPECTED and all("id" in t and t["type"] == "function" for t in entries
                                                if "name" in t.get("function", {}))
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    if family.startswith(("mistral", "deepseek", "pythonic")):  # markers that are special tokens: the worker keeps them
        assert service.worker.requests[0].params.skip_special_tokens is False


def _forced_text(compiler: GrammarCompiler, tokenizer: Tokenizer, grammar, seed: int, prefer: int | None = None) -> str:
    """What a model writes under ``grammar``: here, at each step any token the grammar allows
    (not EOS; ``prefer`` often where allowed, as a model ends its thoughts), stopping at random
    once the text is complete."""
    rng = np.random.default_rng(seed)
    matcher = compiler.matcher(grammar)
    vocab, eos = tokenizer.vocab_size, sorted(tokenizer.eos_token_ids)
    ids: list[int] = []
    for _ in range(1000):
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                                               bitorder="little")[:vocab])
        allowed = np.setdiff1d(allowed, eos)
        if matcher.is_accepting() and (not len(allowed) or rng.random() < 0.4):
            break
        token = prefer if prefer in allowed and rng.random() < 0.3 else int(rng.choice(allowed))
        assert matcher.consume_token(token)
        ids.append(token)
    assert matcher.is_accepting(), tokenizer.decode(ids, skip_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("family", [f for f in REPLIES if f not in PYTHONIC_JSON])  # those share pythonic's grammar
def test_calls_forced_by_each_format_s_grammar_are_read_back(family, tokenizers):
    tokenizer = tokenizers[family]
    fmt = tool_format("auto", tokenizer)
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    required = parse_tool_use({"tools": [WEATHER, ADD], "tool_choice": "required"})
    named = parse_tool_use({"tools": [WEATHER, ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}})
    counts = []
    for seed in range(6):
        text = _forced_text(compiler, tokenizer, fmt.grammar(required), seed)
        content, calls = fmt.parse(text, required)
        assert calls and content is None, text
        assert all(name in ("get_weather", "add") and isinstance(args, dict) for name, args in _calls(calls))
        counts.append(len(calls))
        text = _forced_text(compiler, tokenizer, fmt.grammar(named), seed)
        assert [name for name, _ in _calls(fmt.parse(text, named)[1])] == ["add"], text
    assert max(counts) >= 2  # required with parallel calls allowed: several calls
    if isinstance(fmt, (MistralFormat, DeepSeekFormat)):  # the markers are forced as the special tokens themselves
        assert "<[" in fmt.grammar(required).spec
    assert fmt.grammar(parse_tool_use({"tools": [WEATHER]})) is None  # auto: free


def test_glm_values_are_text_for_strings_and_json_for_the_rest(tokenizer):
    use = parse_tool_use({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"}, "tags": {}}}}}]})
    fmt = tool_format("glm45", tokenizer)
    text = ('<tool_call>f\n<arg_key>code</arg_key>\n<arg_value>007</arg_value>\n<arg_key>n</arg_key>\n'
            '<arg_value>7</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>["a", 1]</arg_value>\n</tool_call>')
    assert _calls(fmt.parse(text, use)[1]) == [("f", {"code": "007", "n": 7, "tags": ["a", 1]})]
    assert fmt.parse("<tool_call>f<arg_key>n</arg_key><arg_value>1</arg_value></tool_call>", use)[1]  # no newlines
    assert fmt.parse(text + " trailing words", use)[1] == []  # text after the calls: not calls


def test_mistral_templates_get_call_ids_they_accept(tokenizers):
    """Mistral's templates refuse call ids other than 9 letters and digits: other servers' ids
    are replaced by ones derived from them, the same in the call and in its result."""
    fmt = tool_format("auto", tokenizers["mistral"])
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0123456789abcdef", "type": "function", "function": {"name": "add", "arguments": "{}"}},
        {"id": "a1b2c3d4e", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "content": "3", "tool_call_id": "call_0123456789abcdef"},
        {"role": "tool", "content": "4", "tool_call_id": "a1b2c3d4e"}]
    out = fmt.history(history)
    ids = [c["id"] for c in out[1]["tool_calls"]]
    assert ids[1] == "a1b2c3d4e" and len(ids[0]) == 9 and ids[0].isalnum()
    assert [m["tool_call_id"] for m in out[2:]] == ids and out[0] == ASK[0]
    assert tool_format("auto", tokenizers["hermes"]).history(history) == history


CODE = {"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "code": {"type": "string"}, "n": {"type": "integer"}, "tags": {"type": "array"}, "dry": {"type": "boolean"},
    "note": {}}, "required": ["code"]}}}


def _accepts(compiler: GrammarCompiler, tokenizer: Tokenizer, grammar, text: str) -> bool:
    matcher = compiler.matcher(grammar)
    return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) \
        and matcher.is_accepting()


def test_qwen3_coder_values_are_typed_by_the_schema_and_its_grammar_writes_them(tokenizer):
    """Strings (and untyped parameters, as vLLM reads them) as written, whatever they hold;
    other types as JSON, the text where it is not JSON."""
    fmt = tool_format("qwen3_coder", tokenizer)
    use = parse_tool_use({"tools": [CODE], "tool_choice": "required"})
    text = ("<tool_call>\n<function=edit>\n<parameter=code>\nif a < b:\n    return '007'\n</parameter>\n"
            "<parameter=n>\n7\n</parameter>\n<parameter=tags>\n[\"x\", 1]\n</parameter>\n"
            "<parameter=dry>\ntrue\n</parameter>\n<parameter=note>\n12\n</parameter>\n</function>\n</tool_call>")
    (call,) = fmt.parse(text, use)[1]
    assert json.loads(call["function"]["arguments"]) == {"code": "if a < b:\n    return '007'", "n": 7,
                                                         "tags": ["x", 1], "dry": True, "note": "12"}
    assert _calls(fmt.parse(text.replace("\n7\n", "\nseven\n"), use)[1])[0][1]["n"] == "seven"
    assert fmt.parse(text.replace("<parameter=dry>", "<parameter=n>"), use)[1] == []  # a repeated parameter
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    assert _accepts(compiler, tokenizer, fmt.grammar(use), text)
    assert not _accepts(compiler, tokenizer, fmt.grammar(use), text.replace("\n7\n", "\nseven\n"))
    grammar = fmt.grammar(use)
    assert not _accepts(compiler, tokenizer, grammar, text.replace("<parameter=code>\nif", "<parameter=n>\nif"))
    # After a thinking model's thoughts (their lazy text and the strings' own, one grammar).
    assert _accepts(compiler, tokenizer, after_thoughts(grammar, ThoughtsStart(False), True), f"<think>a<b</think>{text}")


@pytest.mark.parametrize("family, cut_after", [("qwen3_coder", "<parameter=a>\n1\n</parameter>"),
                                               ("pythonic", "a=1,"), ("pythonic_bare", "a=1,")])
def test_xml_and_pythonic_calls_stream_each_argument_once_its_value_ends(family, cut_after, tokenizers):
    """The name as soon as it is written, then the arguments' JSON growing an argument at a time."""
    parser = RequestParser(tokenizers[family], ["m"], 4096)
    parsed = parser.parse_chat({"model": "m", "messages": ASK, "tools": [WEATHER, ADD]})
    reply = REPLIES[family][0]
    cut = reply.index(cut_after) + len(cut_after)
    _, entries, _ = _stream(ResponseBuilder(parsed, "id", 0, parser.tokenizer), parser.tokenizer,
                            [reply[: reply.index("add") + 1], reply[reply.index("add") + 1: cut], ""])
    assert [e["function"].get("name") for e in entries if "id" in e] == ["get_weather", "add"]
    assert _raw(entries) == ['{"city": "Paris"}', '{"a": 1']  # add's b not written yet: its object still open


WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"}}, "required": ["path"]}}}
# A file's text with what JSON escapes, what may look like the closing tag, and a last newline of its own.
FILE_TEXT = 'def f(a="1"):\\\n\treturn a </para </parameter <parameter=x> \\n ünï 😀\n\n'
WRITE_REPLY = ("Writing.\n<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n"
               f"<parameter=content>\n{FILE_TEXT}\n</parameter>\n<parameter=mode>\n420\n</parameter>\n"
               "<parameter=note>\nnot in the schema: text\n</parameter>\n</function>\n</tool_call>")


def test_qwen3_coder_streams_a_string_value_as_it_is_written(tokenizers):
    """vLLM's way: a file's ``content`` piece by piece before its ``</parameter>`` comes, the
    layout newlines dropped, a possible closing tag held back; the pieces join into the whole
    reply's arguments at every split of the reply."""
    parser = RequestParser(tokenizers["qwen3_coder"], ["m"], 4096)
    parsed = parser.parse_chat({"model": "m", "messages": ASK, "tools": [WRITE]})
    expected = {"path": "a.py", "content": FILE_TEXT, "mode": 420, "note": "not in the schema: text"}
    (whole,) = [c["function"]["arguments"] for c in parsed.tool_format.parse(WRITE_REPLY, parsed.tool_use)[1]]
    assert json.loads(whole) == expected
    for cut in range(len(WRITE_REPLY) + 1):
        sent, entries, finish = _stream(ResponseBuilder(parsed, "id", 0, parser.tokenizer), parser.tokenizer,
                                        [WRITE_REPLY[:cut], WRITE_REPLY[cut:]])
        assert (sent, _raw(entries), finish) == ("Writing.\n", [whole], "tool_calls"), cut
    stream = parsed.tool_format.stream(parsed.tool_use)
    written = WRITE_REPLY.index(FILE_TEXT) + len(FILE_TEXT)  # all but the layout newline and the closing tag
    pieces = [e["function"]["arguments"] for i in range(written + 1) for e in stream.deltas(WRITE_REPLY[:i], False)]
    assert "".join(pieces) == '{"path": "a.py", "content": ' + json.dumps(FILE_TEXT[:-1], ensure_ascii=False)[:-1]
    assert len(pieces) > len(FILE_TEXT) // 2  # token by token (blanks wait for what follows them)
    assert "".join(e["function"]["arguments"] for e in stream.deltas(WRITE_REPLY, True)) == whole[len("".join(pieces)):]


def test_pythonic_values_are_python_literals_never_evaluated(tokenizer):
    fmt = tool_format("pythonic", tokenizer)
    use = parse_tool_use({"tools": [CODE, ADD]})
    content, calls = fmt.parse("[edit(code='x = \\'a\\'\\n', n=-7, tags=('a', [1.5, None]), dry=True, note=null), "
                               "add(a=1, b=2,)]", use)
    assert content is None and _calls(calls) == [("edit", {"code": "x = 'a'\n", "n": -7, "tags": ["a", [1.5, None]],
                                                           "dry": True, "note": None}), ("add", {"a": 1, "b": 2})]
    for bad in ("[add(a=__import__('os').getcwd(), b=2)]", "[add(1, 2)]", "[add(**{'a': 1})]", "[add(a=1, a=2)]",
                "[edit(code={1, 2})]", "[edit(n=float('nan'))]", "[launch(a=1)]", "[]", "Sure: [add(a=1, b=2)]",
                "[add(a=1, b=2)] and more", "[" * 500 + "]" * 500):
        assert fmt.parse(bad, use) == (bad, []), bad
    content, calls = fmt.parse('[edit(code="\\ud83d\\ude00 \\ud83d")]', use)  # JSON's escapes of an emoji
    assert _calls(calls) == [("edit", {"code": "\U0001f600 \ufffd"})]
    hyphen = {"type": "function", "function": {"name": "get-weather", "parameters": {"type": "object"}}}
    with pytest.raises(OpenAIError, match="not a Python identifier"):  # a name no pythonic call can have
        fmt.grammar(parse_tool_use({"tools": [hyphen], "tool_choice": "required"}))
    assert [fmt.held_back(t) for t in ("Paris is", "Paris <|python_st", " [add(", "a<|python_start|>[", " ")] == \
        [8, 6, 1, 1, 0]


def _llama4_template() -> str:
    """Llama 4's official chat template, as transformers ships it (read from its source, not
    imported: importing transformers' Llama 4 module takes seconds)."""
    source = Path(importlib.util.find_spec("transformers").origin).parent / "models/llama4/processing_llama4.py"
    return next(node.value.value for node in ast.parse(source.read_text()).body if isinstance(node, ast.Assign)
                and getattr(node.targets[0], "id", "") == "chat_template")


@pytest.mark.parametrize("as_text", [False, True])
def test_pythonic_reads_the_json_calls_llama4_s_template_writes(as_text, tokenizer):
    """What the official template makes of an assistant's calls (arguments as a mapping, or as
    OpenAI's JSON text, which it writes as a JSON string) reads back as those calls, whole and
    streamed at every split; JSON without ``<|python_start|>`` is text."""
    fmt = tool_format("pythonic", tokenizer)
    use = parse_tool_use({"tools": [WEATHER, ADD]})
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)
                                                               if as_text else arguments}}
             for i, (name, arguments) in enumerate(EXPECTED)]
    prompt = render_chat_template(_llama4_template(), [*ASK, {"role": "assistant", "content": "",
                                                              "tool_calls": calls}],
                                  add_generation_prompt=False, tools=[WEATHER, ADD])
    reply = prompt.split("<|header_start|>assistant<|header_end|>\n\n")[1].removesuffix("<|eot|>")
    assert reply.startswith('<|python_start|><|python_end|>{"name": "get_weather", "parameters": ')
    content, whole = fmt.parse(reply, use)
    assert content is None and _calls(whole) == EXPECTED
    for cut in range(len(reply) + 1):
        stream = fmt.stream(use)
        entries = stream.deltas(reply[:cut], False) + stream.deltas(reply, True)
        assert _joined(entries) == EXPECTED and _raw(entries) == [c["function"]["arguments"] for c in whole], cut
    json_call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    for text in (json_call, f"<|python_start|>[{json_call}, 3]", f"<|python_start|>{json_call} and more",
                 f"<|python_start|>{json_call.replace('add', 'launch')}", f"<|python_start|>[{json_call}]]"):
        assert fmt.parse(text, use) == (text, []), text
    assert [fmt.held_back(t) for t in ("{", f"Sure.<|python_start|>{json_call}")] == [1, 5]


def test_the_pythonic_grammar_writes_keywords_in_order_the_optional_ones_or_not(tokenizer):
    fmt = tool_format("pythonic", tokenizer)
    optional = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "boolean"}, "z": {"type": "string"}}, "required": ["y"]}}}
    use = parse_tool_use({"tools": [optional, WEATHER], "tool_choice": "required"})
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    written = ["[f(y=True)]", "[f(x=1, y=False)]", '[f(y=True, z="a b")]', '[f(x=1, y=True, z="")]',
               '[f(y=True), get_weather(city="Oslo", unit="C")]', '[get_weather(city="Paris")]']
    for text in written:
        assert _accepts(compiler, tokenizer, fmt.grammar(use), text), text
        assert fmt.parse(text, use)[1], text
    for text in ["[f()]", "[f(x=1)]", "[f(y=true)]", "[f(y=True, x=1)]", "[f(, y=True)]", '[get_weather(city="Rome")]']:
        assert not _accepts(compiler, tokenizer, fmt.grammar(use), text), text
