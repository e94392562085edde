"""One streaming call to a worker deployment, and what the client is told when it fails.

Shared by the generation endpoints (``OpenAIService``) and the prefill hop of a disaggregated
application (``router/disaggregation.py``): both cancel the call when its stream is abandoned
(so the replica aborts the request and frees its KV blocks) and turn whatever the call raised
into an OpenAI error, never a traceback.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError

from raylm.router.errors import OpenAIError, invalid, overloaded
from raylm.workers.wire.replica_protocol import (
    GenerateChunk,
    GenerateRequest,
    InvalidRequestError,
    ReplicaDrainingError,
)

logger = logging.getLogger("ray.serve")


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
    if isinstance(cause, RayActorError):  # the replica died; Serve is replacing it
        logger.warning("request %s lost its worker replica: %r", request_id, err)
        return overloaded("the worker replica serving this request died; retry")
    logger.error("request %s failed in a worker: %r", request_id, err)
    return OpenAIError(500, f"internal error while generating (request {request_id}); see the server logs")


def cancel_quietly(call: Any) -> None:
    """Cancel a worker call; a call that already failed re-raises its error on cancel, which
    must not replace the error the client is being told about."""
    try:
        call.cancel()
    except Exception:  # the call's own failure, already handled
        pass


async def worker_stream(worker: Any, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
    """``worker.generate(request)``'s chunks; cancelling or closing this stream before its last
    chunk cancels the call (freeing its KV). Failures arrive as ``OpenAIError``s."""
    call = None
    finished = False
    try:
        call = worker.options(stream=True).generate.remote(request)
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
            cancel_quietly(call)
