"""The Responses API's endpoints on one router replica: ``POST /v1/responses`` (whole or streamed),
``GET`` and ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` and
``POST /v1/responses/{id}/cancel``.

A request becomes a chat request (router/responses_api/request.py) and goes through the same
admission, workers and reply parser as ``/v1/chat/completions``; its output items and events come
from router/responses_api/output.py. Stored responses live in a ``ResponseStore`` shared by every
router replica (cluster/response_store.py), owned by the API key that made them: another key
gets 404, as for an id that does not exist. A failed request stores nothing. One response being
generated is a ``ResponseReply`` (router/responses_api/reply.py); a background response's stream
can be read again, from any replica (router/responses_api/resume.py).
"""

from __future__ import annotations

import asyncio
import hashlib
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
from raylm.router.responses_api.reply import ResponseReply
from raylm.router.responses_api.request import parse_responses_request
from raylm.router.responses_api.resume import FLUSH_S, failure_events, response_error, resumed_events, starting_after

logger = logging.getLogger("ray.serve")
MAX_LIST_LIMIT = 100
# How often a background response with no new events to flush (resume.FLUSH_S) still checks the
# store for a cancellation and says it lives.
CANCEL_POLL_S = 1.0
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
        code, message = "server_error", "the router replica generating this background response stopped"
        error = response_error(code, message)
        failed = {**record, "response": {**record["response"], "status": "failed", "error": error}}
        if "events" in record:  # its stream ends as a live one would have
            ending = failure_events(code, message, record["response"], len(record["events"]))
            failed["events"] = record["events"] + ending
        if await asyncio.to_thread(self.store.replace, owner, response_id, failed, "in_progress"):
            return failed
        return await asyncio.to_thread(self.store.get, owner, response_id)

    async def retrieve(self, request: Request) -> Response:
        """The stored response, or (``stream=true``) a background response's stream events past
        ``starting_after``, live until it ends (router/responses_api/resume.py)."""
        try:
            if request.query_params.get("stream") not in ("true", "1"):
                return JSONResponse((await self._record(request))["response"])
            after = starting_after(request.query_params.get("starting_after"))
            record = await self._record(request)
            if "events" not in record:
                raise invalid("only a background response can be streamed again (create it with background: true)",
                              "stream")
            owner, response_id = self._owner(request), request.path_params["response_id"]
            return StreamingResponse(resumed_events(self.store, owner, response_id, after, STALE_AFTER_S, self._fresh),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": response_id})
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
            reply = ResponseReply(self.store, parsed_request, owner, ResponseBuilder(parsed, f"resp_{uuid.uuid4().hex}",
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

    async def _start_background(self, reply: ResponseReply, key_tenant: str | None, priority_header: str | None,
                                stream: bool) -> Response:
        """Store the response ``in_progress`` and generate it in a task of this replica (admitted
        like any request); its end replaces the record unless it was cancelled. Answered with the
        response at once, or (``stream``) with its events as the task makes them: a client that
        goes away stops reading, not generating, and fetches the result with ``GET`` (or its
        stream's events again, with ``GET ?stream=true``: they are kept in the record)."""
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

    async def _generate_background(self, reply: ResponseReply, key_tenant: str | None, priority_header: str | None,
                                   events: "asyncio.Queue[str | None] | None" = None) -> None:
        """Generate a background response to its stored end; ``events``: also its stream's events
        (the failure ones included), then None."""
        service, parsed = self.service, reply.builder.parsed
        watcher = asyncio.get_running_loop().create_task(self._keep_alive(reply, asyncio.current_task()))
        try:
            priority, lease = await service.admit(parsed, key_tenant, priority_header)
            try:
                chunks = service.generate_admitted(parsed, reply.id, priority, lease)
                async for event in reply.events(await anext(chunks, None), chunks):
                    if events is not None:
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

    async def _keep_alive(self, reply: ResponseReply, generating: asyncio.Task | None) -> None:
        """Send the stream's new events to the store every ``FLUSH_S`` (for resumed streams), and
        at least every ``CANCEL_POLL_S`` say there that the response is being generated
        (``alive_at``); stop generating once it is no longer ``in_progress`` there (another
        replica cancelled or deleted it), unless this reply is storing its own end."""
        flushed, said_at = 0, time.monotonic()
        while generating is not None:
            await asyncio.sleep(FLUSH_S)
            new = reply.log[flushed:]
            if not new and time.monotonic() - said_at < CANCEL_POLL_S:
                continue
            try:
                alive = await asyncio.to_thread(self.store.append_events, reply.owner, reply.id, new, time.time())
            except Exception:  # the store is unreachable for now: the next flush sends these too
                logger.warning("background response %s: could not flush its events", reply.id, exc_info=True)
                continue
            flushed, said_at = flushed + len(new), time.monotonic()
            if not alive and not reply.ending:
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
