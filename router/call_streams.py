"""Streaming tool calls as OpenAI streams them for the formats that write a call's name before
its arguments' JSON (Mistral's ``name[ARGS]{...}``, DeepSeek's ``name<｜tool▁sep｜>{...}``):
each call's index, id, type and name as soon as the name is complete, then its ``arguments``
text piece by piece as the model writes it. (Hermes has its own: router/tools.py.) Formats
whose arguments are not JSON (Qwen3-Coder's XML parameters, Llama 4's Python keywords) grow
their arguments' JSON one argument at a time (``object_text``), Qwen3-Coder's text values
within theirs as they are written.

A format tells the calls written so far (``growing_calls``: name, arguments text so far, and
whether the call is closed). Of a call still open, trailing blanks and backticks are held back
(they may be the end of the call, or of a code fence around it), so every piece sent is part of
the arguments ``parse`` reports for the whole reply; at the end, what the pieces still lack is
sent, and calls never announced go out whole. Once announced, a call stays one (as Hermes'
stream; the non-streamed reply of a malformed call is all content)."""

from __future__ import annotations

import json
from typing import Any, Callable, Protocol

from raylm.router.tools import ToolUse

Calls = list[dict[str, Any]]


def value_text(value: Any) -> str:
    """An argument's JSON text (ValueError where JSON has no such value: NaN, a set, bytes, a
    string with a lone surrogate, which UTF-8 cannot carry to the client)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
        text.encode("utf-8")
    except (TypeError, UnicodeEncodeError) as error:
        raise ValueError(str(error)) from error
    return text


def object_text(arguments: list[tuple[str, Any]], closed: bool) -> str:
    """The arguments' JSON object as text, without its closing brace while the call is still
    being written: each argument added grows the text, and the closed text is exactly
    ``json.dumps`` of the whole object, so a stream's pieces join into the whole reply's."""
    return "{" + ", ".join(f"{value_text(key)}: {value_text(value)}" for key, value in arguments) + \
        ("}" if closed else "")


class GrowingFormat(Protocol):
    def growing_calls(self, text: str) -> list[tuple[str, str, bool]]: ...

    def parse(self, text: str, tool_use: ToolUse) -> tuple[str | None, Calls]: ...


class PieceCallStream:
    def __init__(self, fmt: GrowingFormat, tool_use: ToolUse, make_id: Callable[[], str]):
        self.fmt, self.tool_use, self._make_id = fmt, tool_use, make_id
        self._ids: list[str] = []  # announced calls' ids, by index
        self._sent: list[str] = []  # each announced call's arguments sent so far

    def deltas(self, text: str, finished: bool) -> Calls:
        out = []
        for index, (name, arguments, closed) in enumerate(self.fmt.growing_calls(text)):
            if name not in self.tool_use.names:
                break  # later calls wait for this one: indices stay in order
            if index == len(self._ids):
                self._ids.append(self._make_id())
                self._sent.append("")
                out.append({"index": index, "id": self._ids[index], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            out += self._arguments(index, arguments.strip() if closed else arguments.lstrip().rstrip(" \t\r\n`"))
        return out + self._final(text) if finished else out

    def _arguments(self, index: int, arguments: str) -> Calls:
        sent = self._sent[index]
        if len(arguments) <= len(sent) or not arguments.startswith(sent):
            return []
        self._sent[index] = arguments
        return [{"index": index, "function": {"arguments": arguments[len(sent):]}}]

    def _final(self, text: str) -> Calls:
        _, calls = self.fmt.parse(text, self.tool_use)
        out = []
        for index, call in enumerate(calls):
            if index < len(self._ids):
                out += self._arguments(index, call["function"]["arguments"])
            else:
                self._ids.append(call["id"])
                self._sent.append(call["function"]["arguments"])
                out.append({"index": index, **call})
        return out

    @property
    def called(self) -> bool:
        return bool(self._ids)
