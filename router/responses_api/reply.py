"""One ``/v1/responses`` reply being generated: its output items and stream events
(router/responses_api/output.py), the response object at each status, and its record in the store:
the response, its input items, the conversation a later ``previous_response_id`` continues, and
(background responses) the stream's events, for resumed streams (router/responses_api/resume.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from raylm.cluster.response_store import ResponseStore
from raylm.router.errors import OpenAIError
from raylm.router.responses import ResponseBuilder
from raylm.router.responses_api.output import OutputBuilder
from raylm.router.responses_api.request import ResponsesRequest
from raylm.router.responses_api.resume import failure_events, response_error, sse_event
from raylm.workers.wire.replica_protocol import GenerateChunk

logger = logging.getLogger("ray.serve")


class ResponseReply:
    """One response being generated: its output, its final object and its record in the store."""

    def __init__(self, store: ResponseStore, request: ResponsesRequest, owner: str, builder: ResponseBuilder):
        self.store = store
        self.request = request
        self.owner = owner
        self.builder = builder
        self.id = builder.id
        self.output = OutputBuilder()
        self._sequence = 0
        self.log: list[str] = []  # a background response's stream events, kept for resumed streams
        self.ending = False  # storing its end: a store that no longer says in_progress is this reply's doing

    def _add(self, item: tuple[int, GenerateChunk]) -> None:
        self.builder.add(*item)
        self.output.feed(self.builder.choices[0].last)

    async def run(self, first: tuple[int, GenerateChunk] | None, chunks: AsyncIterator[tuple[int, GenerateChunk]]) -> None:
        item = first
        while item is not None:
            self._add(item)
            item = await anext(chunks, None)
        self.output.finish()
        await self._store()

    def record(self, status: str) -> dict[str, Any]:
        """What the store keeps: the response, its input items and the conversation to continue
        (with this reply once it is complete)."""
        done = status == "completed"
        record = {"response": self.response(status), "input_items": self.request.input_items,
                  "conversation": self.request.conversation + ([self._assistant_turn()] if done else [])}
        if self.request.background:
            record["events"] = list(self.log)
        if status == "in_progress":  # a background response's replica says it lives (ResponsesAPI._fresh)
            record["alive_at"] = time.time()
        return record

    async def events(self, first: tuple[int, GenerateChunk] | None,
                     chunks: AsyncIterator[tuple[int, GenerateChunk]]) -> AsyncIterator[str]:
        """The stream: created, in_progress, each item's events, then completed (or incomplete); an
        error on the way is an ``error`` event then ``response.failed`` (the response, status
        ``failed`` with its error, as OpenAI ends a failed stream), and nothing is stored."""
        try:
            yield self._event({"type": "response.created", "response": self.response("in_progress")})
            yield self._event({"type": "response.in_progress", "response": self.response("in_progress")})
            item = first
            while item is not None:
                self._add(item)
                for event in self._drain():
                    yield event
                item = await anext(chunks, None)
            self.output.finish()
            for event in self._drain():
                yield event
            final = self.response("completed")
            last = self._event({"type": f"response.{final['status']}", "response": final})
            await self._store()  # with the last event, for resumed streams
            yield last
        except OpenAIError as err:
            for event in await self._failed(err.code, err.message, err.param):
                yield event
        except Exception:
            logger.exception("streaming response %s failed", self.id)
            for event in await self._failed("server_error", f"internal error while streaming (response {self.id})"):
                yield event

    async def fail(self, code: str, message: str, events: "asyncio.Queue[str | None] | None") -> None:
        """A background response that failed before its stream began (admission): its record
        (and its stream's events)."""
        for event in await self._failed(code, message):
            if events is not None:
                events.put_nowait(event)

    async def _failed(self, code: str | None, message: str, param: str | None = None) -> list[str]:
        """The events ending a failed stream; a background response's record says ``failed``."""
        error = response_error(code, message)
        events = failure_events(code, message, self.response("failed"), self._sequence, param)
        self._sequence += len(events)
        if self.request.background:
            self.log += events
            record = self.record("failed")
            record["response"]["error"] = error
            self.ending = True
            await asyncio.to_thread(self.store.replace, self.owner, self.id, record, "in_progress")
        return events

    def _drain(self) -> list[str]:
        events = [self._event(e) for e in self.output.events]
        self.output.events.clear()
        return events

    def _event(self, event: dict[str, Any]) -> str:
        text = sse_event(event, self._sequence)
        self._sequence += 1
        if self.request.background:
            self.log.append(text)
        return text

    def response(self, status: str) -> dict[str, Any]:
        """The response object; ``completed`` becomes ``incomplete`` when the reply hit its token limit."""
        body, builder = self.request.body, self.builder
        done = status == "completed"
        cut = done and builder.choices[0].finish_reason == "length"
        reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
        return {
            "id": self.id, "object": "response", "created_at": builder.created, "model": builder.parsed.model,
            "status": "incomplete" if cut else status, "background": self.request.background, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "output": self.output.items if done else [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": reasoning.get("effort"), "summary": None},
            "store": self.request.store, "temperature": body.get("temperature", 1.0),
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
            "top_p": body.get("top_p", 1.0), "truncation": "disabled", "user": body.get("user"),
            "metadata": body.get("metadata") or {}, "usage": self._usage() if done else None,
        }

    def _usage(self) -> dict[str, Any]:
        usage = self.builder.usage()
        return {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"],
            "output_tokens_details": {
                "reasoning_tokens": usage.get("completion_tokens_details", {}).get("reasoning_tokens", 0)},
            "total_tokens": usage["total_tokens"],
        }

    def _assistant_turn(self) -> dict[str, Any]:
        """This reply as the chat turn a later ``previous_response_id`` continues from."""
        turn: dict[str, Any] = {"role": "assistant", "content": ""}
        for item in self.output.items:
            if item["type"] == "message":
                turn["content"] += item["content"][0]["text"]
            elif item["type"] == "reasoning":
                turn["reasoning_content"] = item["content"][0]["text"]
            else:
                turn.setdefault("tool_calls", []).append(
                    {"id": item["call_id"], "type": "function",
                     "function": {"name": item["name"], "arguments": item["arguments"]}})
        return turn

    async def _store(self) -> None:
        if not self.request.store:
            return
        store, record = self.store, self.record("completed")
        if self.request.background:  # unless it was cancelled meanwhile
            self.ending = True
            await asyncio.to_thread(store.replace, self.owner, self.id, record, "in_progress")
        elif not await asyncio.to_thread(store.put, self.owner, self.id, record):
            logger.warning("response %s is larger than the whole response store: not stored", self.id)
