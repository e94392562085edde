"""A generated reply as a Messages API message: the whole ``message`` object, or the stream of
events Anthropic sends for it.

The chat pipeline's ``ResponseBuilder`` accumulates the worker's chunks and its ``ReplyParser``
tells thoughts, answer text and tool calls apart; this module only reshapes that into content
blocks (``thinking``, ``text``, ``tool_use``) and stop reasons. Streamed, each block is opened
with ``content_block_start`` when its first piece arrives, grown by ``thinking_delta`` /
``text_delta`` / ``input_json_delta`` events and closed with ``content_block_stop`` when a block
of another kind (or another call) begins or the reply ends; ``message_start`` and a ``ping``
come first, ``message_delta`` (stop reason, usage) and ``message_stop`` last.
"""

from __future__ import annotations

import json
from typing import Any

from raylm.model.text.tokenizer import Tokenizer
from raylm.router.protocol import ParsedRequest
from raylm.router.reply_parser import ReplyDelta
from raylm.router.responses import ResponseBuilder
from raylm.workers.wire.replica_protocol import GenerateChunk


def sse_event(payload: dict[str, Any]) -> str:
    """One server-sent event named by its payload's ``type``, as Anthropic sends them."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class MessageBuilder:
    """One request's reply (a Messages request has one prompt and one choice)."""

    def __init__(self, parsed: ParsedRequest, message_id: str, tokenizer: Tokenizer):
        self.parsed = parsed
        self.id = message_id
        self.chat = ResponseBuilder(parsed, message_id, 0, tokenizer)
        self.stop_string: str | None = None  # the stop sequence that ended the reply, if one did
        self._open: tuple[str, int] | None = None  # the streamed block now open: its kind and call index
        self._blocks = 0  # content blocks started so far

    def add(self, chunk: GenerateChunk) -> list[dict[str, Any]]:
        """Record a worker chunk; the stream events it makes."""
        events = []
        for _, delta in self.chat.add(0, chunk):
            if isinstance(delta.stop_reason, str):
                self.stop_string = delta.stop_reason
            events += self._delta_events(self.chat.choices[0].last)
        return events

    # -- the whole message --------------------------------------------------------------------------
    def message(self) -> dict[str, Any]:
        reasoning, content, calls = self.chat.choices[0].reply.final()
        blocks: list[dict[str, Any]] = []
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if content:
            blocks.append({"type": "text", "text": content})
        blocks += [{"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                    "input": json.loads(c["function"]["arguments"] or "{}")} for c in calls]
        return {**self._envelope(blocks), **self._stop(bool(calls)), "usage": self.usage()}

    def usage(self) -> dict[str, int]:
        """Anthropic's counts: ``input_tokens`` are the prompt tokens not read from the prefix cache."""
        usage = self.chat.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": usage["prompt_tokens"] - cached, "cache_read_input_tokens": cached,
                "output_tokens": usage["completion_tokens"]}

    def _envelope(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.parsed.model, "content": content}

    def _stop(self, called: bool) -> dict[str, Any]:
        finish = self.chat.choices[0].finish_reason
        if finish == "length":
            reason = "max_tokens"
        elif called:
            reason = "tool_use"
        elif self.stop_string is not None and self.stop_string in (self.parsed.params.stop or ()):
            reason = "stop_sequence"
        else:
            reason = "end_turn"
        return {"stop_reason": reason, "stop_sequence": self.stop_string if reason == "stop_sequence" else None}

    # -- the stream ---------------------------------------------------------------------------------
    def stream_start(self, first: GenerateChunk | None) -> list[dict[str, Any]]:
        """``message_start`` (its usage as the worker's first chunk tells the prompt's cache hits) and a ping."""
        cached = first.num_cached_tokens if first is not None else 0
        usage = {"input_tokens": len(self.parsed.prompts[0]) - cached, "cache_read_input_tokens": cached,
                 "output_tokens": 0}
        message = {**self._envelope([]), "stop_reason": None, "stop_sequence": None, "usage": usage}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def stream_end(self) -> list[dict[str, Any]]:
        events = self._close()
        usage = self.usage()
        return events + [{"type": "message_delta", "delta": self._stop(self.chat.choices[0].reply.called),
                          "usage": usage},
                         {"type": "message_stop"}]

    def _delta_events(self, delta: ReplyDelta) -> list[dict[str, Any]]:
        events = []
        if delta.reasoning:
            events += self._piece("thinking", 0, {"type": "thinking", "thinking": "", "signature": ""},
                                  {"type": "thinking_delta", "thinking": delta.reasoning})
        if delta.content:
            events += self._piece("text", 0, {"type": "text", "text": ""},
                                  {"type": "text_delta", "text": delta.content})
        for call in delta.tool_calls:
            function = call.get("function", {})
            block = {"type": "tool_use", "id": call.get("id", ""), "name": function.get("name", ""), "input": {}}
            events += self._piece("tool_use", call["index"], block if "id" in call else None,
                                  {"type": "input_json_delta", "partial_json": function.get("arguments", "")})
        return events

    def _piece(self, kind: str, call: int, block: dict[str, Any] | None, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A delta to the block of ``kind`` (and call index), opening it (closing another) first
        if it is not the open one; an empty delta only opens it."""
        events = []
        if self._open != (kind, call) and block is not None:
            events += self._close()
            events.append({"type": "content_block_start", "index": self._blocks, "content_block": block})
            self._open = (kind, call)
            self._blocks += 1
        text = delta.get("partial_json", delta.get("text", delta.get("thinking")))
        if text:
            events.append({"type": "content_block_delta", "index": self._blocks - 1, "delta": delta})
        return events

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._blocks - 1}]
