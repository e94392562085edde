"""A background response's stream, read again: ``GET /v1/responses/{id}?stream=true`` with an
optional ``starting_after`` sequence number, on any router replica.

The replica generating a background response keeps every event it streams and flushes the new
ones to the cluster's response store every ``FLUSH_S`` (router/responses_api/service.py); the
finished record holds them all. A resumed stream reads the events past its sequence number from
the store, then polls for more until the response has ended: a client that lost its connection
(or its router replica) picks the stream up where it left off, through any replica, lagging the
generating one by at most a flush and a poll. A response whose replica died is stored failed by
the first read that sees it silent (``ResponsesAPI._fresh``), with the ``error`` and
``response.failed`` events a live stream would have ended with, so a resumed stream ends the same
way. A cancelled response's stream ends after its last event.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Awaitable, Callable

from raylm.cluster.response_store import ResponseStore
from raylm.router.errors import invalid

FLUSH_S = 0.2  # how often the generating replica sends its new events to the store
POLL_S = 0.2  # how often a resumed stream asks the store for more


def sse_event(event: dict[str, Any], sequence: int) -> str:
    """One Responses API stream event as server-sent-event text, numbered ``sequence``."""
    event["sequence_number"] = sequence
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


def response_error(code: str | None, message: str) -> dict[str, Any]:
    """A failed response's ``error`` object (a code it lacks is ``server_error``)."""
    return {"code": code or "server_error", "message": message}


def failure_events(code: str | None, message: str, response: dict[str, Any], first_sequence: int,
                   param: str | None = None) -> list[str]:
    """How a failed stream ends: ``error``, then ``response.failed`` with the failed response."""
    failed = {**response, "status": "failed", "error": response_error(code, message)}
    return [sse_event({"type": "error", "code": code, "message": message, "param": param}, first_sequence),
            sse_event({"type": "response.failed", "response": failed}, first_sequence + 1)]


def starting_after(text: str | None) -> int:
    """The ``starting_after`` query parameter: the last sequence number the client has (-1: none)."""
    if text is None:
        return -1
    if not (text.isascii() and text.isdigit()):
        raise invalid("starting_after must be a sequence number (an integer >= 0)", "starting_after")
    return int(text)


async def resumed_events(store: ResponseStore, owner: str, response_id: str, after: int, stale_after_s: float,
                         mark_stale: Callable[[str, str], Awaitable[Any]]) -> AsyncIterator[str]:
    """The stream's events past ``after``, as the store receives them, until the response ended.
    ``mark_stale(owner, id)`` stores a response whose replica has been silent for ``stale_after_s``
    as failed (with its ending events, read on the next poll)."""
    while True:
        tail = await asyncio.to_thread(store.events_after, owner, response_id, after)
        if tail is None:  # deleted meanwhile (or evicted): nothing more will come
            return
        for event in tail["events"]:
            yield event
        after += len(tail["events"])
        if tail["status"] != "in_progress":
            return
        if time.time() - tail["alive_at"] > stale_after_s:
            await mark_stale(owner, response_id)
        else:
            await asyncio.sleep(POLL_S)
