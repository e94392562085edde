"""The router's OpenAI service in-process over a scripted fake worker, driven through ASGI.

Lets tests take every path of a request (worker errors, deaths, hangs, client disconnects)
on purpose and check what the router holds afterwards, in milliseconds and without Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

from raylm.model.config.registry import DEFAULT_MODEL
from raylm.router.openai_service import OpenAIService
from raylm.router.settings import RouterSettings
from raylm.workers.engine.engine_args import EngineArgs
from raylm.workers.wire.replica_protocol import ChoiceDelta, GenerateChunk

HANG = "hang"


def fake_settings(**overrides: Any) -> RouterSettings:
    """Router settings for the bundled model served as model "m", the engine's defaults, a
    512-token context and no API keys; ``overrides`` replace any of them."""
    engine = EngineArgs()
    return RouterSettings(**{
        "model": DEFAULT_MODEL, "served_model_name": "m", "max_model_len": 512, "api_keys_env": None, "admin_api_keys_env": None,
        "slots_per_replica": engine.max_num_seqs, "block_size": engine.block_size, **overrides,
    })


def chunk(text: str, finished: bool = False) -> GenerateChunk:
    choice = ChoiceDelta(0, text, [1], None, "length" if finished else None)
    return GenerateChunk("r", [choice], prompt_tokens=3, num_cached_tokens=0, finished=finished)


class FakeCall:
    """One streaming worker call playing a script of chunks, errors, hangs and gates (``asyncio.Event``)."""

    def __init__(self, script: list[Any]):
        self.script = script
        self.cancels = 0
        self.finished = False

    def __aiter__(self):
        return self._play()

    async def _play(self):
        for step in self.script:
            if isinstance(step, asyncio.Event):  # a gate: the rest plays once the test sets it
                await step.wait()
                continue
            if step == HANG:
                await asyncio.Event().wait()
            if isinstance(step, BaseException):
                raise step
            yield step
            if step.finished:
                self.finished = True

    def cancel(self) -> None:
        self.cancels += 1


class FakeWorker:
    """Stands in for the worker deployment handle: ``options(stream=True).generate.remote(req)``."""

    def __init__(self, script: list[Any] | None = None):
        self.script: list[Any] = script or []
        self.calls: list[FakeCall] = []
        self.requests: list[Any] = []  # what each call was asked (GenerateRequests)
        self.generate = self

    def options(self, **_: Any) -> "FakeWorker":
        return self

    def remote(self, request: Any) -> FakeCall:
        call = FakeCall(list(self.script))
        self.calls.append(call)
        self.requests.append(request)
        return call


@dataclasses.dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


async def asgi_request(app, method: str, path: str, body: bytes, headers: dict[str, str | bytes] | None = None,
                       disconnect_after_body_parts: int | None = None,
                       disconnect_after_s: float | None = None) -> Answer:
    """One HTTP request through the ASGI app; the client may go away after some parts or seconds."""
    gone = asyncio.Event()
    sent_request = False
    answer = Answer(0, {}, b"")
    parts: list[bytes] = []

    async def receive() -> dict:
        nonlocal sent_request
        if not sent_request:
            sent_request = True
            return {"type": "http.request", "body": body, "more_body": False}
        if disconnect_after_s is not None:
            await asyncio.sleep(disconnect_after_s)
        else:
            await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body" and message.get("body"):
            parts.append(message["body"])
            if disconnect_after_body_parts is not None and len(parts) >= disconnect_after_body_parts:
                gone.set()

    path, _, query = path.partition("?")
    raw_path = path.encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": raw_path, "query_string": query.encode(), "root_path": "",
             "headers": [(k.lower().encode(), v if isinstance(v, bytes) else v.encode())
                         for k, v in (headers or {}).items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    task = asyncio.create_task(app(scope, receive, send))
    if disconnect_after_s is not None:
        # The server cancels the handler when the client goes away before any response started.
        done, _ = await asyncio.wait({task}, timeout=disconnect_after_s)
        if not done:
            task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    answer.body = b"".join(parts)
    return answer


async def post_json(app, body: dict, path: str = "/v1/completions", **kwargs: Any) -> Answer:
    return await asgi_request(app, "POST", path, json.dumps(body).encode(), {"content-type": "application/json"},
                              **kwargs)


def ledger_problems(service: OpenAIService) -> list[str]:
    """What the router still holds: slots, leases, queued requests, worker calls neither finished
    nor cancelled exactly once. Empty when every request gave everything back."""
    problems = []
    if service.admission.in_flight or service.admission.leases:
        problems.append(f"slots still held: {service.queue_status()}")
    if len(service.queue):
        problems.append(f"{len(service.queue)} requests still queued")
    for call in service.worker.calls:
        if not (call.finished or call.cancels == 1):
            problems.append(f"worker call finished={call.finished} cancelled {call.cancels} times")
    return problems


def token_chunks(tokenizer: Any, reply: str, finish: str = "stop") -> list[GenerateChunk]:
    """A worker's stream of ``reply`` as a model writes it: one chunk per token of it, each with
    that token's text (so a tag made of several tokens arrives in pieces)."""
    ids = tokenizer.encode(reply, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == reply
    pieces, done = [], ""
    for k in range(len(ids)):
        text = tokenizer.decode(ids[: k + 1], skip_special_tokens=False)
        pieces.append(text[len(done):])
        done = text
    return [GenerateChunk("r", [ChoiceDelta(0, piece, [token], None, finish if k == len(ids) - 1 else None)],
                          prompt_tokens=3, num_cached_tokens=0, finished=k == len(ids) - 1)
            for k, (piece, token) in enumerate(zip(pieces, ids))]


def openai_client(service: OpenAIService) -> Any:
    """The official async ``openai`` client, talking HTTP to ``service``'s app in-process."""
    import httpx
    import openai

    transport = httpx.ASGITransport(app=service.asgi_app())
    return openai.AsyncOpenAI(base_url="http://router/v1", api_key="unused", max_retries=0,
                              http_client=httpx.AsyncClient(transport=transport, base_url="http://router"))
