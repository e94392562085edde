"""DeepSeek's tool calls (V3, R1-0528, V3.1): the calls between ``<｜tool▁calls▁begin｜>`` and
``<｜tool▁calls▁end｜>``, each ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``. V3's templates
write ``function<｜tool▁sep｜>name`` and the arguments in a fenced JSON block; V3.1's write
``name<｜tool▁sep｜>`` and the arguments' JSON right after (the template tells which)."""

from __future__ import annotations

import json
import re
from typing import Any

from raylm.router.call_streams import PieceCallStream
from raylm.router.tool_formats import (
    Calls,
    CallStream,
    FormatBase,
    adjacent_calls,
    before_partial_marker,
    json_values,
    new_call,
    repeats,
    with_layout,
)
from raylm.router.tools import ToolUse
from raylm.workers.core.grammar import StructuredOutput

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
MARKERS = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
FENCE_OPEN, FENCE_CLOSE = "\n```json\n", "\n```"
_CALL = re.compile(re.escape(CALL_BEGIN) + "(.*?)" + re.escape(CALL_END), re.DOTALL)


class DeepSeekFormat(FormatBase):
    """``fenced``: V3's form (``function`` and a fenced JSON block) rather than V3.1's.
    ``literals``: each marker as a grammar literal (the special token itself where the
    vocabulary has it as one)."""

    name = "deepseek_v3"
    markers = MARKERS

    def __init__(self, fenced: bool, literals: dict[str, str] | None = None):
        self.fenced = fenced
        self._literal = literals or {m: json.dumps(m) for m in MARKERS}

    def parse(self, text: str, tool_use: ToolUse) -> tuple[str | None, Calls]:
        start = text.find(CALLS_BEGIN)
        body = text[start + len(CALLS_BEGIN):].rstrip()
        if start < 0 or not body.endswith(CALLS_END):
            return text, []
        body = body[: -len(CALLS_END)]
        calls = adjacent_calls(_CALL, body, 0, len(body), lambda inner: self._call(inner, tool_use))
        if not calls:
            return text, []
        return text[:start].strip() or None, calls

    def _call(self, inner: str, tool_use: ToolUse) -> dict[str, Any] | None:
        head, sep, rest = inner.partition(SEP)
        if not sep:
            return None
        if head.strip() == "function":  # V3: the name, then the arguments fenced
            name, _, rest = rest.partition("\n")
            rest = rest.strip()
            if not (rest.startswith("```json") and rest.endswith("```")):
                return None
            rest = rest[len("```json"):-len("```")]
        else:
            name = head
        values = json_values(rest)
        if values is None or len(values) != 1 or not isinstance(values[0], dict) or name.strip() not in tool_use.names:
            return None
        return new_call(name.strip(), rest.strip())  # as written: what a stream sends piece by piece

    def growing_calls(self, text: str) -> list[tuple[str, str, bool]]:
        """The calls written so far whose name is complete: (name, arguments so far, closed)."""
        start = text.find(CALLS_BEGIN)
        if start < 0:
            return []
        out = []
        for block in text[start + len(CALLS_BEGIN):].split(CALL_BEGIN)[1:]:
            inner, end, _ = block.partition(CALL_END)
            inner = inner if end else inner[: before_partial_marker(inner, CALL_END)]
            head, sep, rest = inner.partition(SEP)
            if not sep:
                break
            if head.strip() == "function":  # V3: name, newline, a fenced JSON block
                name, newline, rest = rest.partition("\n")
                fence = rest.lstrip()
                if not newline or not fence.startswith("```json"):
                    break
                rest = fence[len("```json"):]
                rest = rest.rstrip()[:-len("```")] if end and rest.rstrip().endswith("```") else rest
            else:
                name = head
            out.append((name.strip(), rest, bool(end)))
        return out

    def held_back(self, text: str) -> int:
        start = text.find(CALLS_BEGIN)
        return start if start >= 0 else before_partial_marker(text, CALLS_BEGIN)

    def grammar(self, tool_use: ToolUse) -> StructuredOutput | None:
        if tool_use.choice == "auto":
            return None
        functions = tool_use.forced_functions
        rules = []
        for i, function in enumerate(functions):
            arguments = f"%json {json.dumps(with_layout(function['parameters']))}"
            name = json.dumps(function["name"])
            rules.append(f"f{i}: {name} {json.dumps(FENCE_OPEN)} {arguments} {json.dumps(FENCE_CLOSE)}" if self.fenced
                         else f"f{i}: {name} {self._literal[SEP]} {arguments}")
        alternatives = " | ".join(f"f{i}" for i in range(len(functions)))
        head = f'"function" {self._literal[SEP]} ' if self.fenced else ""
        repeat = ' ("\\n"? call)*' if repeats(tool_use) else ""
        lines = [f"start: {self._literal[CALLS_BEGIN]} call{repeat} {self._literal[CALLS_END]}",
                 f"call: {self._literal[CALL_BEGIN]} {head}({alternatives}) {self._literal[CALL_END]}", *rules]
        return StructuredOutput("grammar", "\n".join(lines))

    def stream(self, tool_use: ToolUse) -> CallStream:
        return PieceCallStream(self, tool_use, lambda: new_call("", "")["id"])
