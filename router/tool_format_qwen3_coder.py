"""Qwen3-Coder's XML tool calls (vLLM's ``qwen3_coder`` parser): each call a block

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    ...
    </function>
    </tool_call>

A value is text, typed by the function's JSON schema as vLLM types it: a parameter the schema
gives a non-string type (integer, number, boolean, object, array, null) is read as JSON (the
text itself where it is not JSON); any other, strings and untyped ones, is the text as written
(one newline after the opening tag and one before the closing tag are layout). Calls follow
each other; a stream announces a call when its function's name is written and grows its
arguments' JSON (router/call_streams.py): a string value piece by piece as it is written (as
vLLM streams it: a long file's ``content`` arrives token by token), JSON-escaped, of which a
final piece that may still be the layout newline or the start of ``</parameter>`` is held back
until what follows tells; any other value whole once its ``</parameter>`` closes it."""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from raylm.router import tools
from raylm.router.call_streams import PieceCallStream, object_text, value_text
from raylm.router.tool_formats import (
    Calls,
    CallStream,
    TaggedCallsFormat,
    argument_rules,
    before_partial_marker,
    json_or_text,
    new_call,
    repeats,
    with_layout,
)
from raylm.router.tools import ToolUse
from raylm.workers.core.grammar import StructuredOutput

_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)
_PARAMETER_HEAD = re.compile(r"\s*<parameter=([^>\n]*)>")
FUNCTION_END, PARAMETER_END = "</function>", "</parameter>"
_JSON_TYPES = {"integer", "number", "boolean", "object", "array", "null"}
# A string value in the grammar: any text up to the first closing tag (lazy: the first one ends it).
_TEXT_RULE = "qwen_text"
_TEXT_VALUE = f"{_TEXT_RULE}[lazy]: /(?s:.*)\\n<\\/parameter>/"


class Qwen3CoderFormat(TaggedCallsFormat):
    """``literals``: ``<tool_call>`` / ``</tool_call>`` as grammar literals (the tokens
    themselves where the vocabulary has them, as Qwen's does)."""

    name = "qwen3_coder"
    markers = (tools.OPEN_TAG, tools.CLOSE_TAG)

    def _call(self, body: str, tool_use: ToolUse) -> dict[str, Any] | None:
        read = _read(body, tool_use)
        if read is None or read[0] not in tool_use.names or read[2].strip() != FUNCTION_END:
            return None
        name, arguments, _ = read
        return new_call(name, object_text(arguments, closed=True))

    def growing_calls(self, text: str, tool_use: ToolUse) -> list[tuple[str, str, bool]]:
        """The calls whose function's name is written so far: (name, the JSON of the parameters
        so far, whether the function is closed). A string parameter still open adds its value
        so far (its JSON string without the closing quote); the object's brace closes with the
        function."""
        out: list[tuple[str, str, bool]] = []
        at = text.find(tools.OPEN_TAG)
        while at >= 0:
            body_at = at + len(tools.OPEN_TAG)
            end = text.find(tools.CLOSE_TAG, body_at)
            read = _read(text[body_at:] if end < 0 else text[body_at:end], tool_use)
            if read is None:
                break
            name, arguments, rest = read
            closed = rest.lstrip().startswith(FUNCTION_END)
            growing = "" if closed else _open_string(rest, _properties(name, tool_use), arguments)
            out.append((name, object_text(arguments, closed) + (", " if arguments and growing else "") + growing,
                        closed))
            if not closed or end < 0:
                break
            at = text.find(tools.OPEN_TAG, end)
        return out

    def held_back(self, text: str) -> int:
        return tools.held_back(text)

    def grammar(self, tool_use: ToolUse) -> StructuredOutput | None:
        if tool_use.choice == "auto":
            return None
        functions = tool_use.forced_functions
        rules = []
        for i, function in enumerate(functions):
            arguments, sequence = argument_rules(
                i, function["parameters"], lambda key, schema: f"{json.dumps(f'<parameter={key}>' + chr(10))} "
                                                                f"{_value_grammar(schema)}")
            rules += arguments
            head = json.dumps(f"<function={function['name']}>\n")
            rules.append(f"f{i}: {head} {sequence} {json.dumps(FUNCTION_END)}")
        alternatives = " | ".join(f"f{i}" for i in range(len(functions)))
        repeat = ' ("\\n" call)*' if repeats(tool_use) else ""
        lines = [f"start: call{repeat}",
                 f'call: {self._literal[tools.OPEN_TAG]} "\\n" ({alternatives}) "\\n" {self._literal[tools.CLOSE_TAG]}',
                 *rules]
        if any(_TEXT_RULE in rule for rule in rules):
            lines.append(_TEXT_VALUE)
        return StructuredOutput("grammar", "\n".join(lines))

    def stream(self, tool_use: ToolUse) -> CallStream:
        return PieceCallStream(_WithTools(self, tool_use), tool_use, lambda: new_call("", "")["id"])


class _WithTools:
    """The format reading one request's calls (its tools' schemas type the values), as
    ``PieceCallStream`` asks for them."""

    def __init__(self, fmt: Qwen3CoderFormat, tool_use: ToolUse):
        self.fmt, self.tool_use = fmt, tool_use

    def growing_calls(self, text: str) -> list[tuple[str, str, bool]]:
        return self.fmt.growing_calls(text, self.tool_use)

    def parse(self, text: str, tool_use: ToolUse) -> tuple[str | None, Calls]:
        return self.fmt.parse(text, tool_use)


def _read(body: str, tool_use: ToolUse) -> tuple[str, list[tuple[str, Any]], str] | None:
    """A call block's function name, its parameters (in order, up to the first that is not
    closed or repeats one) and the text after them; None before the name is complete."""
    head = _FUNCTION.match(body)
    if head is None:
        return None
    name = head.group(1).strip()
    properties = _properties(name, tool_use)
    arguments: list[tuple[str, Any]] = []
    at = head.end()
    for match in _PARAMETER.finditer(body, at):
        key = match.group(1).strip()
        if match.start() != at or key in (k for k, _ in arguments):
            break
        arguments.append((key, _value(match.group(2), properties.get(key))))
        at = match.end()
    return name, arguments, body[at:]


def _properties(name: str, tool_use: ToolUse) -> Mapping[str, Any]:
    """The parameters' schemas of function ``name`` (none for a function not offered)."""
    function = next((f for f in tool_use.functions if f["name"] == name), None)
    return function["parameters"].get("properties", {}) if function else {}


def _open_string(rest: str, properties: Mapping[str, Any], arguments: list[tuple[str, Any]]) -> str:
    """``"key": "value so far`` for a parameter opened at the start of ``rest`` and not closed
    yet whose value is text (a string, untyped or unknown parameter); "" for any other (a JSON
    value goes out whole once closed). Of the value, the layout newline after the opening tag
    is dropped, and a final piece that may be the newline before ``</parameter>`` or the start
    of the tag is held back: what is sent is a prefix of the value the whole reply reads."""
    head = _PARAMETER_HEAD.match(rest)
    if head is None or PARAMETER_END in rest:
        return ""  # no parameter open here (or one _read refused: a repeated one)
    key = head.group(1).strip()
    if key in (k for k, _ in arguments) or _typed_as_json(properties.get(key)):
        return ""
    raw = rest[head.end():]
    raw = raw[1:] if raw.startswith("\n") else raw
    raw = raw[: min(before_partial_marker(raw, "\n" + PARAMETER_END), before_partial_marker(raw, PARAMETER_END))]
    return f"{value_text(key)}: {value_text(raw)[:-1]}"


def _value(raw: str, schema: Any) -> Any:
    """A parameter's value: its text without the layout newlines, read as JSON where the
    schema types it so (and it is JSON that JSON can write back)."""
    text = raw[1:] if raw.startswith("\n") else raw
    text = text[:-1] if text.endswith("\n") else text
    if not _typed_as_json(schema):
        return text
    value = json_or_text(text)
    try:
        value_text(value)
    except ValueError:  # NaN, Infinity
        return text
    return value


def _typed_as_json(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if isinstance(kind, list):
        return "string" not in kind and any(k in _JSON_TYPES for k in kind)
    if kind is not None:
        return kind in _JSON_TYPES
    return any(not isinstance(v, str) for v in schema.get("enum", []))


def _value_grammar(schema: Mapping[str, Any] | Any) -> str:
    """One parameter's value and closing tag: a string enum's values, a string as free text
    (up to the closing tag), anything else as JSON following its schema."""
    close = json.dumps("\n</parameter>\n")
    if _typed_as_json(schema):
        return f"%json {json.dumps(with_layout(dict(schema)))} {close}"
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if enum:
        return "(" + " | ".join(json.dumps(v) for v in enum) + f") {close}"
    return f'{_TEXT_RULE} "\\n"'
