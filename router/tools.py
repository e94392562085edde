"""OpenAI tool calling on any model: which tools a request offers, how the prompt shows them and
the conversation's earlier calls, how ``tool_choice: required`` or a named function is
enforced, and how a reply's calls are read back.

The call format is Hermes' (Qwen2's and NousResearch's templates, the ``hermes`` parser of the
deploy file's ``model.tool_call_parser``): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n
</tool_call>``. A chat template that takes ``tools`` renders them itself; for one that does not
(SmolLM2's) the tools and the format are described in the system message, earlier calls are
shown in that format and tool results as ``<tool_response>`` user turns, as Qwen2's template
does. ``required`` and a named function are enforced with a grammar (structured output), so
they work with any model; ``auto`` lets the model choose and parses what it wrote.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Any, Mapping

from raylm.router.errors import invalid
from raylm.workers.core.grammar import JSON_LAYOUT, StructuredOutput

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
# A call written name-first, up to where its arguments' text begins.
_HEADER = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolUse:
    """The tools a request offers (OpenAI ``function`` objects) and its ``tool_choice``."""

    functions: tuple[Mapping[str, Any], ...]
    choice: str  # "auto", "required", or the name of the function that must be called
    parallel: bool = True

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]

    @property
    def forced_functions(self) -> list[Mapping[str, Any]]:
        """The functions a call may name under ``required`` (all) or a named choice (that one)."""
        return [f for f in self.functions if self.choice in ("required", f["name"])]


def parse_tool_use(body: Mapping[str, Any]) -> ToolUse | None:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat request; None when no tool
    may be called (no tools, or ``tool_choice: none``)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise invalid("tools must be a list of {'type': 'function', 'function': {...}}", "tools")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise invalid(f"{where} must be {{'type': 'function', 'function': {{'name': ..., ...}}}}", where)
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise invalid(f"{where}.function.name must be 1-64 letters, digits, _ or -", f"{where}.function.name")
        parameters = function.get("parameters", _NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise invalid(f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise invalid(f"{where}.function.description must be a string", f"{where}.function.description")
        functions.append({"name": name, "description": description or "", "parameters": parameters})
    if len({f["name"] for f in functions}) != len(functions):
        raise invalid("tools have duplicate function names", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if choice in (None, "auto", "required"):
        return ToolUse(tuple(functions), choice or "auto", parallel)
    if choice == "none":
        return None
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if named is None:
        raise invalid("tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
                      "tool_choice")
    if named not in {f["name"] for f in functions}:
        raise invalid(f"tool_choice names {named!r}, which is not one of the tools"[:300], "tool_choice")
    return ToolUse(tuple(functions), named, parallel)


# -- the prompt -----------------------------------------------------------------------------------------
def template_messages(messages: list[dict[str, Any]], tool_use: ToolUse | None,
                      template_takes_tools: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages (and extra template variables) for the chat template. A template that takes
    ``tools`` gets them and the structured history as HF templates expect it; any other gets
    the tools described in the system message and the history written out in Hermes' format."""
    if template_takes_tools:
        extra = {"tools": [{"type": "function", "function": dict(f)} for f in tool_use.functions]} if tool_use else {}
        return [_for_tool_template(m) for m in messages], extra
    out = [_as_text(m) for m in messages]
    if tool_use is not None:
        instructions = _tool_instructions(tool_use)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out, {}


def _tool_instructions(tool_use: ToolUse) -> str:
    signatures = "\n".join(json.dumps({"type": "function", "function": dict(f)}) for f in tool_use.functions)
    return (
        "You may call one or more functions to assist with the user query. The function signatures are "
        f"within <tools></tools> XML tags:\n<tools>\n{signatures}\n</tools>\n\nFor each function call, return a "
        "json object with the function name and arguments within <tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _call_text(call: Mapping[str, Any]) -> str:
    function = call["function"]
    return f'<tool_call>\n{json.dumps({"name": function["name"], "arguments": _arguments(function)})}\n</tool_call>'


def _arguments(function: Mapping[str, Any]) -> Any:
    """A call's arguments as a value (OpenAI sends them as JSON text)."""
    try:
        return json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError:
        return function.get("arguments")


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    thoughts = {"reasoning_content": message["reasoning_content"]} if "reasoning_content" in message else {}
    if message.get("tool_calls"):
        calls = "\n".join(_call_text(c) for c in message["tool_calls"])
        return {"role": "assistant", "content": f"{message['content']}\n{calls}" if message["content"] else calls,
                **thoughts}
    return {"role": message["role"], "content": message["content"], **thoughts}


def _for_tool_template(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = [{**c, "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"])}}
             for c in message["tool_calls"]]
    return {**message, "tool_calls": calls}


# -- enforcing required / a named function --------------------------------------------------------------
def forced_calls_grammar(tool_use: ToolUse, open_literal: str = '"<tool_call>"',
                         close_literal: str = '"</tool_call>"') -> StructuredOutput | None:
    """For ``required`` (any of the tools, several when parallel calls are allowed) or a named
    function (that one, once): a grammar of Hermes calls whose JSON follows each function's
    schema. None for ``auto``. The tags' grammar literals may name tokens (Qwen's vocabulary
    has them as tokens, router/tool_parsers.py)."""
    if tool_use.choice == "auto":
        return None
    functions = tool_use.forced_functions
    rules = []
    for i, function in enumerate(functions):
        schema = {"type": "object", "properties": {"name": {"const": function["name"]},
                                                   "arguments": function["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False, "x-guidance": JSON_LAYOUT}
        rules.append(f"f{i}: %json {json.dumps(schema)}")
    alternatives = " | ".join(f"f{i}" for i in range(len(functions)))
    repeat = ' ("\\n" call)*' if tool_use.parallel and tool_use.choice == "required" else ""
    call = f'call: {open_literal} "\\n" ({alternatives}) "\\n" {close_literal}'
    grammar = "\n".join([f"start: call{repeat}", call, *rules])
    return StructuredOutput("grammar", grammar)


# -- reading calls back -----------------------------------------------------------------------------------
def parse_tool_calls(text: str, tool_use: ToolUse) -> tuple[str | None, list[dict[str, Any]]]:
    """The reply's content (before the first call; None when empty) and its calls, OpenAI-shaped.
    A block that is not a JSON call of an offered function leaves the whole text as content."""
    start = text.find(OPEN_TAG)
    if start < 0:
        return text, []
    calls = []
    for body in _CALL.findall(text[start:]):
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(value, dict) or value.get("name") not in tool_use.names:
            return text, []
        arguments = value.get("arguments", value.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": value["name"], "arguments": _arguments_text(body, arguments)}})
    if not calls:
        return text, []
    content = text[:start].strip()
    return content or None, calls


def _arguments_text(body: str, arguments: Any) -> str:
    """A call's ``arguments`` string: the model's own text of them when the call is written
    name-first (what a stream sends piece by piece, see ``ToolCallStream``), else the JSON."""
    header = _HEADER.match(body)
    if header and body.endswith("}"):
        raw = body[header.end():-1].rstrip()
        try:
            if json.loads(raw) == arguments:
                return raw
        except json.JSONDecodeError:
            pass
    return json.dumps(arguments)


def held_back(text: str) -> int:
    """Where streamed content must stop for now: before a call (or what may become its tag)."""
    start = text.find(OPEN_TAG)
    return start if start >= 0 else _before_partial_tag(text, OPEN_TAG)


def _before_partial_tag(text: str, tag: str) -> int:
    """The length of ``text`` without a final piece that may be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return len(text) - size
    return len(text)


class ToolCallStream:
    """One streamed reply's tool calls as OpenAI sends them: a call's index, id and name as soon
    as its name is written, then its ``arguments`` text piece by piece as the model writes it.

    A call is announced only once its name is one of the offered functions; its arguments are
    the model's text up to the call's closing brace, of which the brace (and the whitespace
    around it) is held back until the call ends, so the pieces concatenate to what
    ``parse_tool_calls`` reports for the whole reply. Calls written another way (arguments
    first) go out whole when the reply ends. Once announced, a call stays one: if its JSON
    then turns out malformed (``auto`` only; forced calls follow a grammar), the client has
    what the model wrote, where the non-streamed reply would return the text as content."""

    def __init__(self, tool_use: ToolUse):
        self.tool_use = tool_use
        self._ids: list[str] = []  # announced calls' ids, by index
        self._sent: list[int] = []  # characters of each announced call's arguments sent

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The ``tool_calls`` entries to send now for the reply so far (``text``)."""
        out = self._growing(text)
        return out + self._final(text) if finished else out

    def _growing(self, text: str) -> list[dict[str, Any]]:
        """Announcements and argument pieces of the calls written so far."""
        start = text.find(OPEN_TAG)
        if start < 0:
            return []
        out = []
        for index, block in enumerate(text[start:].split(OPEN_TAG)[1:]):
            body, closed, _ = block.partition(CLOSE_TAG)
            body = body if closed else body[: _before_partial_tag(body, CLOSE_TAG)]
            body = body.lstrip()
            header = _HEADER.match(body)
            if not header or header.group(1) not in self.tool_use.names:
                break  # later calls wait for this one: indices stay in order
            if index == len(self._ids):
                self._ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self._sent.append(0)
                out.append({"index": index, "id": self._ids[index], "type": "function",
                            "function": {"name": header.group(1), "arguments": ""}})
            arguments = body[header.end():].rstrip()
            if arguments.endswith("}"):  # maybe the call's own closing brace
                arguments = arguments[:-1].rstrip()
            out += self._arguments(index, arguments)
        return out

    def _arguments(self, index: int, arguments: str) -> list[dict[str, Any]]:
        piece = arguments[self._sent[index]:]
        if not piece:
            return []
        self._sent[index] = len(arguments)
        return [{"index": index, "function": {"arguments": piece}}]

    def _final(self, text: str) -> list[dict[str, Any]]:
        """At the end: what the announced calls still lack, and any call not announced yet."""
        _, calls = parse_tool_calls(text, self.tool_use)
        out = []
        for index, call in enumerate(calls):
            if index < len(self._ids):
                out += self._arguments(index, call["function"]["arguments"])
            else:
                self._ids.append(call["id"])
                self._sent.append(len(call["function"]["arguments"]))
                out.append({"index": index, **call})
        return out

    @property
    def called(self) -> bool:
        """Whether the client has been told of a call (the reply then finishes with tool_calls
        and its content ends where the first call begins)."""
        return bool(self._ids)
