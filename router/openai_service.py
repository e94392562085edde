"""The OpenAI HTTP API of one router replica, as a plain ASGI app over a worker handle.

Requests are parsed and tokenized here (so the router can check context limits and route by
prefix), admitted through the fair queue, then streamed from a worker through a Serve
deployment handle. Whatever happens, the client gets OpenAI's error JSON with a fitting
status; a client that goes away cancels the handle call, which aborts the request in the
worker and frees its KV blocks. Nothing here knows it runs inside Serve, so tests drive it
in-process with a fake worker.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from raylm.cache.block_hash import adapter_salt, block_hashes
from raylm.cluster.adapter_store import AdapterStore, MemoryAdapterStore
from raylm.cluster.metrics import RouterMetrics
from raylm.cluster.response_store import MemoryResponseStore, ResponseStore
from raylm.model.config.model_config import ModelConfig
from raylm.model.runtime.buckets import cdiv
from raylm.model.text.tokenizer import Tokenizer
from raylm.router.admission import AdmissionController
from raylm.router.anthropic.endpoint import MessagesAPI
from raylm.router.anthropic.errors import anthropic_error_response
from raylm.router.auth import Authenticator, with_env_keys
from raylm.router.disaggregation import PrefillHop
from raylm.router.errors import OpenAIError, invalid, overloaded
from raylm.router.fair_queue import FairQueue
from raylm.router.http_replies import LeasedStreamingResponse, error_response
from raylm.router.json_body import parse_json_body
from raylm.router.lease import Lease
from raylm.router.lora_catalog import ModelCatalog
from raylm.router.protocol import ParsedRequest, RequestParser
from raylm.router.rate_limit import RateLimiter
from raylm.router.responses import ResponseBuilder
from raylm.router.settings import RouterSettings
from raylm.router.streams import merge_indexed
from raylm.router.worker_calls import worker_stream
from raylm.workers.wire.replica_protocol import GenerateChunk, GenerateRequest, RoutingReport

logger = logging.getLogger("ray.serve")


def _encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: a list of floats, or base64 of little-endian float32s."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class OpenAIService:
    """``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/models``, ``/tokenize``,
    ``/detokenize``, ``/health`` and ``/v1/responses`` (router/responses_api/, its store shared by the
    router replicas; a router alone: in this process) for one model and its LoRA adapters, and vLLM's
    ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (router/lora_catalog.py). Loaded
    adapters are recorded in ``adapter_store`` (a router alone: in this process)."""

    def __init__(self, worker: Any, settings: RouterSettings, tokenizer: Tokenizer,
                 adapter_store: AdapterStore | None = None, model_config: ModelConfig | None = None,
                 response_store: ResponseStore | None = None, prefill_worker: Any = None):
        self.worker = worker
        self.response_store = response_store or MemoryResponseStore(settings.responses_store_max_bytes,
                                                                    settings.responses_store_max_age_s)
        self.settings = settings
        self.tokenizer = tokenizer
        self.catalog = ModelCatalog(settings, adapter_store or MemoryAdapterStore(), model_config)
        self.parser = RequestParser(tokenizer, self.catalog.models.keys(), settings.max_model_len,
                                    settings.tool_call_parser, settings.reasoning_parser)
        self.metrics = RouterMetrics(settings.served_model_name)
        # Disaggregated (a prefill deployment beside the workers, which then decode): each prompt
        # is computed on a prefill replica first (router/disaggregation.py).
        self.prefill_hop = (None if prefill_worker is None
                            else PrefillHop(prefill_worker, settings.prefill_timeout_s, self.metrics))
        self.queue = FairQueue(len(settings.priority_classes), settings.max_queue_size, settings.tenant_weights)
        self.admission = AdmissionController(self.queue, settings.queue_timeout_s, on_tokens=self._count_tokens)
        self.auth = Authenticator(with_env_keys(settings.api_keys, settings.api_keys_env),
                                  with_env_keys(settings.admin_api_keys, settings.admin_api_keys_env))
        self.rate_limiter = RateLimiter(settings.requests_per_minute, settings.tokens_per_minute)
        # The longest prompt every replica's KV pools admit, once reported (None: no such limit).
        self.max_prompt_tokens: int | None = None

    def update_replicas(self, replicas: dict[str, dict[str, Any]]) -> None:
        """The worker replicas' latest routing stats: admission capacity, pool size, queue gauges."""
        settings = self.settings
        slots = len(replicas) * settings.slots_per_replica
        self.admission.set_capacity(cdiv(slots, settings.num_router_replicas))
        if replicas:
            limits = [RoutingReport.from_dict(s).engine.max_prompt_tokens for s in replicas.values()]
            self.max_prompt_tokens = min((n for n in limits if n is not None), default=None)
        for index, name in enumerate(settings.priority_classes):
            self.metrics.queue_depth(name, self.queue.depth(index))

    def queue_status(self) -> dict[str, Any]:
        """For ``raylm status`` and leak checks: queue by class, slots in use, capacity, leases."""
        return {
            "queued": {name: self.queue.depth(i) for i, name in enumerate(self.settings.priority_classes)},
            "in_flight": self.admission.in_flight,
            "capacity": self.admission.capacity,
            "leases": len(self.admission.leases),
        }

    def asgi_app(self) -> Starlette:
        def in_its_api_shape(request: Request, err: OpenAIError) -> Response:
            """Anthropic's error shape under its API's paths (unknown ones and wrong methods too)."""
            messages_api = request.url.path == "/v1/messages" or request.url.path.startswith("/v1/messages/")
            return anthropic_error_response(err) if messages_api else error_response(err)

        async def on_http_error(request: Request, exc: HTTPException) -> Response:
            return in_its_api_shape(request, OpenAIError(exc.status_code,
                                                         f"{request.method} {request.url.path}: {exc.detail}"))

        async def on_error(request: Request, exc: Exception) -> Response:
            logger.exception("unhandled error serving %r", request.url.path)
            return in_its_api_shape(request, OpenAIError(500, "internal server error; see the server logs"))

        from raylm.router.responses_api.service import ResponsesAPI  # it builds on this module

        messages = MessagesAPI(self)  # Anthropic's Messages API (router/anthropic/)
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._endpoint(self.parser.parse_chat), methods=["POST"]),
                Route("/v1/completions", self._endpoint(self.parser.parse_completion), methods=["POST"]),
                Route("/v1/embeddings", self._endpoint(self.parser.parse_embedding), methods=["POST"]),
                Route("/tokenize", self._tokenizer_endpoint(self.parser.tokenize), methods=["POST"]),
                Route("/detokenize", self._tokenizer_endpoint(self.parser.detokenize), methods=["POST"]),
                Route("/v1/load_lora_adapter", self._admin_endpoint(self.catalog.load), methods=["POST"]),
                Route("/v1/unload_lora_adapter", self._admin_endpoint(self.catalog.unload), methods=["POST"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/messages", messages.create, methods=["POST"]),
                Route("/v1/messages/count_tokens", messages.count_tokens, methods=["POST"]),
                *ResponsesAPI(self, self.response_store).routes(),
            ],
            exception_handlers={HTTPException: on_http_error, Exception: on_error},
        )

    # -- small endpoints --------------------------------------------------------------------------------
    async def list_models(self, request: Request) -> Response:
        try:
            self.auth.tenant(request.headers.get("authorization"))
        except OpenAIError as err:
            return error_response(err)
        return JSONResponse({"object": "list", "data": list(self.catalog.cards.values())})

    async def get_model(self, request: Request) -> Response:
        try:
            self.auth.tenant(request.headers.get("authorization"))
        except OpenAIError as err:
            return error_response(err)
        await self.catalog.find(request.path_params["model"])
        card = self.catalog.cards.get(request.path_params["model"])
        if card is None:
            return error_response(OpenAIError(404, f"The model {request.path_params['model']!r} does not exist",
                                              param="model", code="model_not_found"))
        return JSONResponse(card)

    def _tokenizer_endpoint(self, answer: Callable[[Any], dict[str, Any]]) -> Callable[[Request], Awaitable[Response]]:
        """vLLM's ``/tokenize`` and ``/detokenize``: answered here with the router's tokenizer (no
        worker, no queue), behind the same API keys and body checks as generation."""

        async def endpoint(request: Request) -> Response:
            try:
                self.auth.tenant(request.headers.get("authorization"))
                return JSONResponse(answer(await self._read_json(request)))
            except OpenAIError as err:
                return error_response(err)

        return endpoint

    def _admin_endpoint(self, act: Callable[[Any], Awaitable[str]]) -> Callable[[Request], Awaitable[Response]]:
        """vLLM's adapter endpoints: an admin key when keys are configured; vLLM's plain-text
        answer on success, OpenAI's error JSON otherwise."""

        async def endpoint(request: Request) -> Response:
            try:
                self.auth.admin(request.headers.get("authorization"))
                return PlainTextResponse(await act(await self._read_json(request)))
            except OpenAIError as err:
                return error_response(err)

        return endpoint

    async def health(self, request: Request) -> Response:
        """200 when this router can admit work (a worker replica reported its capacity) and a worker
        replica answers its health check in time, else 503."""
        if self.admission.capacity == 0:
            return error_response(overloaded("no worker replica has reported its capacity yet"))
        try:
            await asyncio.wait_for(self.worker.check_health.remote(), self.settings.health_check_timeout_s)
        except Exception as err:  # any failure means: not healthy
            return error_response(OpenAIError(503, f"no healthy worker replica: {type(err).__name__}"))
        return JSONResponse({"status": "ok"})

    # -- generation endpoints -------------------------------------------------------------------------
    def _endpoint(self, parse: Callable[[Any], ParsedRequest]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                key_tenant = self.auth.tenant(request.headers.get("authorization"))
                body = await self._read_json(request)
                if isinstance(body, dict):
                    await self.catalog.find(body.get("model"))
                parsed = parse(body)
                priority, lease = await self.admit(parsed, key_tenant, request.headers.get("x-priority"))
            except OpenAIError as err:
                self.metrics.rejected(err.status, err.code or "invalid_request")
                self.metrics.request(request.url.path, err.status)
                return error_response(err)
            # From here on the lease is this function's until a streaming response takes it.
            try:
                response = await self._serve(parsed, priority, lease)
            except BaseException:
                await lease.close()
                raise
            if not isinstance(response, LeasedStreamingResponse):
                await lease.close()
            self.metrics.request(request.url.path, response.status_code)
            return response

        return endpoint

    async def admit(self, parsed: ParsedRequest, key_tenant: str | None, priority_header: str | None) -> tuple[int, Lease]:
        """Admit a parsed request (priority, pool limit, rate limit, fair queue): its priority and lease."""
        priority = self._priority(parsed, priority_header)
        tenant = key_tenant or parsed.user or "anonymous"
        self._check_fits_pool(parsed)
        self.rate_limiter.check(tenant)
        return priority, await self.admission.acquire(tenant, priority, parsed.params.n * len(parsed.prompts))

    def generate_admitted(self, parsed: ParsedRequest, request_id: str, priority: int,
                          lease: Lease) -> AsyncIterator[tuple[int, GenerateChunk]]:
        """The worker chunks of an admitted request, counted against its lease and metrics."""
        self.metrics.queue_time(self.settings.priority_classes[priority], lease.waited_s)
        lease.count_tokens(sum(len(p) for p in parsed.prompts))
        return lease.attach(self._generate(parsed, request_id, priority, lease))

    async def _serve(self, parsed: ParsedRequest, priority: int, lease: Lease) -> Response:
        """Generate for an admitted request: a full JSON response, or a streaming one that owns the lease."""
        prefix = {"chat": "chatcmpl", "completion": "cmpl", "embedding": "embd"}[parsed.kind]
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        if parsed.kind == "embedding":
            return await self._serve_embeddings(parsed, request_id, priority, lease)
        builder = ResponseBuilder(parsed, request_id, int(time.time()), self.tokenizer)
        chunks = self.generate_admitted(parsed, request_id, priority, lease)
        try:
            first = await anext(chunks, None)
        except OpenAIError as err:
            return error_response(err)
        if parsed.stream:
            return LeasedStreamingResponse(
                self._stream(builder, first, chunks), lease, media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": request_id},
            )
        try:
            item = first
            while item is not None:
                builder.add(*item)
                item = await anext(chunks, None)
        except OpenAIError as err:
            return error_response(err)
        return JSONResponse(builder.final(), headers={"X-Request-Id": request_id})

    async def _serve_embeddings(self, parsed: ParsedRequest, request_id: str, priority: int, lease: Lease) -> Response:
        """Every input through the workers as a prompt-only request; one JSON list of vectors."""
        vectors: dict[int, list[float]] = {}
        try:
            async for index, chunk in self.generate_admitted(parsed, request_id, priority, lease):
                if chunk.embedding is not None:
                    vectors[index] = chunk.embedding
        except OpenAIError as err:
            return error_response(err)
        data = [{"object": "embedding", "index": i, "embedding": _encode_embedding(vectors[i], parsed.encoding_format)}
                for i in range(len(parsed.prompts))]
        tokens = sum(len(p) for p in parsed.prompts)
        return JSONResponse({"object": "list", "data": data, "model": parsed.model,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}},
                            headers={"X-Request-Id": request_id})

    def _count_tokens(self, tenant: str, tokens: int) -> None:
        """Served tokens count toward the tenant's fair share, rate limit and metrics."""
        self.queue.charge(tenant, tokens)
        self.rate_limiter.add_tokens(tenant, tokens)
        self.metrics.tenant_tokens(tenant, tokens)

    def _priority(self, parsed: ParsedRequest, header: str | None) -> int:
        """The priority class index from the body's ``priority`` or the ``x-priority`` header."""
        classes = self.settings.priority_classes
        value: str | int | None = parsed.priority if parsed.priority is not None else header
        if value is None:
            return classes.index(self.settings.default_priority)
        if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
            value = int(value)
        if isinstance(value, int):
            if 0 <= value < len(classes):
                return value
        elif value in classes:
            return classes.index(value)
        raise invalid(f"priority must be one of {list(classes)} (or an index 0..{len(classes) - 1}), got {value!r}",
                      "priority")

    def _check_fits_pool(self, parsed: ParsedRequest) -> None:
        """A prompt longer than a replica's KV pools can ever admit (as the replicas report it:
        a sliding-window model's pool may hold prompts longer than itself) never runs: 400 now."""
        limit = self.max_prompt_tokens
        if limit is None:
            return
        for prompt in parsed.prompts:
            if len(prompt) > limit:
                raise invalid(
                    f"the prompt has {len(prompt)} tokens, but a worker replica's KV pool holds prompts of at "
                    f"most {limit} tokens; shorten it",
                    "messages" if parsed.kind == "chat" else "prompt", code="prompt_too_long_for_kv_cache",
                )

    async def _read_json(self, request: Request) -> Any:
        limit = self.settings.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise OpenAIError(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
        body = bytearray()
        async for part in request.stream():
            body += part
            if len(body) > limit:
                raise OpenAIError(413, f"request body exceeds the limit of {limit} bytes")
        return parse_json_body(bytes(body))

    async def _generate(
        self, parsed: ParsedRequest, request_id: str, priority: int, lease: Lease
    ) -> AsyncIterator[tuple[int, GenerateChunk]]:
        lora = self.catalog.adapter(parsed.model)
        salt = adapter_salt(self.settings.cache_salt, None if lora is None else lora.cache_key)
        streams = [
            self._worker_stream(
                GenerateRequest(
                    request_id=request_id if len(parsed.prompts) == 1 else f"{request_id}-{i}",
                    prompt_token_ids=prompt,
                    params=parsed.params,
                    priority=priority,
                    block_hashes=block_hashes(prompt, self.settings.block_size, salt),
                    embed=parsed.kind == "embedding",
                    beam=parsed.beam,
                    lora=lora,
                )
            )
            for i, prompt in enumerate(parsed.prompts)
        ]
        async with contextlib.aclosing(merge_indexed(streams)) as merged:
            async for index, chunk in merged:
                lease.count_tokens(sum(len(c.token_ids) for c in chunk.choices))
                yield index, chunk

    async def _worker_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """One request's chunks from a worker replica (a decode replica after the prefill hop, in a
        disaggregated application); closing this stream cancels whichever call is running."""
        if self.prefill_hop is not None and self.prefill_hop.applies_to(request):
            request = await self.prefill_hop.decode_request(request)
        async with contextlib.aclosing(worker_stream(self.worker, request)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _stream(
        self,
        builder: ResponseBuilder,
        first: tuple[int, GenerateChunk] | None,
        chunks: AsyncIterator[tuple[int, GenerateChunk]],
    ) -> AsyncIterator[str]:
        """SSE events; an error after the first event is an error event and never a clean end."""
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
        except Exception:
            logger.exception("streaming response %s failed", builder.id)
            yield _sse(OpenAIError(500, f"internal error while streaming (request {builder.id})").body())
        yield "data: [DONE]\n\n"
