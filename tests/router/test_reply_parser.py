"""router/reply_parser.py: one reply fed in pieces split at every position comes apart into
thoughts, content and tool calls exactly as the whole reply does; calls are read from the
answer only, never from the thoughts."""

from __future__ import annotations

import json

import pytest

from raylm.router.reasoning import ThoughtsStart
from raylm.router.reply_parser import ReplyParser
from raylm.router.tool_formats import HermesFormat, Llama3JsonFormat
from raylm.router.tools import parse_tool_use

USE = parse_tool_use({"tools": [{"type": "function", "function": {"name": "add"}}]})
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
# A thinking reply whose thoughts mention a call (not one) and whose answer makes one.
REPLY = f"<think>I could write {CALL} here.</think>\n\nSure.\n{CALL}"


def _fed(parser: ReplyParser, pieces: list[str]) -> tuple[str, str, list[dict]]:
    reasoning, content, entries = "", "", []
    for i, piece in enumerate(pieces):
        delta = parser.feed(piece, finished=i == len(pieces) - 1)
        reasoning, content, entries = reasoning + delta.reasoning, content + delta.content, entries + delta.tool_calls
    return reasoning, content, entries


@pytest.mark.parametrize("cut", range(len(REPLY) + 1))
def test_thoughts_content_and_calls_at_every_split(cut):
    parser = ReplyParser(ThoughtsStart(in_thoughts=False), HermesFormat(), USE)
    reasoning, content, entries = _fed(parser, [REPLY[:cut], REPLY[cut:]])
    assert reasoning == f"I could write {CALL} here." and content.strip() == "Sure."
    arguments = "".join(e["function"].get("arguments", "") for e in entries)
    assert [e["function"]["name"] for e in entries if "name" in e["function"]] == ["add"]
    assert json.loads(arguments) == {"a": 1} and parser.called
    whole_reasoning, whole_content, calls = parser.final()
    assert (whole_reasoning, whole_content) == (reasoning, "Sure.")
    assert calls[0]["function"]["arguments"] == arguments


def test_without_thoughts_or_tools_everything_is_content():
    parser = ReplyParser()
    assert _fed(parser, ["<think>a</think>", CALL]) == ("", f"<think>a</think>{CALL}", [])
    assert parser.final() == (None, f"<think>a</think>{CALL}", []) and not parser.thinks
    llama = ReplyParser(None, Llama3JsonFormat(), USE)
    entries = _fed(llama, ['{"name": "add", ', '"parameters": {}}'])[2]
    assert entries[0]["function"] == {"name": "add", "arguments": ""} and entries[1]["function"] == {"arguments": "{}"}
