"""A reply's output items and the Responses API's semantic stream events, built from the reply
parser's deltas (router/reply_parser.py: thoughts, content, tool calls) as they come.

One output is built for both ways of answering: a streamed response sends the events, a whole
one drops them and keeps the items; the final object is the same either way. The thoughts are a
``reasoning`` item (``reasoning_text`` content), the answer a ``message`` item with one
``output_text`` part, each tool call a ``function_call`` item; an item opens when its first
delta arrives and is done when another opens or the reply ends.
"""

from __future__ import annotations

import uuid
from typing import Any

from raylm.router.reply_parser import ReplyDelta


class OutputBuilder:
    """The output items of one reply, and the events that tell them (``events``, drained by the
    caller; each gets its ``sequence_number`` when the caller sends it)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item deltas go to
        self._open_call: int | None = None  # the tool call index of an open function_call

    def feed(self, delta: ReplyDelta) -> None:
        if delta.reasoning:
            self._text(delta.reasoning, "reasoning")
        if delta.content:
            self._text(delta.content, "message")
        for call in delta.tool_calls:
            self._call(call)

    def finish(self) -> None:
        self._close()

    # -- items ---------------------------------------------------------------------------------------
    def _text(self, text: str, kind: str) -> None:
        item = self._open
        if item is None or item["type"] != kind:
            item = self._start_text(kind)
        part = item["content"][0]
        part["text"] += text
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        self.events.append({"type": event, **self._where(item), "content_index": 0, "delta": text,
                            **({"logprobs": []} if kind == "message" else {})})

    def _start_text(self, kind: str) -> dict[str, Any]:
        if kind == "message":
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self._add(item)
        item["content"].append(part)
        self.events.append({"type": "response.content_part.added", **self._where(item), "content_index": 0,
                            "part": dict(part)})
        return item

    def _call(self, call: dict[str, Any]) -> None:
        function = call.get("function", {})
        if self._open is None or self._open["type"] != "function_call" or self._open_call != call["index"]:
            item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                    "call_id": call.get("id") or f"call_{uuid.uuid4().hex}", "name": function.get("name", ""),
                    "arguments": ""}
            self._add(item)
            self._open_call = call["index"]
        item = self._open
        assert item is not None
        piece = function.get("arguments") or ""
        if piece:
            item["arguments"] += piece
            self.events.append({"type": "response.function_call_arguments.delta", **self._where(item), "delta": piece})

    def _add(self, item: dict[str, Any]) -> None:
        self._close()
        self.items.append(item)
        self._open = item
        announced = {**item, "content": []} if "content" in item else dict(item)
        self.events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                            "item": announced})

    def _close(self) -> None:
        item = self._open
        if item is None:
            return
        self._open, self._open_call = None, None
        where = self._where(item)
        if item["type"] == "function_call":
            self.events.append({"type": "response.function_call_arguments.done", **where,
                                "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            done = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            self.events.append({"type": done, **where, "content_index": 0, "text": part["text"],
                                **({"logprobs": []} if item["type"] == "message" else {})})
            self.events.append({"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)})
        item["status"] = "completed"
        self.events.append({"type": "response.output_item.done", "output_index": where["output_index"],
                            "item": item})

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.items.index(item)}
