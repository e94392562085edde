"""The HTTP responses every endpoint family shares: OpenAI's error JSON, and a streaming response
that owns its request's admission lease (router/lease.py) until the stream ends."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from raylm.router.errors import OpenAIError
from raylm.router.lease import Lease


def error_response(err: OpenAIError) -> Response:
    """OpenAI's error JSON. ASCII-escaped: a message may quote client text of any kind."""
    return Response(json.dumps(err.body()), status_code=err.status, headers=err.headers,
                    media_type="application/json")


class LeasedStreamingResponse(StreamingResponse):
    """A streaming response that owns its request's lease: closed when the response ends, however
    it ends (done, client gone, cancelled), since Starlette calls a returned response once."""

    def __init__(self, content: AsyncIterator[str], lease: Lease, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.lease = lease

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.lease.close()
