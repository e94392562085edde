"""gpt-oss's tool calls: a commentary-channel message to ``functions.NAME`` whose body is the
arguments' JSON (router/harmony.py reads the whole reply: thoughts, content and calls). A
harmony reply is told apart by ``HarmonyReplyParser``, not by ``ReplyParser``: content comes
from its channels, so this format has no ``held_back``; what it gives is the forcing grammar,
the markers (special tokens: replies keep them) and the calls as they grow."""

from __future__ import annotations

import json
from typing import Any

from raylm.router.call_streams import PieceCallStream
from raylm.router.harmony import CHANNEL, CONSTRAIN, END, FUNCTIONS, MARKERS, MESSAGE, START, calls_of, read_messages
from raylm.router.tool_formats import Calls, CallStream, FormatBase, new_call, with_layout
from raylm.router.tools import ToolUse
from raylm.workers.core.grammar import StructuredOutput


class HarmonyFormat(FormatBase):
    """``literals``: each marker as a grammar literal (the special token itself, as in gpt-oss's
    vocabulary; llguidance gives special tokens no text to match)."""

    name = "harmony"
    markers = MARKERS

    def __init__(self, literals: dict[str, str] | None = None):
        self._literal = literals or {m: json.dumps(m) for m in MARKERS}

    def history(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Earlier thoughts as gpt-oss's template reads them: ``thinking``, not ``reasoning_content``.
        Its template refuses a turn with tool calls that has both content and thinking (it shows
        either on the analysis channel); there the thoughts, what the model wrote on that channel,
        are kept and the content (a preamble) is left out."""
        turns = []
        for message in messages:
            thoughts = message.get("reasoning_content")
            if message["role"] != "assistant" or not thoughts:
                turns.append(message)
                continue
            turn = {key: value for key, value in message.items() if key != "reasoning_content"}
            turn["thinking"] = thoughts
            if turn.get("tool_calls") and turn.get("content"):
                turn["content"] = ""
            turns.append(turn)
        return turns

    def parse(self, text: str, tool_use: ToolUse) -> tuple[str | None, Calls]:
        """The calls of a whole reply (``PieceCallStream`` completes its calls from them; the
        content is told by channel: ``HarmonyReplyParser.final``)."""
        calls = calls_of(read_messages(text), tool_use)
        return (None, calls) if calls else (text, [])

    def growing_calls(self, text: str) -> list[tuple[str, str, bool]]:
        """The messages to functions so far: (name, body so far, whether its end marker came)."""
        return [(str(m.function), m.body, m.ending is not None) for m in read_messages(text, finished=False)
                if m.function is not None]

    def grammar(self, tool_use: ToolUse) -> StructuredOutput | None:
        """One call, after the thoughts if the model writes them first (free text up to
        ``<|end|>``, as gpt-oss always does), even where parallel calls are allowed: the
        ``<|call|>`` that ends a call is one of gpt-oss's end-of-generation tokens (its
        generation config), so the engine stops there, and llguidance ends a grammar at any
        end token it writes. Several calls would need generation to go on past ``<|call|>``,
        where gpt-oss, which next expects the tool's reply (``<|start|>functions...``), would be
        forced into another call after each, up to ``max_tokens``; its template also writes
        back one call per assistant message. (A reply holding several calls is still read.)"""
        if tool_use.choice == "auto":
            return None
        literal = self._literal
        functions = tool_use.forced_functions
        rules = [f"f{i}: {json.dumps(f['name'] + ' ')} {literal[CONSTRAIN]} \"json\" {literal[MESSAGE]} "
                 f"%json {json.dumps(with_layout(f['parameters']))}" for i, f in enumerate(functions)]
        alternatives = " | ".join(f"f{i}" for i in range(len(functions)))
        return StructuredOutput("grammar", "\n".join([
            "start: analysis? call", *self._thoughts_rules(),
            f'call: {literal[CHANNEL]} "commentary to={FUNCTIONS}" ({alternatives})',
            *rules]))

    def final_answer_grammar(self, answer_rules: list[str], answer: str) -> StructuredOutput:
        """A structured answer (``answer_rules``, whose rule ``answer`` is the JSON or choice the
        request asks for) as gpt-oss writes one: its thoughts first if it starts them, then the
        final channel's message, which holds the answer alone (the reply parser's content)."""
        literal = self._literal
        return StructuredOutput("grammar", "\n".join([
            f'start: analysis? {literal[CHANNEL]} "final" {literal[MESSAGE]} {answer}', *self._thoughts_rules(),
            *answer_rules]))

    def _thoughts_rules(self) -> list[str]:
        """``analysis``: an analysis-channel message (free text up to ``<|end|>``), then the next
        message's head up to its channel."""
        literal = self._literal
        text_end = not literal[END].startswith("<[")  # <|end|> is text here: the thoughts end at its first one
        thoughts = ("harmony_thoughts[lazy]: /(?s:.*)<\\|end\\|>/" if text_end
                    else f"harmony_thoughts: /(?s:.*)/ {literal[END]}")
        return [f'analysis: {literal[CHANNEL]} "analysis" {literal[MESSAGE]} harmony_thoughts {literal[START]} '
                '"assistant"', thoughts]

    def stream(self, tool_use: ToolUse) -> CallStream:
        return PieceCallStream(self, tool_use, lambda: new_call("", "")["id"])
