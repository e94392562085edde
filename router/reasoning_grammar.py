"""Reasoning-aware structured output: a thinking model's reply is free until its thoughts end
(the first ``</think>``), and only the answer after them must match the request's JSON schema,
choices or forced tool calls (as vLLM's reasoning-aware structured output does).

The request's constraint becomes one Lark grammar for llguidance: the thoughts as a lazy
lexeme (any text up to and including the first ``</think>``), then the answer's rules. Where
the reply begins outside the thoughts (Qwen3: the model opens ``<think>`` itself) the thoughts
are optional. Regexes and client grammars cannot be embedded safely (their syntax and rule
names are the client's): those stay refused while the model thinks.
"""

from __future__ import annotations

import dataclasses
import json

from raylm.router.errors import invalid
from raylm.router.reasoning import CLOSE, OPEN, ThoughtsStart
from raylm.workers.core.grammar import JSON_LAYOUT, StructuredOutput
from raylm.workers.core.sampling_params import SamplingParams

_THOUGHTS = "raylm_thoughts"
_ANSWER = "raylm_answer"
_GAP = "raylm_gap"  # the blanks between the thoughts and the answer (bounded: small models loop on blanks)


def params_after_thoughts(params: SamplingParams, thoughts: ThoughtsStart | None, own_grammar: bool
                          ) -> SamplingParams:
    """A chat request's params with its constraint (if any) moved past the thoughts (if any)."""
    if thoughts is None or params.structured_output is None:
        return params
    return dataclasses.replace(params, structured_output=after_thoughts(params.structured_output, thoughts,
                                                                        own_grammar))


def after_thoughts(output: StructuredOutput, thoughts: ThoughtsStart, own_grammar: bool) -> StructuredOutput:
    """``output`` applied to the answer only. ``own_grammar``: ``output`` is a grammar raylm
    wrote (forced tool calls, whose ``start`` rule can be renamed); any other grammar, and
    regexes, are refused (400)."""
    answer = _answer_rules(output, own_grammar)
    opening = json.dumps(OPEN)
    thoughts = f"{_THOUGHTS} {_GAP}?" if thoughts.in_thoughts else f"({opening} {_THOUGHTS} {_GAP}?)?"
    rules = [f"start: {thoughts} {_ANSWER}", f"{_THOUGHTS}[lazy]: /(?s:.*){_regex_literal(CLOSE)}/",
             f"{_GAP}: /[ \\t\\r\\n]{{1,8}}/"]
    return StructuredOutput("grammar", "\n".join([*rules, *answer]))


def _answer_rules(output: StructuredOutput, own_grammar: bool) -> list[str]:
    if output.kind == "json_object":
        return [f"{_ANSWER}: %json {json.dumps({'type': 'object', 'x-guidance': JSON_LAYOUT})}"]
    if output.kind == "json_schema":
        schema = json.loads(output.spec or "null")
        if not isinstance(schema, dict):
            raise invalid("a JSON schema for a thinking model's answer must be an object", "response_format")
        return [f"{_ANSWER}: %json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}"]
    if output.kind == "choice":
        return [f"{_ANSWER}: " + " | ".join(json.dumps(c) for c in json.loads(output.spec or "[]"))]
    if output.kind == "grammar" and own_grammar:
        lines = (output.spec or "").split("\n")
        assert lines[0].startswith("start:"), lines[0]
        return [f"{_ANSWER}:{lines[0][len('start:'):]}", *lines[1:]]
    raise invalid("guided_regex and guided_grammar cannot be combined with this reasoning model's thinking (they "
                  "would constrain the thoughts too): turn thinking off with chat_template_kwargs "
                  '{"enable_thinking": false}, or use a JSON schema or guided_choice',
                  "guided_regex" if output.kind == "regex" else "guided_grammar")


def _regex_literal(text: str) -> str:
    """``text`` matched literally inside a Lark ``/.../`` regex."""
    return "".join("\\" + ch if ch in r"\/.^$|?*+()[]{}" else ch for ch in text)
