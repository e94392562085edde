"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` on an ``OpenAIService``.

A Messages request takes the same way as a chat completion (API keys, body limit, parsing,
priority, rate limit, fair-queue admission, worker streams, lease): only its request and reply
shapes (router/anthropic/request.py, reply.py) and its errors (errors.py) are Anthropic's.
Anthropic clients send their key as ``x-api-key``; ``Authorization: Bearer`` works too.
"""

from __future__ import annotations

import logging
import uuid
from typing import TYPE_CHECKING, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from raylm.router.anthropic.errors import anthropic_error_body, anthropic_error_response
from raylm.router.anthropic.reply import MessageBuilder, sse_event
from raylm.router.anthropic.request import chat_body
from raylm.router.errors import OpenAIError
from raylm.router.http_replies import LeasedStreamingResponse
from raylm.router.lease import Lease
from raylm.router.protocol import ParsedRequest
from raylm.router.reasoning_grammar import budget_enforceable
from raylm.workers.wire.replica_protocol import GenerateChunk

if TYPE_CHECKING:
    from raylm.router.openai_service import OpenAIService

logger = logging.getLogger("ray.serve")
ENDPOINT = "/v1/messages"


def authorization(request: Request) -> str | None:
    """The request's key as the Authenticator reads it: ``x-api-key``, else the Authorization header."""
    key = request.headers.get("x-api-key")
    return f"Bearer {key}" if key else request.headers.get("authorization")


class MessagesAPI:
    """The Messages API of one router replica, sharing its service's queue, limits and workers."""

    def __init__(self, service: OpenAIService):
        self.service = service

    def _parse(self, body: object, count_only: bool = False) -> ParsedRequest:
        parser = self.service.parser
        tokenizer = self.service.tokenizer
        chat = chat_body(body, parser.reasoning_parser, tokenizer.chat_template, count_only,
                         budget_enforceable(parser.reasoning_parser, tokenizer))
        return parser.parse_chat(chat)

    async def count_tokens(self, request: Request) -> Response:
        """``{"input_tokens": N}``: the prompt the same request would send, without generating."""
        try:
            self.service.auth.tenant(authorization(request))
            body = await self.service._read_json(request)
            if isinstance(body, dict):
                await self.service.catalog.find(body.get("model"))
            return JSONResponse({"input_tokens": len(self._parse(body, count_only=True).prompts[0])})
        except OpenAIError as err:
            return anthropic_error_response(err)

    async def create(self, request: Request) -> Response:
        service = self.service
        try:
            key_tenant = service.auth.tenant(authorization(request))
            body = await service._read_json(request)
            if isinstance(body, dict):
                await service.catalog.find(body.get("model"))
            parsed = self._parse(body)
            priority = service._priority(parsed, request.headers.get("x-priority"))
            tenant = key_tenant or parsed.user or "anonymous"
            service._check_fits_pool(parsed)
            service.rate_limiter.check(tenant)
            lease = await service.admission.acquire(tenant, priority, 1)
        except OpenAIError as err:
            service.metrics.rejected(err.status, err.code or "invalid_request")
            service.metrics.request(ENDPOINT, err.status)
            return anthropic_error_response(err)
        try:
            response = await self._serve(parsed, priority, lease)
        except BaseException:
            await lease.close()
            raise
        if not isinstance(response, StreamingResponse):  # a streaming response owns the lease
            await lease.close()
        service.metrics.request(ENDPOINT, response.status_code)
        return response

    async def _serve(self, parsed: ParsedRequest, priority: int, lease: Lease) -> Response:
        service = self.service
        service.metrics.queue_time(service.settings.priority_classes[priority], lease.waited_s)
        lease.count_tokens(len(parsed.prompts[0]))
        message_id = f"msg_{uuid.uuid4().hex}"
        builder = MessageBuilder(parsed, message_id, service.tokenizer)
        chunks = lease.attach(service._generate(parsed, message_id, priority, lease))
        try:
            first = await anext(chunks, None)
        except OpenAIError as err:
            return anthropic_error_response(err)
        if parsed.stream:
            return LeasedStreamingResponse(self._stream(builder, first, chunks), lease, media_type="text/event-stream",
                                           headers={"Cache-Control": "no-cache", "X-Request-Id": message_id})
        try:
            item = first
            while item is not None:
                builder.add(item[1])
                item = await anext(chunks, None)
            return JSONResponse(builder.message(), headers={"X-Request-Id": message_id})
        except OpenAIError as err:
            return anthropic_error_response(err)

    async def _stream(self, builder: MessageBuilder, first: tuple[int, GenerateChunk] | None,
                      chunks: AsyncIterator[tuple[int, GenerateChunk]]) -> AsyncIterator[str]:
        """Anthropic's events; a failure after the first is an ``error`` event, never a clean end."""
        try:
            for event in builder.stream_start(first[1] if first is not None else None):
                yield sse_event(event)
            item = first
            while item is not None:
                for event in builder.add(item[1]):
                    yield sse_event(event)
                item = await anext(chunks, None)
            for event in builder.stream_end():
                yield sse_event(event)
        except OpenAIError as err:
            yield sse_event(anthropic_error_body(err))
        except Exception:
            logger.exception("streaming message %s failed", builder.id)
            yield sse_event(anthropic_error_body(OpenAIError(500, f"internal error while streaming ({builder.id})")))
