"""Anthropic's error shape: ``{"type": "error", "error": {"type": ..., "message": ...}}``.

The router raises ``OpenAIError`` everywhere (its status says what went wrong); the Messages
API tells the same failure with the status unchanged and Anthropic's error type for it. An
overloaded router answers 503 with ``overloaded_error``, as vLLM does (Anthropic itself uses 529).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import Response

from raylm.router.errors import OpenAIError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(err: OpenAIError) -> dict[str, Any]:
    kind = _TYPES.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def anthropic_error_response(err: OpenAIError) -> Response:
    """ASCII-escaped JSON: a message may quote client text of any kind."""
    return Response(json.dumps(anthropic_error_body(err)), status_code=err.status, headers=err.headers,
                    media_type="application/json")
