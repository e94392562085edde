"""Decode a request body into JSON that every later step can handle, or refuse it with a 400.

``json.loads`` alone lets through what breaks the code after it: nesting deep enough to hit
Python's recursion limit (in the decoder itself, or later in anything that walks the value),
lone UTF-16 surrogates (``"\\ud800"`` is valid JSON but not encodable text: the tokenizer, the
logs and the response encoder all fail on it), and ``NaN`` / ``Infinity`` (not JSON at all,
and they slip through range checks since every comparison with NaN is false). One iterative
walk checks the whole value once, so no handler downstream needs to guard against them.
"""

from __future__ import annotations

import json
import math
from typing import Any

from raylm.router.errors import OpenAIError, invalid

MAX_JSON_DEPTH = 64  # OpenAI request bodies nest 5 deep at most (messages -> content parts -> text)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(body: bytes) -> Any:
    """The decoded body; OpenAIError 400 for anything that is not plain, finite, valid-Unicode JSON."""
    try:
        text = body.decode("utf-8")  # RFC 8259: JSON on the wire is UTF-8 (json.loads would guess UTF-16/32)
    except UnicodeDecodeError as err:
        raise invalid(f"the request body is not valid UTF-8: byte {err.start} ({body[err.start]:#04x})") from None
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise _too_deep() from None
    except ValueError as err:  # JSONDecodeError included
        raise invalid(f"the request body is not valid JSON: {err}") from None
    check_json_value(value)
    return value


def check_json_value(value: Any) -> None:
    """Refuse nesting past ``MAX_JSON_DEPTH``, strings (values or keys) that are not valid
    Unicode, and non-finite numbers; walks iteratively so depth cannot exhaust the stack."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep()
            entries = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in entries:
                if isinstance(key, str):
                    _check_text(key, f"{path}.{_safe(key)}" if path else _safe(key), is_key=True)
                    child_path = f"{path}.{key}" if path else key
                else:
                    child_path = f"{path}[{key}]"
                stack.append((child, depth + 1, child_path))
        elif isinstance(item, str):
            _check_text(item, path)
        elif isinstance(item, float) and not math.isfinite(item):
            raise invalid(f"{path or 'the body'} is a number outside the range of a double", path or None)


def _check_text(text: str, path: str, is_key: bool = False) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        where = f"a key at {path}" if is_key else (path or "the body")
        raise invalid(f"{where} holds a lone UTF-16 surrogate (\\u{ord(text[err.start]):04x}) at character "
                      f"{err.start}: strings must be valid Unicode", None if is_key else (path or None)) from None


def _safe(text: str) -> str:
    """``text`` as it can be shown in an error message whatever it holds."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _too_deep() -> OpenAIError:
    return invalid(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
