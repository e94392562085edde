"""Reasoning-aware structured output: a thinking model's reply is free until its thoughts end
(the first ``</think>``), and only the answer after them must match the request's JSON schema,
choices or forced tool calls (as vLLM's reasoning-aware structured output does).

The request's constraint becomes one Lark grammar for llguidance: the thoughts as a lazy
lexeme (any text up to and including the first ``</think>``), then the answer's rules. Where
the reply begins outside the thoughts (Qwen3: the model opens ``<think>`` itself) the thoughts
are optional. Regexes and client grammars cannot be embedded safely (their syntax and rule
names are the client's): those stay refused while the model thinks.

A thinking budget (vLLM's ``thinking_token_budget``, Anthropic's ``budget_tokens``) is the
same grammar with the thoughts' rule limited to that many tokens (llguidance's ``max_tokens``):
at the limit the grammar forces ``</think>`` and the answer follows, free or constrained. It
needs ``</think>`` to be one token of the vocabulary (as in Qwen3's and DeepSeek-R1's).
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING

from raylm.model.text.tokenizer import Tokenizer
from raylm.router.errors import invalid
from raylm.router.reasoning import CLOSE, OPEN, ThoughtsStart
from raylm.router.tools import ToolUse
from raylm.workers.core.grammar import JSON_LAYOUT, StructuredOutput
from raylm.workers.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from raylm.router.tool_format_harmony import HarmonyFormat

_THOUGHTS = "raylm_thoughts"
_ANSWER = "raylm_answer"
_GAP = "raylm_gap"  # the blanks between the thoughts and the answer (bounded: small models loop on blanks)


def params_after_thoughts(params: SamplingParams, thoughts: ThoughtsStart | None, tool_use: ToolUse | None,
                          tokenizer: Tokenizer, budget: int | None = None,
                          harmony: "HarmonyFormat | None" = None) -> SamplingParams:
    """A chat request's params with its constraint (if any) moved past the thoughts (if any),
    and the thoughts held to ``budget`` tokens (if given). A harmony reply (``harmony``: the
    format, with the vocabulary's markers) keeps its special tokens (its channels' markers); its
    forced calls' grammar has the thoughts in it, and a JSON schema or choice applies to its
    final channel's message, after the thoughts (a regex or grammar from its first token)."""
    if budget is not None:
        _check_budget(budget, thoughts, tokenizer)
    forced_calls = tool_use is not None and tool_use.choice != "auto"  # then the grammar is raylm's own
    if thoughts is not None and thoughts.channels:
        params = dataclasses.replace(params, skip_special_tokens=False)
        output = params.structured_output
        if output is None or forced_calls or harmony is None or output.kind in ("regex", "grammar"):
            return params  # a client's regex or grammar cannot be embedded: it applies from the first token
        answer = harmony.final_answer_grammar(_answer_rules(output, False), _ANSWER)
        return dataclasses.replace(params, structured_output=answer)
    if thoughts is None or (params.structured_output is None and budget is None):
        return params
    tags = (_single_token(tokenizer, OPEN), _single_token(tokenizer, CLOSE))
    return dataclasses.replace(params, structured_output=after_thoughts(params.structured_output, thoughts,
                                                                        forced_calls, tags, budget))


def budget_enforceable(reasoning_parser: str, tokenizer: Tokenizer) -> bool:
    """Whether a thinking budget can hold this model's thoughts: they end with ``</think>`` as one
    token (not in harmony's channels)."""
    return reasoning_parser not in ("none", "harmony") and _single_token(tokenizer, CLOSE) is not None


def _check_budget(budget: int, thoughts: ThoughtsStart | None, tokenizer: Tokenizer) -> None:
    if budget < 1:
        raise invalid(f"thinking_token_budget must be a positive number of tokens, got {budget}",
                      "thinking_token_budget")
    if thoughts is None:
        raise invalid("thinking_token_budget: this request's reply has no thoughts (a model without a reasoning "
                      "parser, or thinking turned off)", "thinking_token_budget")
    if thoughts.channels or _single_token(tokenizer, CLOSE) is None:
        raise invalid(f"thinking_token_budget is not supported for this model: its thoughts do not end with "
                      f"{CLOSE} as one token of its vocabulary", "thinking_token_budget")


def _single_token(tokenizer: Tokenizer, text: str) -> int | None:
    token_id = tokenizer.token_to_id(text)
    return token_id if token_id is not None and tokenizer.encode(text, add_special_tokens=False) == [token_id] \
        else None


def after_thoughts(output: StructuredOutput | None, thoughts: ThoughtsStart, own_grammar: bool,
                   tag_ids: tuple[int | None, int | None] = (None, None), budget: int | None = None
                   ) -> StructuredOutput:
    """``output`` applied to the answer only (None: a free answer). ``own_grammar``: ``output``
    is a grammar raylm wrote (forced tool calls, whose ``start`` rule can be renamed); any other
    grammar, and regexes, are refused (400). ``tag_ids``: the ids of ``<think>`` and ``</think>``
    where each is one token of the vocabulary (Qwen3, DeepSeek-R1): llguidance gives an added
    token no text to match, so the grammar names it; where the tag is text, the thoughts end at
    its text. ``budget``: the most tokens the thoughts may take (needs ``</think>``'s id)."""
    answer = [f"{_ANSWER}: /(?s:.*)/"] if output is None else _answer_rules(output, own_grammar)
    open_id, close_id = tag_ids
    opening = json.dumps(OPEN) if open_id is None else f"<[{open_id}]>"
    if close_id is None:
        assert budget is None, "a thinking budget needs </think> as a token"
        rules = [f"{_THOUGHTS}[lazy]: /(?s:.*){_regex_literal(CLOSE)}/"]
        thoughts_then = f"{_THOUGHTS} {_GAP}?"
    else:  # free text cannot hold the token, so the thoughts end where it comes (or at the budget)
        limit = "" if budget is None else f"[max_tokens={budget}]"
        rules = [f"{_THOUGHTS}{limit}: /(?s:.*)/"]
        thoughts_then = f"{_THOUGHTS} <[{close_id}]> {_GAP}?"
    head = thoughts_then if thoughts.in_thoughts else f"({opening} {thoughts_then})?"
    rules = [f"start: {head} {_ANSWER}", *rules, f"{_GAP}: /[ \\t\\r\\n]{{1,8}}/"]
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
