"""GLM-4.5 / 4.6 tool calls: ``<tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n
</tool_call>``, a string value as plain text, any other as JSON (as GLM's template writes
them back)."""

from __future__ import annotations

import json
import re
from typing import Any

from raylm.router import tools
from raylm.router.tool_formats import (
    CallStream,
    TaggedCallsFormat,
    WholeCallStream,
    argument_rules,
    json_or_text,
    new_call,
    repeats,
    with_layout,
)
from raylm.router.tools import ToolUse
from raylm.workers.core.grammar import StructuredOutput

_GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_GLM_VALUE_TEXT = "/[^<]*/"  # a string value as plain text: anything up to the closing tag


class Glm45Format(TaggedCallsFormat):
    """GLM-4.5's ``<tool_call>`` blocks: the function's name on the first line, then each
    argument as an ``<arg_key>`` / ``<arg_value>`` pair (as GLM's template writes them back:
    strings as they are, other values as JSON). Parallel calls follow each other."""

    name = "glm45"
    markers = (tools.OPEN_TAG, tools.CLOSE_TAG, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

    def _call(self, body: str, tool_use: ToolUse) -> dict[str, Any] | None:
        body = body.lstrip()
        cut = min(i for i in (body.find("\n"), body.find("<arg_key>"), len(body)) if i >= 0)
        name, rest = body[:cut].strip(), body[cut:]
        function = next((f for f in tool_use.functions if f["name"] == name), None)
        if function is None:
            return None
        properties = function["parameters"].get("properties", {})
        arguments, at = {}, 0
        for match in _GLM_ARG.finditer(rest):
            if match.start() != at:
                return None
            key, value = match.group(1).strip(), match.group(2)
            arguments[key] = value if _is_text(properties.get(key)) else json_or_text(value)
            at = match.end()
        return new_call(function["name"], arguments) if not rest[at:].strip() else None

    def held_back(self, text: str) -> int:
        return tools.held_back(text)

    def grammar(self, tool_use: ToolUse) -> StructuredOutput | None:
        if tool_use.choice == "auto":
            return None
        functions = tool_use.forced_functions
        rules = []
        literal = self._literal

        def argument(key: str, schema: Any) -> str:
            return (f'{literal["<arg_key>"]} {json.dumps(key)} {literal["</arg_key>"]} "\\n" {literal["<arg_value>"]} '
                    f'{_glm_value(schema)} {literal["</arg_value>"]} "\\n"')

        for i, function in enumerate(functions):
            arguments, sequence = argument_rules(i, function["parameters"], argument)
            rules += arguments
            rules.append(f"f{i}: {json.dumps(function['name'] + chr(10))} {sequence}".rstrip())
        alternatives = " | ".join(f"f{i}" for i in range(len(functions)))
        repeat = ' ("\\n" call)*' if repeats(tool_use) else ""
        lines = [f"start: call{repeat}",
                 f"call: {self._literal[tools.OPEN_TAG]} ({alternatives}) {self._literal[tools.CLOSE_TAG]}", *rules]
        return StructuredOutput("grammar", "\n".join(lines))

    def stream(self, tool_use: ToolUse) -> CallStream:
        return WholeCallStream(self, tool_use)


def _glm_value(schema: Any) -> str:
    """The grammar of one GLM argument value: one of a string enum's values, a string as plain
    text, anything else as JSON following its schema."""
    if isinstance(schema, dict) and _is_text(schema) and schema.get("enum"):
        return "(" + " | ".join(json.dumps(v) for v in schema["enum"]) + ")"
    if _is_text(schema):
        return _GLM_VALUE_TEXT
    return f"%json {json.dumps(with_layout(schema if isinstance(schema, dict) else {}))}"


def _is_text(schema: Any) -> bool:
    """Whether an argument's schema makes it a string (written as plain text, not JSON)."""
    if not isinstance(schema, dict):
        return False
    if schema.get("type") == "string":
        return True
    return bool(schema.get("enum")) and all(isinstance(v, str) for v in schema["enum"])
