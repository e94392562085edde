"""OpenAI-shaped errors: every failure a client can see is one of these, never a traceback."""

from __future__ import annotations

from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class OpenAIError(Exception):
    """A request failed; ``status`` is the HTTP status, the rest fills OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 for a bad field (``param`` names it, as OpenAI does)."""
    return OpenAIError(400, message, param=param, code=code)


def overloaded(message: str, retry_after_s: int = 1) -> OpenAIError:
    """A 503 that tells the client when to come back."""
    return OpenAIError(503, message, code="overloaded", headers={"Retry-After": str(retry_after_s)})
