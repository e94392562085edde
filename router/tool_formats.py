"""Each model family's way of writing tool calls: reading a reply's calls back (whole and
while it streams) and the grammar that forces calls in that family's own format.

- ``hermes`` (Qwen2/2.5/3, NousResearch; router/tools.py): ``<tool_call>{"name", "arguments"}</tool_call>``.
- ``llama3_json`` (Llama 3.1-3.3): the reply is a JSON call ``{"name": ..., "parameters": {...}}``,
  possibly after ``<|python_tag|>``; parallel calls separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (v3 templates) or,
  in newer templates (those that know ``[ARGS]``), ``[TOOL_CALLS]name[ARGS]{...}`` per call.
- ``glm45`` (GLM-4.5 / 4.6, router/tool_format_glm.py) and ``deepseek_v3``
  (router/tool_format_deepseek.py) in modules of their own.

A format is chosen from the chat template unless the deploy file's ``model.tool_call_parser``
names one (router/tool_parsers.py). Every format answers the same questions
(``ToolFormat``), so the chat, Responses and Messages endpoints share them.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from typing import Any, Callable, Protocol

from raylm.router import tools
from raylm.router.call_streams import PieceCallStream
from raylm.router.tools import ToolCallStream, ToolUse
from raylm.workers.core.grammar import JSON_LAYOUT, StructuredOutput

PYTHON_TAG, TOOL_CALLS, ARGS = "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"
Calls = list[dict[str, Any]]


class CallStream(Protocol):
    """A streamed reply's ``tool_calls`` entries (see ``ToolCallStream``)."""

    def deltas(self, text: str, finished: bool) -> Calls: ...

    @property
    def called(self) -> bool: ...


class ToolFormat(Protocol):
    name: str
    markers: tuple[str, ...]  # the format's fixed tags (a vocabulary may have them as tokens)
    keep_special_tokens: bool  # whether a marker is a special token (then decoded text must keep them)

    def history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The validated messages as this family's template takes them."""

    def parse(self, text: str, tool_use: ToolUse) -> tuple[str | None, Calls]:
        """The reply's content (None when empty) and its calls; a reply whose calls are not
        well-formed calls of offered functions is all content."""

    def held_back(self, text: str) -> int:
        """Where streamed content must stop for now (before what is or may become a call)."""

    def grammar(self, tool_use: ToolUse) -> StructuredOutput | None:
        """For ``required`` / a named function: the grammar of calls in this format."""

    def stream(self, tool_use: ToolUse) -> CallStream:
        """The calls of one streamed reply, as OpenAI streams them."""


def new_call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    """An OpenAI tool call; ``arguments`` as the model wrote them (text) or a value."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}


def _function_rules(tool_use: ToolUse, arguments_key: str) -> tuple[str, list[str]]:
    """The alternatives of forced calls as ``{"name": const, <arguments_key>: schema}`` JSON."""
    functions = tool_use.forced_functions
    rules = []
    for i, function in enumerate(functions):
        schema = {"type": "object", "properties": {"name": {"const": function["name"]},
                                                   arguments_key: function["parameters"]},
                  "required": ["name", arguments_key], "additionalProperties": False, "x-guidance": JSON_LAYOUT}
        rules.append(f"f{i}: %json {json.dumps(schema)}")
    return " | ".join(f"f{i}" for i in range(len(functions))), rules


def argument_rules(i: int, parameters: dict[str, Any], body: Callable[[str, Any], str]) -> tuple[list[str], str]:
    """Function ``i``'s arguments as grammar rules ``f{i}a{j}`` in its schema's order (each rule
    ``body(key, schema)``), and their sequence, the ones its schema does not require optional:
    for the formats that write each argument in a block of its own (GLM-4.5, Qwen3-Coder)."""
    required = set(parameters.get("required", []))
    rules, parts = [], []
    for j, (key, schema) in enumerate(parameters.get("properties", {}).items()):
        rules.append(f"f{i}a{j}: {body(key, schema)}")
        parts.append(f"f{i}a{j}" if key in required else f"f{i}a{j}?")
    return rules, " ".join(parts)


def adjacent_calls(pattern: re.Pattern[str], text: str, start: int, end: int,
                   read: Callable[[str], dict[str, Any] | None]) -> Calls:
    """The calls ``read`` makes of each ``pattern`` match's first group in ``text[start:end]``
    when the matches fill that span with nothing but blanks around them and every one reads as
    a call; else [] (the reply is then plain content, not calls). Formats whose calls are
    delimited blocks one after another (GLM-4.5's, DeepSeek's) parse with it."""
    calls, at = [], start
    for match in pattern.finditer(text, start, end):
        call = read(match.group(1))
        if call is None or text[at:match.start()].strip():
            return []
        calls.append(call)
        at = match.end()
    return calls if calls and not text[at:end].strip() else []


def repeats(tool_use: ToolUse) -> bool:
    return tool_use.parallel and tool_use.choice == "required"


def json_values(text: str) -> list[Any] | None:
    """The JSON values ``text`` holds one after another (separated by whitespace or ``;``),
    or None when it holds anything else."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or (values and text[at] == ";")):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values.append(value)


def json_or_text(value: str) -> Any:
    """A value written as text by formats that write strings bare (GLM's, Qwen3-Coder's): its
    JSON where it reads as JSON, else the text."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _call_of(value: Any, tool_use: ToolUse, keys: tuple[str, ...], make_id: Callable[[], str] | None = None
             ) -> dict[str, Any] | None:
    """A call from ``{"name": ..., <one of keys>: {...}}`` naming an offered function, else None."""
    if not isinstance(value, dict) or value.get("name") not in tool_use.names:
        return None
    arguments = next((value[k] for k in keys if k in value), {})
    if isinstance(arguments, str):  # some write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return new_call(value["name"], arguments, make_id() if make_id else None)


# A JSON call written name first, up to where its arguments' text begins.
_JSON_CALL_HEADER = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:parameters|arguments)"\s*:\s*')


def named_json_calls(values: list[Any], written: list[tuple[str, str, bool]], tool_use: ToolUse) -> Calls:
    """The calls of JSON objects ``{"name": ..., "parameters" (or "arguments"): {...}}`` (Llama
    3's calls, Llama 4's JSON ones), [] unless every value is one; each call's arguments as
    ``written`` (``growing_json_calls`` of the same text) where they read as the same JSON, so
    the whole reply's arguments are what a stream sent piece by piece."""
    calls = [call for v in values if (call := _call_of(v, tool_use, ("parameters", "arguments"))) is not None]
    if not calls or len(calls) < len(values):
        return []
    for call, (_, arguments, _) in zip(calls, written):
        try:
            if json.loads(arguments) == json.loads(call["function"]["arguments"]):
                call["function"]["arguments"] = arguments
        except json.JSONDecodeError:
            pass
    return calls


def growing_json_calls(body: str, separators: str = ";") -> list[tuple[str, str, bool]]:
    """The JSON calls written name first in ``body`` so far, one after another (blanks or one of
    ``separators`` between two): (name, the arguments' text so far, whether the call closed).
    Arguments written as a JSON string (``"parameters": "{...}"``, as Llama 4's template writes
    OpenAI's arguments text back) are their text once the string closes, nothing before."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(body) and (body[at].isspace() or (out and body[at] in separators)):
            at += 1
        header = _JSON_CALL_HEADER.match(body, at)
        if header is None:
            return out
        quoted = body.startswith('"', header.end())
        try:
            _, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return out + [(header.group(1), "" if quoted else body[header.end():], False)]
        arguments = body[header.end():end - 1].rstrip()  # without the call's }
        out.append((header.group(1), _string_text(arguments) if quoted else arguments, True))
        at = end


def _string_text(written: str) -> str:
    """The text of a JSON string as written, without blanks around it (what was written where
    it is more than one string)."""
    try:
        text = json.loads(written)
    except json.JSONDecodeError:
        return written
    return text.strip() if isinstance(text, str) else written


def before_partial_marker(text: str, marker: str) -> int:
    """The length of ``text`` without a final piece that may be the start of ``marker``."""
    return tools._before_partial_tag(text, marker)


class FormatBase:
    """What most formats share: special tokens dropped from text unless a marker is one (set by
    router/tool_parsers.py), the conversation's history as the template takes it."""

    keep_special_tokens = False

    def history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The validated messages as this family's template takes them."""
        return messages


_TAGGED_CALL = re.compile(re.escape(tools.OPEN_TAG) + "(.*?)" + re.escape(tools.CLOSE_TAG), re.DOTALL)


class TaggedCallsFormat(FormatBase):
    """Formats whose calls are ``<tool_call>`` blocks one after another, each body read by
    ``_call`` (GLM-4.5's, Qwen3-Coder's); text before the first is content. ``literals``: each
    marker as a grammar literal (the token itself where the vocabulary has it)."""

    markers: tuple[str, ...] = (tools.OPEN_TAG, tools.CLOSE_TAG)

    def __init__(self, literals: dict[str, str] | None = None):
        self._literal = literals or {m: json.dumps(m) for m in self.markers}

    def parse(self, text: str, tool_use: ToolUse) -> tuple[str | None, Calls]:
        start = text.find(tools.OPEN_TAG)
        if start < 0:
            return text, []
        calls = adjacent_calls(_TAGGED_CALL, text, start, len(text), lambda body: self._call(body, tool_use))
        if not calls:
            return text, []
        return text[:start].strip() or None, calls

    def _call(self, body: str, tool_use: ToolUse) -> dict[str, Any] | None:
        """One block's call, or None: the reply is then content."""
        raise NotImplementedError


class HermesFormat(FormatBase):
    """Hermes' ``<tool_call>`` blocks (router/tools.py), streamed argument piece by piece.
    ``literals``: each tag as a grammar literal (see ``DeepSeekFormat``)."""

    name = "hermes"
    markers = (tools.OPEN_TAG, tools.CLOSE_TAG)

    def __init__(self, literals: dict[str, str] | None = None):
        self._literal = literals or {m: json.dumps(m) for m in self.markers}

    def parse(self, text: str, tool_use: ToolUse) -> tuple[str | None, Calls]:
        return tools.parse_tool_calls(text, tool_use)

    def held_back(self, text: str) -> int:
        return tools.held_back(text)

    def grammar(self, tool_use: ToolUse) -> StructuredOutput | None:
        return tools.forced_calls_grammar(tool_use, self._literal[tools.OPEN_TAG], self._literal[tools.CLOSE_TAG])

    def stream(self, tool_use: ToolUse) -> CallStream:
        return ToolCallStream(tool_use)


class WholeCallStream:
    """Calls streamed whole: each call's index, id, type, name and complete arguments in one
    ``tool_calls`` entry once the reply ends (a client joins them as it joins pieces). For the
    formats whose calls cannot be told apart from plain JSON text before the reply ends."""

    def __init__(self, fmt: ToolFormat, tool_use: ToolUse):
        self.fmt, self.tool_use = fmt, tool_use
        self._count = 0

    def deltas(self, text: str, finished: bool) -> Calls:
        if not finished:
            return []
        _, calls = self.fmt.parse(text, self.tool_use)
        self._count = len(calls)
        return [{"index": i, **call} for i, call in enumerate(calls)]

    @property
    def called(self) -> bool:
        return self._count > 0


class Llama3JsonFormat(FormatBase):
    """Llama 3.x's JSON calls: the reply (after ``<|python_tag|>``, if written) is
    ``{"name": ..., "parameters": {...}}``, parallel calls joined by ``;``."""

    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def _start(self, text: str) -> int:
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            return tag
        return len(text) - len(text.lstrip()) if text.lstrip().startswith("{") else -1

    def parse(self, text: str, tool_use: ToolUse) -> tuple[str | None, Calls]:
        start = self._start(text)
        if start < 0:
            return text, []
        calls = named_json_calls(json_values(self._body(text, start)) or [], self.growing_calls(text), tool_use)
        if not calls:
            return text, []
        return text[:start].strip() or None, calls

    @staticmethod
    def _body(text: str, start: int) -> str:
        body = text[start:].strip()
        return body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body

    def growing_calls(self, text: str) -> list[tuple[str, str, bool]]:
        """The calls written name first so far: (name, arguments text so far, closed)."""
        start = self._start(text)
        return growing_json_calls(self._body(text, start)) if start >= 0 else []

    def held_back(self, text: str) -> int:
        start = self._start(text)
        if start >= 0:
            return start
        if not text.strip():
            return 0  # the reply may still begin with a call
        return before_partial_marker(text, PYTHON_TAG)

    def grammar(self, tool_use: ToolUse) -> StructuredOutput | None:
        if tool_use.choice == "auto":
            return None
        alternatives, rules = _function_rules(tool_use, "parameters")
        repeat = ' ("; " call)*' if repeats(tool_use) else ""
        return StructuredOutput("grammar", "\n".join([f"start: call{repeat}", f"call: {alternatives}", *rules]))

    def stream(self, tool_use: ToolUse) -> CallStream:
        return PieceCallStream(self, tool_use, lambda: new_call("", "")["id"])


class MistralFormat(FormatBase):
    """Mistral's ``[TOOL_CALLS]``: a JSON array of ``{"name", "arguments"}``, or (templates that
    know ``[ARGS]``) ``[TOOL_CALLS]name[ARGS]{...}`` for each call. Ids are 9 letters and digits,
    the only ids Mistral's templates accept back."""

    name = "mistral"
    markers = (TOOL_CALLS, ARGS)

    def __init__(self, args_form: bool, tool_calls_literal: str = json.dumps(TOOL_CALLS),
                 args_literal: str = json.dumps(ARGS)):
        self.args_form = args_form
        self._tool_calls, self._args = tool_calls_literal, args_literal

    def parse(self, text: str, tool_use: ToolUse) -> tuple[str | None, Calls]:
        start = text.find(TOOL_CALLS)
        if start < 0:
            return text, []
        calls: list[dict[str, Any] | None] = []
        body = text[start + len(TOOL_CALLS):]
        if body.lstrip().startswith("["):
            values = json_values(body)
            if values is None or len(values) != 1 or not isinstance(values[0], list):
                return text, []
            calls = [_call_of(v, tool_use, ("arguments", "parameters"), _mistral_id) for v in values[0]]
        else:
            for segment in body.split(TOOL_CALLS):
                name, sep, arguments = segment.partition(ARGS)
                values = json_values(arguments) if sep else None
                call = _call_of({"name": name.strip(), "arguments": values[0]}, tool_use, ("arguments",),
                                _mistral_id) if values is not None and len(values) == 1 else None
                if call is not None:  # the arguments as written (what a stream sends piece by piece)
                    call["function"]["arguments"] = arguments.strip()
                calls.append(call)
        if not calls or None in calls:
            return text, []
        return text[:start].strip() or None, calls

    def history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Call ids of 9 letters and digits, the only ones Mistral's templates accept (an id of
        another shape, as other servers give, is replaced by one derived from it, the same in
        the call and in its result)."""
        return [{**m, **({"tool_calls": [{**c, "id": _mistral_history_id(c["id"])} for c in m["tool_calls"]]}
                         if m.get("tool_calls") else {}),
                 **({"tool_call_id": _mistral_history_id(m["tool_call_id"])} if "tool_call_id" in m else {})}
                for m in messages]

    def held_back(self, text: str) -> int:
        start = text.find(TOOL_CALLS)
        return start if start >= 0 else before_partial_marker(text, TOOL_CALLS)

    def growing_calls(self, text: str) -> list[tuple[str, str, bool]]:
        """The ``name[ARGS]{...}`` calls written so far (the JSON-array form goes out whole)."""
        start = text.find(TOOL_CALLS)
        body = text[start + len(TOOL_CALLS):] if start >= 0 else ""
        if not body or body.lstrip().startswith("["):
            return []
        segments = body.split(TOOL_CALLS)
        out = []
        for i, segment in enumerate(segments):
            name, sep, arguments = segment.partition(ARGS)
            if not sep:
                break
            closed = i < len(segments) - 1
            out.append((name.strip(), arguments if closed else arguments[: before_partial_marker(arguments, TOOL_CALLS)],
                        closed))
        return out

    def grammar(self, tool_use: ToolUse) -> StructuredOutput | None:
        if tool_use.choice == "auto":
            return None
        if self.args_form:
            functions = tool_use.forced_functions
            rules = [f"f{i}: {json.dumps(f['name'])} {self._args} %json {json.dumps(with_layout(f['parameters']))}"
                     for i, f in enumerate(functions)]
            alternatives = " | ".join(f"f{i}" for i in range(len(functions)))
            repeat = " call*" if repeats(tool_use) else ""
            lines = [f"start: call{repeat}", f"call: {self._tool_calls} ({alternatives})", *rules]
        else:
            alternatives, rules = _function_rules(tool_use, "arguments")
            repeat = ' (", " call)*' if repeats(tool_use) else ""
            lines = [f'start: {self._tool_calls} "[" call{repeat} "]"', f"call: {alternatives}", *rules]
        return StructuredOutput("grammar", "\n".join(lines))

    def stream(self, tool_use: ToolUse) -> CallStream:
        return PieceCallStream(self, tool_use, _mistral_id)


def with_layout(parameters: dict[str, Any]) -> dict[str, Any]:
    return {**parameters, "x-guidance": JSON_LAYOUT}


def _mistral_history_id(call_id: str) -> str:
    if len(call_id) == 9 and call_id.isascii() and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _mistral_id() -> str:
    return uuid.uuid4().hex[:9]
