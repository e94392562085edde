"""router/reasoning_grammar.py: a thinking model's thoughts are free, its answer follows the
request's constraint. The text checked: thoughts given (they mention JSON and calls), then
what a model writes under the grammar (any token it allows), split by the reasoning parser."""

from __future__ import annotations

import numpy as np
import pytest

from raylm.router.errors import OpenAIError
from raylm.router.reasoning import ThoughtsStart
from raylm.router.reasoning_grammar import after_thoughts
from raylm.router.tool_formats import HermesFormat
from raylm.router.tools import parse_tool_use
from raylm.workers.core.grammar import GrammarCompiler, StructuredOutput

THOUGHTS = 'Maybe {"a": "x"} or <tool_call> or no</think>\n\n'
SCHEMA = StructuredOutput.json_schema({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
                                       "required": ["a"], "additionalProperties": False})
USE = parse_tool_use({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"})


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def _written(compiler, tokenizer, grammar: StructuredOutput, prefix: str, seed: int = 0) -> str | None:
    """``prefix`` then random tokens the grammar allows until it may end; None when the grammar
    refuses ``prefix``."""
    matcher = compiler.matcher(grammar)
    ids = tokenizer.encode(prefix, add_special_tokens=False)
    if matcher.validate_tokens(ids) != len(ids):
        return None
    assert matcher.consume_tokens(ids)
    rng = np.random.default_rng(seed)
    for _ in range(200):
        if matcher.is_accepting():
            break
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                                               bitorder="little")[:tokenizer.vocab_size])
        token = int(rng.choice(np.setdiff1d(allowed, sorted(tokenizer.eos_token_ids))))
        assert matcher.consume_token(token)
        ids.append(token)
    assert matcher.is_accepting()
    return tokenizer.decode(ids)


@pytest.mark.parametrize("in_thoughts", [True, False])
def test_the_thoughts_are_free_and_the_answer_follows_the_schema(compiler, tokenizer, in_thoughts):
    grammar = after_thoughts(SCHEMA, ThoughtsStart(in_thoughts), own_grammar=False)
    prefix = THOUGHTS if in_thoughts else "<think>" + THOUGHTS
    for seed in range(3):
        text = _written(compiler, tokenizer, grammar, prefix, seed)
        split = ThoughtsStart(in_thoughts).splitter().feed(text, True)
        assert split.reasoning == THOUGHTS[: THOUGHTS.index("</think>")]
        assert split.content.startswith('{"a": ') and split.content.endswith("}")
    assert _written(compiler, tokenizer, grammar, prefix + "Sure: ") is None  # the answer is constrained
    if not in_thoughts:  # where the model opens the thoughts itself, it may also answer at once
        assert _written(compiler, tokenizer, grammar, '{"a": 1}') == '{"a": 1}'


def test_forced_calls_and_choices_come_after_the_thoughts(compiler, tokenizer):
    calls = after_thoughts(HermesFormat().grammar(USE), ThoughtsStart(True), own_grammar=True)
    text = _written(compiler, tokenizer, calls, THOUGHTS)
    answer = ThoughtsStart(True).splitter().feed(text, True).content
    assert [c["function"]["name"] for c in HermesFormat().parse(answer, USE)[1]] == ["f"]
    choice = after_thoughts(StructuredOutput.choice(["yes", "no"]), ThoughtsStart(True), own_grammar=False)
    assert _written(compiler, tokenizer, choice, THOUGHTS + "no") == THOUGHTS + "no"
    assert _written(compiler, tokenizer, choice, THOUGHTS + "maybe") is None


def test_single_token_tags_are_named_by_id(tokenizer):
    """llguidance gives an added token (Qwen3's </think>) no text to match: the grammar names it."""
    grammar = after_thoughts(SCHEMA, ThoughtsStart(False), own_grammar=False, tag_ids=(7, 8)).spec
    assert grammar.startswith("start: (<[7]> raylm_thoughts <[8]> raylm_gap?)? raylm_answer")


@pytest.mark.parametrize("output, param", [(StructuredOutput("regex", "[0-9]+"), "guided_regex"),
                                           (StructuredOutput("grammar", 'start: "x"'), "guided_grammar")])
def test_client_regexes_and_grammars_are_refused_while_thinking(output, param):
    with pytest.raises(OpenAIError) as err:
        after_thoughts(output, ThoughtsStart(True), own_grammar=False)
    assert err.value.status == 400 and err.value.param == param
