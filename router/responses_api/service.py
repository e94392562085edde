"""The Responses API's endpoints on one router replica: ``POST /v1/responses`` (whole or streamed),
``GET`` and ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` and
``POST /v1/responses/{id}/cancel``.

A request becomes a chat request (router/responses_api/request.py) and goes through the same
admission, workers and reply parser as ``/v1/chat/completions``; its output items and events come
from router/responses_api/output.py. Stored responses live in a ``ResponseStore`` shared by every
router replica (cluster/response_store.py), owned by the API key that made them: another key
gets 404, as for an id that does not exist. A failed request stores nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from raylm.cluster.response_store import ResponseStore
from raylm.router.errors import OpenAIError, invalid
from raylm.router.http_replies import LeasedStreamingResponse, error_response
from raylm.router.openai_service import OpenAIService
from raylm.router.responses import ResponseBuilder
from raylm.router.responses_api.output import OutputBuilder
from raylm.router.responses_api.request import ResponsesRequest, parse_responses_request
from raylm.workers.wire.replica_protocol import GenerateChunk

logger = logging.getLogger("ray.serve")
MAX_LIST_LIMIT = 100
CANCEL_POLL_S = 1.0  # how often a background response checks the store for a cancellation (and says it lives)
# A background response ``in_progress`` whose replica has not said it lives for this long lost it
# (the replica died): the next read stores it failed.
STALE_AFTER_S = 15.0


async def _until_done(events: "asyncio.Queue[str | None]") -> AsyncIterator[str]:
    """A background response's stream: the events its task puts, until its None."""
    while (event := await events.get()) is not None:
        yield event


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(404, f"Response with id {response_id!r} not found."[:300], param=param, code="not_found")


class ResponsesAPI:
    """The ``/v1/responses`` routes over an ``OpenAIService`` (its auth, parser, admission and
    workers) and a response store."""

    def __init__(self, service: OpenAIService, store: ResponseStore):
        self.service = service
        self.store = store
        self._background: dict[str, asyncio.Task] = {}  # background responses this replica generates

    def routes(self) -> list[Route]:
        return [
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"]),
        ]

    # -- the stored responses -------------------------------------------------------------------------
    def _owner(self, request: Request) -> str:
        """Whose records a request sees: its API key's (hashed; "" when the server has no keys)."""
        authorization = request.headers.get("authorization")
        if self.service.auth.tenant(authorization) is None:
            return ""
        token = (authorization or "").partition(" ")[2].strip()
        return hashlib.sha256(token.encode()).hexdigest()

    async def _record(self, request: Request) -> dict[str, Any]:
        response_id = request.path_params["response_id"]
        record = await self._fresh(self._owner(request), response_id)
        if record is None:
            raise not_found(response_id)
        return record

    async def _fresh(self, owner: str, response_id: str) -> dict[str, Any] | None:
        """The stored record, a background response whose replica stopped saying it lives
        (``STALE_AFTER_S``) first stored ``failed`` (atomically: unless it ended meanwhile)."""
        record = await asyncio.to_thread(self.store.get, owner, response_id)
        if record is None or record["response"]["status"] != "in_progress":
            return record
        if time.time() - record.get("alive_at", time.time()) <= STALE_AFTER_S:
            return record
        error = {"code": "server_error", "message": "the router replica generating this background response stopped"}
        failed = {**record, "response": {**record["response"], "status": "failed", "error": error}}
        if await asyncio.to_thread(self.store.replace, owner, response_id, failed, "in_progress"):
            return failed
        return await asyncio.to_thread(self.store.get, owner, response_id)

    async def retrieve(self, request: Request) -> Response:
        try:
            if request.query_params.get("stream") in ("true", "1"):
                raise invalid("streaming a stored response again is not supported", "stream")
            return JSONResponse((await self._record(request))["response"])
        except OpenAIError as err:
            return error_response(err)

    async def delete(self, request: Request) -> Response:
        try:
            response_id = request.path_params["response_id"]
            if not await asyncio.to_thread(self.store.delete, self._owner(request), response_id):
                raise not_found(response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})
        except OpenAIError as err:
            return error_response(err)

    async def cancel(self, request: Request) -> Response:
        """Cancel a background response: it is ``cancelled`` in the store at once (atomically, so a
        reply finishing meanwhile cannot undo it), and the replica generating it stops (at once
        here, within ``CANCEL_POLL_S`` on another replica). A finished one is returned as it is."""
        try:
            owner, response_id = self._owner(request), request.path_params["response_id"]
            record = await self._record(request)
            if not record["response"]["background"]:
                raise invalid("only background responses can be cancelled", code="not_cancellable")
            if record["response"]["status"] == "in_progress":
                cancelled = {**record, "response": {**record["response"], "status": "cancelled"}}
                if await asyncio.to_thread(self.store.replace, owner, response_id, cancelled, "in_progress"):
                    task = self._background.get(response_id)
                    if task is not None:
                        task.cancel()
                    return JSONResponse(cancelled["response"])
                record = await self._record(request)
            return JSONResponse(record["response"])
        except OpenAIError as err:
            return error_response(err)

    async def input_items(self, request: Request) -> Response:
        """The response's input items, newest first unless ``order=asc``; ``limit`` and ``after`` page."""
        try:
            query = request.query_params
            order = query.get("order", "desc")
            if order not in ("asc", "desc"):
                raise invalid("order must be asc or desc", "order")
            limit_text = query.get("limit", "20")
            if not (limit_text.isascii() and limit_text.isdigit() and 1 <= int(limit_text) <= MAX_LIST_LIMIT):
                raise invalid(f"limit must be an integer from 1 to {MAX_LIST_LIMIT}", "limit")
            items = (await self._record(request))["input_items"]
            items = items if order == "asc" else items[::-1]
            after = query.get("after")
            if after is not None:
                ids = [item["id"] for item in items]
                if after not in ids:
                    raise invalid(f"after {after!r} is not the id of one of this response's input items"[:300],
                                  "after")
                items = items[ids.index(after) + 1:]
            page = items[: int(limit_text)]
            return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                                 "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)})
        except OpenAIError as err:
            return error_response(err)

    # -- creating a response ----------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        """``POST /v1/responses``, counted by endpoint and status (``raylm_router_requests_total``)."""
        response = await self._create(request)
        self.service.metrics.request("/v1/responses", response.status_code)
        return response

    async def _create(self, request: Request) -> Response:
        service = self.service
        try:
            key_tenant = service.auth.tenant(request.headers.get("authorization"))
            owner = self._owner(request)
            body = await service._read_json(request)
            if isinstance(body, dict):
                await service.catalog.find(body.get("model"))
            previous = await self._previous(owner, body)
            parsed_request = parse_responses_request(body, previous)
            parsed = service.parser.parse_chat(parsed_request.chat_body)
            reply = _Reply(self, parsed_request, owner, ResponseBuilder(parsed, f"resp_{uuid.uuid4().hex}",
                                                                        int(time.time()), service.tokenizer))
            if parsed_request.background:  # what can be refused now is, before anything is stored
                service._priority(parsed, request.headers.get("x-priority"))
                service._check_fits_pool(parsed)
                return await self._start_background(reply, key_tenant, request.headers.get("x-priority"),
                                                    parsed_request.stream)
            priority, lease = await service.admit(parsed, key_tenant, request.headers.get("x-priority"))
        except OpenAIError as err:
            service.metrics.rejected(err.status, err.code or "invalid_request")
            return error_response(err)
        chunks = service.generate_admitted(reply.builder.parsed, reply.id, priority, lease)
        try:
            first = await anext(chunks, None)
            if parsed_request.stream:  # the streaming response owns the lease from here on
                return LeasedStreamingResponse(reply.events(first, chunks), lease, media_type="text/event-stream",
                                               headers={"Cache-Control": "no-cache", "X-Request-Id": reply.id})
            await reply.run(first, chunks)
        except OpenAIError as err:
            await lease.close()
            return error_response(err)
        except BaseException:
            await lease.close()
            raise
        await lease.close()
        return JSONResponse(reply.response("completed"), headers={"X-Request-Id": reply.id})

    async def _start_background(self, reply: "_Reply", key_tenant: str | None, priority_header: str | None,
                                stream: bool) -> Response:
        """Store the response ``in_progress`` and generate it in a task of this replica (admitted
        like any request); its end replaces the record unless it was cancelled. Answered with the
        response at once, or (``stream``) with its events as the task makes them: a client that
        goes away stops reading, not generating, and fetches the result with ``GET``."""
        await asyncio.to_thread(self.store.put, reply.owner, reply.id, reply.record("in_progress"))
        events: asyncio.Queue[str | None] | None = asyncio.Queue() if stream else None
        task = asyncio.get_running_loop().create_task(
            self._generate_background(reply, key_tenant, priority_header, events))
        self._background[reply.id] = task
        task.add_done_callback(lambda _: self._background.pop(reply.id, None))
        if events is None:
            return JSONResponse(reply.response("in_progress"), headers={"X-Request-Id": reply.id})
        return StreamingResponse(_until_done(events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": reply.id})

    async def _generate_background(self, reply: "_Reply", key_tenant: str | None, priority_header: str | None,
                                   events: "asyncio.Queue[str | None] | None" = None) -> None:
        """Generate a background response to its stored end; ``events``: also its stream's events
        (the failure ones included), then None."""
        service, parsed = self.service, reply.builder.parsed
        watcher = asyncio.get_running_loop().create_task(self._keep_alive(reply, asyncio.current_task()))
        try:
            priority, lease = await service.admit(parsed, key_tenant, priority_header)
            try:
                chunks = service.generate_admitted(parsed, reply.id, priority, lease)
                if events is None:
                    await reply.run(await anext(chunks, None), chunks)
                else:
                    async for event in reply.events(await anext(chunks, None), chunks):
                        events.put_nowait(event)
            finally:
                await lease.close()
        except OpenAIError as err:
            await reply.fail(err.code or "server_error", err.message, events)
        except Exception:
            logger.exception("background response %s failed", reply.id)
            await reply.fail("server_error", "internal error while generating", events)
        finally:
            watcher.cancel()
            if events is not None:
                events.put_nowait(None)

    async def _keep_alive(self, reply: "_Reply", generating: asyncio.Task | None) -> None:
        """Say in the store that the response is being generated (``alive_at``) every
        ``CANCEL_POLL_S``, and stop generating once it is no longer ``in_progress`` there (another
        replica cancelled or deleted it)."""
        while generating is not None:
            await asyncio.sleep(CANCEL_POLL_S)
            if not await asyncio.to_thread(self.store.replace, reply.owner, reply.id, reply.record("in_progress"),
                                           "in_progress"):
                generating.cancel()
                return

    async def _previous(self, owner: str, body: Any) -> dict[str, Any] | None:
        previous_id = body.get("previous_response_id") if isinstance(body, dict) else None
        if previous_id is None:
            return None
        if not isinstance(previous_id, str):
            raise invalid("previous_response_id must be a string", "previous_response_id")
        record = await self._fresh(owner, previous_id)
        if record is None:
            raise not_found(previous_id, "previous_response_id")
        if record["response"]["status"] == "in_progress":
            raise invalid(f"the previous response {previous_id!r} is still in progress: wait for it to finish"[:300],
                          "previous_response_id")
        return record


class _Reply:
    """One response being generated: its output, its final object and its record in the store."""

    def __init__(self, api: ResponsesAPI, request: ResponsesRequest, owner: str, builder: ResponseBuilder):
        self.api = api
        self.request = request
        self.owner = owner
        self.builder = builder
        self.id = builder.id
        self.output = OutputBuilder()
        self._sequence = 0

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
            await self._store()
            yield self._event({"type": f"response.{final['status']}", "response": final})
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
        error = {"code": code or "server_error", "message": message}
        if self.request.background:
            record = self.record("failed")
            record["response"]["error"] = error
            await asyncio.to_thread(self.api.store.replace, self.owner, self.id, record, "in_progress")
        return [self._event({"type": "error", "code": code, "message": message, "param": param}),
                self._event({"type": "response.failed", "response": {**self.response("failed"), "error": error}})]

    def _drain(self) -> list[str]:
        events = [self._event(e) for e in self.output.events]
        self.output.events.clear()
        return events

    def _event(self, event: dict[str, Any]) -> str:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"

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
        store, record = self.api.store, self.record("completed")
        if self.request.background:  # unless it was cancelled meanwhile
            await asyncio.to_thread(store.replace, self.owner, self.id, record, "in_progress")
        elif not await asyncio.to_thread(store.put, self.owner, self.id, record):
            logger.warning("response %s is larger than the whole response store: not stored", self.id)
