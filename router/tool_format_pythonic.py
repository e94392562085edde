"""Pythonic tool calls (Llama 4, Llama 3.2's small models, Gemma 3's tool templates; vLLM's
``pythonic`` / ``llama4_pythonic`` parsers): the reply is a Python list of calls,

    [get_weather(city="Paris"), add(a=1, b=2)]

optionally between ``<|python_start|>`` and ``<|python_end|>`` (Llama 4), with text before the
tag as content. Arguments are keywords whose values are Python literals, read with
``ast.literal_eval`` (never evaluated); JSON's ``true`` / ``false`` / ``null``, which models
trained on JSON write too, read as ``True`` / ``False`` / ``None``. A stream announces a call
once ``name(`` is written and grows its arguments' JSON one keyword at a time, as each value
ends (router/call_streams.py).

Llama 4's official template writes earlier calls back as JSON, ``<|python_start|><|python_end|>``
then ``{"name": ..., "parameters": ...}`` per call, so a model served with it may answer so. After
``<|python_start|>`` (never without it: a reply that merely begins with ``{`` is text) the calls
may be JSON objects: one, several (one after another or separated by ``;``) or a JSON list of
them, the ``<|python_end|>`` before or after them. Those stream as Llama 3's: the name, then the
arguments' text as it is written.
"""

from __future__ import annotations

import ast
import json
import keyword
import re
from typing import Any

from raylm.router.call_streams import PieceCallStream, object_text, value_text
from raylm.router.errors import invalid
from raylm.router.tool_formats import (
    Calls,
    CallStream,
    FormatBase,
    before_partial_marker,
    growing_json_calls,
    json_values,
    named_json_calls,
    new_call,
    repeats,
    with_layout,
)
from raylm.router.tools import ToolUse
from raylm.workers.core.grammar import StructuredOutput

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_CALL_HEAD = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")
_KEYWORD = re.compile(r"\s*([A-Za-z_]\w*)\s*=(?!=)")
_CALL_END = re.compile(r"\s*,?\s*\)")
_CALLS_SEPARATOR = re.compile(r"\s*,")
_JSON_NAMES = {"true": True, "false": False, "null": None}
_OPENING, _CLOSING = "([{", ")]}"
_PYTHON, _JSON = "python", "json"  # the forms calls take


class PythonicFormat(FormatBase):
    """Calls as a Python list (see the module docstring); the calls are the whole reply, or
    what follows ``<|python_start|>``."""

    name = "pythonic"
    markers = (PYTHON_START, PYTHON_END)

    def parse(self, text: str, tool_use: ToolUse) -> tuple[str | None, Calls]:
        start, body, form = _calls_text(text)
        body = body.rstrip()
        body = body[: -len(PYTHON_END)] if body.endswith(PYTHON_END) else body
        calls = _read_calls(body, tool_use) if form == _PYTHON else _json_calls(body, tool_use) if form == _JSON else []
        if not calls:
            return text, []
        return text[:start].strip() or None, calls

    def growing_calls(self, text: str) -> list[tuple[str, str, bool]]:
        """The calls whose name is written so far: (name, the arguments' JSON so far, whether
        the call is closed). A Python call's JSON grows a keyword at a time, as each value ends."""
        _, body, form = _calls_text(text)
        if form == _JSON:
            return growing_json_calls(body[1:], ",") if body.startswith("[") else growing_json_calls(body)
        if form != _PYTHON:
            return []
        out: list[tuple[str, str, bool]] = []
        at = 1  # after the list's [
        while head := _CALL_HEAD.match(body, at):
            arguments, at, closed = _growing_arguments(body, head.end())
            out.append((head.group(1), object_text(arguments, closed), closed))
            separator = _CALLS_SEPARATOR.match(body, at) if closed else None
            if separator is None:
                break
            at = separator.end()
        return out

    def held_back(self, text: str) -> int:
        start, _, _ = _calls_text(text)
        if start >= 0:
            return start
        return 0 if not text.strip() else before_partial_marker(text, PYTHON_START)

    def grammar(self, tool_use: ToolUse) -> StructuredOutput | None:
        """Calls as a Python list: keywords in the schema's order, the required ones always, a
        boolean as ``True`` / ``False``, ``None`` for null, any other value as JSON following its
        schema (which Python reads alike: a JSON string or number is a Python literal)."""
        if tool_use.choice == "auto":
            return None
        functions = tool_use.forced_functions
        rules = []
        for i, function in enumerate(functions):
            keywords = list(function["parameters"].get("properties", {}).items())
            for name in (function["name"], *(key for key, _ in keywords)):
                if not name.isidentifier() or keyword.iskeyword(name):
                    raise invalid(f"the pythonic tool call format cannot write {name!r} of function "
                                  f"{function['name']!r}: not a Python identifier, or a keyword"[:300], "tools")
            required = set(function["parameters"].get("required", []))
            for j, (key, schema) in enumerate(keywords):
                rules.append(f"f{i}k{j}: {json.dumps(key + '=')} {_value_grammar(schema)}")
            rules += _keyword_rules(f"f{i}", [key in required for key, _ in keywords])
            arguments = "" if not keywords else f"f{i}h0 " if required else f"f{i}h0? "
            rules.append(f"f{i}: {json.dumps(function['name'] + '(')} {arguments}\")\"")
        alternatives = " | ".join(f"f{i}" for i in range(len(functions)))
        repeat = ' (", " call)*' if repeats(tool_use) else ""
        return StructuredOutput("grammar", "\n".join([f'start: "[" call{repeat} "]"', f"call: {alternatives}",
                                                      *rules]))

    def stream(self, tool_use: ToolUse) -> CallStream:
        return PieceCallStream(self, tool_use, lambda: new_call("", "")["id"])


def _calls_text(text: str) -> tuple[int, str, str]:
    """Where the calls begin (-1: the reply is content), their text (from the list's ``[`` or
    the first JSON call's ``{``) and its form: ``_PYTHON``, ``_JSON`` (only after
    ``<|python_start|>``, where the official template's empty ``<|python_start|><|python_end|>``
    may come first) or "" (not told yet, or neither)."""
    tag = text.find(PYTHON_START)
    if tag < 0:
        stripped = text.lstrip()
        return (len(text) - len(stripped), stripped, _PYTHON) if stripped.startswith("[") else (-1, "", "")
    body = text[tag + len(PYTHON_START):].lstrip()
    body = body[len(PYTHON_END):].lstrip() if body.startswith(PYTHON_END) else body
    if body.startswith("{"):
        return tag, body, _JSON
    first = body[1:].lstrip()[:1] if body.startswith("[") else ""
    return tag, body, _JSON if first == "{" else _PYTHON if first else ""


def _json_calls(body: str, tool_use: ToolUse) -> Calls:
    """The calls of JSON objects written one after another, or of one JSON list of them."""
    values = json_values(body) or []
    if body.startswith("[") and len(values) == 1 and isinstance(values[0], list):
        return named_json_calls(values[0], growing_json_calls(body[1:], ","), tool_use)
    return named_json_calls(values, growing_json_calls(body), tool_use)


def _read_calls(body: str, tool_use: ToolUse) -> Calls:
    """The calls of a whole Python list of keyword calls of offered functions, else []."""
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    if not isinstance(tree, ast.List):
        return []
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in tool_use.names
                and not node.args and all(k.arg is not None for k in node.keywords)
                and len({k.arg for k in node.keywords}) == len(node.keywords)):
            return []
        try:
            arguments = [(str(k.arg), _literal(k.value)) for k in node.keywords]
            calls.append(new_call(node.func.id, object_text(arguments, closed=True)))
        except ValueError:
            return []
    return calls


def _literal(node: ast.expr) -> Any:
    """A keyword's value: a Python literal (JSON's true / false / null read as Python's), which
    JSON can write (ValueError otherwise)."""
    try:
        value = _paired(ast.literal_eval(_JsonNames().visit(node)))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError) as error:
        raise ValueError(f"not a literal: {error}") from error
    value_text(value)  # raises ValueError where JSON has no such value
    return value


def _paired(value: Any) -> Any:
    """``value`` with its strings' surrogate pairs as the characters they stand for (a JSON
    string, which the forcing grammar writes, escapes a character beyond the BMP as a pair;
    Python reads the pair as two surrogates); a lone surrogate, which UTF-8 cannot carry,
    becomes U+FFFD."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace") if any(
            "\ud800" <= ch <= "\udfff" for ch in value) else value
    if isinstance(value, (list, tuple)):
        return [_paired(v) for v in value]
    if isinstance(value, dict):
        return {_paired(k) if isinstance(k, str) else k: _paired(v) for k, v in value.items()}
    return value


class _JsonNames(ast.NodeTransformer):
    def visit_Name(self, node: ast.Name) -> ast.expr:
        return ast.Constant(_JSON_NAMES[node.id]) if node.id in _JSON_NAMES else node


def _growing_arguments(body: str, at: int) -> tuple[list[tuple[str, Any]], int, bool]:
    """The keywords of a call from ``at`` (after its ``(``) whose values have ended, where
    reading stopped, and whether the call's ``)`` came."""
    arguments: list[tuple[str, Any]] = []
    while True:
        end = _CALL_END.match(body, at)
        if end is not None:
            return arguments, end.end(), True
        keyword = _KEYWORD.match(body, at)
        value_end = _value_end(body, keyword.end()) if keyword else -1
        if keyword is None or value_end < 0 or keyword.group(1) in (k for k, _ in arguments):
            return arguments, at, False
        try:
            value = _literal(ast.parse(body[keyword.end():value_end].strip(), mode="eval").body)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            return arguments, at, False
        arguments.append((keyword.group(1), value))
        at = value_end + (body[value_end] == ",")


def _value_end(text: str, at: int) -> int:
    """Where the value starting at ``at`` ends: the ``,`` or ``)`` after it outside brackets and
    strings; -1 where the text so far does not tell."""
    depth, i = 0, at
    while i < len(text):
        ch = text[i]
        if ch in "'\"":
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            i += len(quote)
            while not text.startswith(quote, i):
                if i >= len(text):
                    return -1
                i += 2 if text[i] == "\\" else 1
            i += len(quote)
            continue
        if ch in _OPENING:
            depth += 1
        elif ch in _CLOSING:
            if depth == 0:
                return i if ch == ")" else -1
            depth -= 1
        elif ch == "," and depth == 0:
            return i
        i += 1
    return -1


def _value_grammar(schema: Any) -> str:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "boolean":
        return '("True" | "False")'
    if kind == "null":
        return '"None"'
    return f"%json {json.dumps(with_layout(schema if isinstance(schema, dict) else {}))}"


def _keyword_rules(prefix: str, required: list[bool]) -> list[str]:
    """Rules ``<prefix>h<j>``: the keywords from the j-th on, in order, when none was written
    before (the first written has no comma before it), each required one always; the keyword
    values are rules ``<prefix>k<j>``."""
    rules = []
    for j in range(len(required)):
        after = " ".join(f'", " {prefix}k{m}' if required[m] else f'(", " {prefix}k{m})?'
                         for m in range(j + 1, len(required)))
        first = f"{prefix}k{j} {after}".rstrip()
        skip = f" | {prefix}h{j + 1}" if not required[j] and j + 1 < len(required) else ""
        rules.append(f"{prefix}h{j}: {first}{skip}")
    return rules
