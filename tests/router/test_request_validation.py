"""Request validation without a server: every malformed body is a 400 naming its field.

Each case here was accepted (or crashed with a 500) before: a wrong type must be refused where
it is parsed, not fail later inside the tokenizer, the engine step or the response encoder.
"""

from __future__ import annotations

import json

import pytest

from raylm.router.errors import OpenAIError
from raylm.router.json_body import MAX_JSON_DEPTH, parse_json_body
from raylm.router.protocol import RequestParser
from raylm.workers.core.grammar import StructuredOutput
from raylm.workers.core.sampling_params import BeamSearchParams

MSG = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def parser(tokenizer):
    return RequestParser(tokenizer, ["m"], 512)


@pytest.mark.parametrize(
    "kind, body, param",
    [
        ("chat", {"messages": [{"role": ["user"], "content": "Hi"}]}, "messages[0].role"),
        ("chat", {"messages": [{"role": {"a": 1}, "content": "Hi"}]}, "messages[0].role"),
        ("chat", {"messages": [{"role": "user", "content": "Hi", "name": 7}]}, "messages[0].name"),
        ("chat", {"messages": MSG, "logit_bias": []}, "logit_bias"),
        ("chat", {"messages": MSG, "logit_bias": {"one": 5}}, "logit_bias"),
        ("chat", {"messages": MSG, "logit_bias": {"1": 101}}, "logit_bias"),
        ("chat", {"messages": MSG, "logit_bias": {"49152": 1}}, "logit_bias"),  # the vocabulary is 49152
        ("chat", {"messages": MSG, "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ("chat", {"messages": MSG, "response_format": {"type": "xml"}}, "response_format"),
        ("chat", {"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ("chat", {"messages": MSG, "guided_json": "{not json"}, "guided_json"),
        ("chat", {"messages": MSG, "guided_choice": []}, "guided_choice"),
        ("completion", {"prompt": "x", "guided_regex": ""}, "guided_regex"),
        ("completion", {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ("completion", {"prompt": "x", "structured_outputs": {"grammar": 5}}, "structured_outputs.grammar"),
        ("chat", {"messages": MSG, "response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ("completion", {"prompt": "x", "use_beam_search": True, "stop": ["."]}, "stop"),
        ("completion", {"prompt": "x", "use_beam_search": True, "logprobs": 2}, "logprobs"),
        ("completion", {"prompt": "x", "use_beam_search": True, "n": 11}, "n"),
        ("completion", {"prompt": "x", "length_penalty": 0.5}, "length_penalty"),
        ("chat", {"messages": MSG, "use_beam_search": True, "tools": [
            {"type": "function", "function": {"name": "f"}}]}, "use_beam_search"),
        ("embedding", {}, "input"),
        ("embedding", {"input": [{"text": "a"}]}, "input"),
        ("embedding", {"input": [[]]}, "input"),
        ("embedding", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ("embedding", {"input": "a", "dimensions": 8}, "dimensions"),
        ("embedding", {"input": "a", "temperature": 0}, "temperature"),
        ("chat", {"messages": MSG, "stream": True, "stream_options": {"include_usage": "maybe"}},
         "stream_options.include_usage"),
        ("chat", {"messages": MSG, "stop_token_ids": [10**12]}, "stop_token_ids"),
        ("chat", {"messages": MSG, "stop_token_ids": [True]}, "stop_token_ids"),
        ("chat", {"messages": MSG, "min_tokens": 10**12}, "min_tokens"),
        ("chat", {"messages": MSG, "top_k": 10**12}, "top_k"),
        ("completion", {"prompt": [[1], "a"]}, "prompt"),
        ("completion", {"prompt": ["a", [1]]}, "prompt"),
    ],
)
def test_malformed_fields_are_refused_by_name(parser, kind, body, param):
    parse = {"chat": parser.parse_chat, "completion": parser.parse_completion, "embedding": parser.parse_embedding}[kind]
    with pytest.raises(OpenAIError) as err:
        parse({"model": "m", **body})
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_structured_output_and_logit_bias_reach_the_sampling_params(parser):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    cases = [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}},
         StructuredOutput.json_schema(schema)),
        ({"guided_json": json.dumps(schema)}, StructuredOutput.json_schema(schema)),
        ({"guided_regex": "[ab]+"}, StructuredOutput("regex", "[ab]+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput.choice(["yes", "no"])),
        ({"guided_grammar": 'start: "a"'}, StructuredOutput("grammar", 'start: "a"')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
        ({"structured_outputs": {"choice": ["x"]}}, StructuredOutput.choice(["x"])),
    ]
    for extra, expected in cases:
        assert parser.parse_chat({"model": "m", "messages": MSG, **extra}).params.structured_output == expected, extra
        assert parser.parse_completion({"model": "m", "prompt": "x", **extra}).params.structured_output == expected
    params = parser.parse_chat({"model": "m", "messages": MSG, "logit_bias": {"5": -100, "17": 2.5}}).params
    assert params.logit_bias == {5: -100.0, 17: 2.5}


def test_beam_search_fields_reach_the_parsed_request(parser):
    parsed = parser.parse_completion({"model": "m", "prompt": "x", "n": 4, "max_tokens": 9, "use_beam_search": True,
                                      "length_penalty": 0.5, "ignore_eos": True})
    assert parsed.beam == BeamSearchParams(beam_width=4, max_tokens=9, ignore_eos=True, length_penalty=0.5)
    assert parser.parse_completion({"model": "m", "prompt": "x"}).beam is None
    chat = parser.parse_chat({"model": "m", "messages": MSG, "use_beam_search": True})
    assert chat.beam.max_tokens == 512 - len(chat.prompts[0])  # chat's default: the rest of the context


def test_completions_max_tokens_null_is_the_default_16(parser):
    assert parser.parse_completion({"model": "m", "prompt": "x", "max_tokens": None}).params.max_tokens == 16


def test_valid_unusual_fields_pass(parser):
    parsed = parser.parse_chat({"model": "m", "messages": [{"role": "user", "content": "¿qué? 😀", "name": "bob"}],
                                "logit_bias": {}, "user": "josé\u200b", "stop_token_ids": [2]})
    assert parsed.user == "josé\u200b" and parsed.params.stop_token_ids == [2]
    assert parser.parse_completion({"model": "m", "prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]


def test_a_text_prompt_without_tokens_starts_a_new_document(parser):
    """Hypothesis found "\x16": text the vocabulary has no piece for encodes to nothing; like
    an empty prompt it is served from the document start (BOS), as OpenAI serves "" prompts."""
    bos = parser.tokenizer.bos_token_id
    assert parser.parse_completion({"model": "m", "prompt": ["\x16", "", "hi"]}).prompts == [
        [bos], [bos], parser.tokenizer.encode("hi")]


@pytest.mark.parametrize(
    "raw, param",
    [
        (b"[" * 100_000 + b"]" * 100_000, None),
        (b'{"messages": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}", None),
        (b'{"model": "\\ud800"}', "model"),
        (b'{"prompt": ["ok", "\\udfff"]}', "prompt[1]"),
        (b'{"\\ud800": 1}', None),
        (b'{"temperature": NaN}', None),
        (b'{"temperature": Infinity}', None),
        (b'{"temperature": 1e999}', "temperature"),
        (b'{"a": "\xff"}', None),
        ('{"model": "m"}'.encode("utf-16"), None),  # JSON on the wire is UTF-8, whatever the BOM says
    ],
)
def test_hostile_json_is_a_400(raw, param):
    with pytest.raises(OpenAIError) as err:
        parse_json_body(raw)
    assert err.value.status == 400 and err.value.param == param
    json.dumps(err.value.body(), ensure_ascii=False).encode("utf-8")  # the error itself is encodable


def test_plain_json_passes_untouched():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "héllo 😀"}]}],
            "temperature": 0.5, "n": 2}
    assert parse_json_body(json.dumps(body).encode()) == body
