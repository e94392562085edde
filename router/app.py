"""The ingress deployment: OpenAI HTTP API in front of the worker replicas.

Requests are parsed and tokenized here (so the router can check context limits and, later,
route by prefix), then streamed from a worker through a Serve deployment handle. Whatever
happens, the client gets OpenAI's error JSON with a fitting status; a client that goes away
cancels the handle call, which aborts the request in the worker and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

from ray import serve
from ray.exceptions import RayTaskError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from model import load_model_info
from router.errors import OpenAIError, invalid, overloaded
from router.protocol import ParsedRequest, RequestParser
from router.responses import ResponseBuilder
from router.settings import RouterSettings
from router.streams import merge_indexed
from workers.replica_protocol import GenerateChunk, GenerateRequest, InvalidRequestError, ReplicaDrainingError

logger = logging.getLogger("ray.serve")


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def translate_worker_error(err: BaseException, request_id: str) -> OpenAIError:
    """Map what a worker call raised to what the client should see (never a traceback)."""
    cause = err.cause if isinstance(err, RayTaskError) and err.cause is not None else err
    if isinstance(cause, OpenAIError):
        return cause
    if isinstance(cause, BackPressureError):
        return overloaded("the server is overloaded: every worker replica's queue is full; retry shortly")
    if isinstance(cause, InvalidRequestError):
        return invalid(str(cause).splitlines()[0])
    if isinstance(cause, ReplicaDrainingError):
        return overloaded("the worker replica is shutting down; retry")
    logger.error("request %s failed in a worker: %r", request_id, err)
    return OpenAIError(500, f"internal error while generating (request {request_id}); see the server logs")


def _cancel_quietly(call: Any) -> None:
    """Cancel a worker call; a call that already failed re-raises its error on cancel, which
    must not replace the error the client is being told about."""
    try:
        call.cancel()
    except Exception:  # the call's own failure, already handled
        pass


@serve.deployment(name="OpenAIRouter", max_ongoing_requests=4096)
@serve.ingress()
class OpenAIRouter:
    """``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health``."""

    def __init__(self, worker: DeploymentHandle, settings: RouterSettings):
        self.worker = worker
        self.settings = settings
        info = load_model_info(settings.model)
        self.tokenizer = info.tokenizer
        self.parser = RequestParser(info.tokenizer, [settings.served_model_name], settings.max_model_len)
        self.created = int(time.time())

    def __serve_build_asgi_app__(self) -> Starlette:
        async def on_http_error(request: Request, exc: HTTPException) -> Response:
            return error_response(OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

        async def on_error(request: Request, exc: Exception) -> Response:
            logger.exception("unhandled error serving %s", request.url.path)
            return error_response(OpenAIError(500, "internal server error; see the server logs"))

        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._endpoint(self.parser.parse_chat), methods=["POST"]),
                Route("/v1/completions", self._endpoint(self.parser.parse_completion), methods=["POST"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={HTTPException: on_http_error, Exception: on_error},
        )

    # -- small endpoints --------------------------------------------------------------------------------
    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.settings.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "raylm",
            "max_model_len": self.settings.max_model_len,
        }

    async def list_models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        if request.path_params["model"] != self.settings.served_model_name:
            return error_response(OpenAIError(404, f"The model '{request.path_params['model']}' does not exist",
                                              param="model", code="model_not_found"))
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        """200 when a worker replica answers its health check in time, else 503."""
        try:
            await asyncio.wait_for(self.worker.check_health.remote(), self.settings.health_check_timeout_s)
        except Exception as err:  # any failure means: not healthy
            return error_response(OpenAIError(503, f"no healthy worker replica: {type(err).__name__}"))
        return JSONResponse({"status": "ok"})

    # -- generation endpoints -------------------------------------------------------------------------
    def _endpoint(self, parse: Callable[[Any], ParsedRequest]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                parsed = parse(await self._read_json(request))
            except OpenAIError as err:
                return error_response(err)
            prefix = "chatcmpl" if parsed.kind == "chat" else "cmpl"
            request_id = f"{prefix}-{uuid.uuid4().hex}"
            builder = ResponseBuilder(parsed, request_id, int(time.time()), self.tokenizer)
            chunks = self._generate(parsed, request_id)
            try:
                first = await anext(chunks, None)
            except OpenAIError as err:
                await chunks.aclose()
                return error_response(err)
            if parsed.stream:
                return StreamingResponse(
                    self._stream(builder, first, chunks), media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
                )
            try:
                item = first
                while item is not None:
                    builder.add(*item)
                    item = await anext(chunks, None)
            except OpenAIError as err:
                return error_response(err)
            finally:
                await chunks.aclose()
            return JSONResponse(builder.final(), headers={"X-Request-Id": request_id})

        return endpoint

    async def _read_json(self, request: Request) -> Any:
        limit = self.settings.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise OpenAIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise OpenAIError(413, f"request body exceeds the limit of {limit} bytes")
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise invalid(f"the request body is not valid JSON: {err}") from None

    async def _generate(self, parsed: ParsedRequest, request_id: str) -> AsyncIterator[tuple[int, GenerateChunk]]:
        streams = [
            self._worker_stream(
                GenerateRequest(
                    request_id=request_id if len(parsed.prompts) == 1 else f"{request_id}-{i}",
                    prompt_token_ids=prompt,
                    params=parsed.params,
                    priority=parsed.priority,
                )
            )
            for i, prompt in enumerate(parsed.prompts)
        ]
        async for item in merge_indexed(streams):
            yield item

    async def _worker_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """One worker call; cancelling or closing this stream cancels the call (freeing its KV)."""
        call = None
        finished = False
        try:
            call = self.worker.options(stream=True).generate.remote(request)
            async for chunk in call:
                if any(c.finish_reason == "abort" for c in chunk.choices):
                    raise overloaded("the worker replica shut down while generating; retry")
                finished = chunk.finished
                yield chunk
        except OpenAIError:
            raise
        except Exception as err:
            raise translate_worker_error(err, request.request_id) from None
        finally:
            if call is not None and not finished:
                _cancel_quietly(call)

    async def _stream(
        self,
        builder: ResponseBuilder,
        first: tuple[int, GenerateChunk] | None,
        chunks: AsyncIterator[tuple[int, GenerateChunk]],
    ) -> AsyncIterator[str]:
        try:
            for payload in builder.stream_start():
                yield _sse(payload)
            item = first
            while item is not None:
                for index, delta in builder.add(*item):
                    payload = builder.stream_delta(index, delta)
                    if payload is not None:
                        yield _sse(payload)
                item = await anext(chunks, None)
            if builder.parsed.include_usage:
                yield _sse(builder.stream_usage())
        except OpenAIError as err:
            yield _sse(err.body())
        finally:
            await chunks.aclose()
        yield "data: [DONE]\n\n"
