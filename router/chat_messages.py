"""A chat request's ``messages``, validated into the plain dicts the chat template renders.

Content is text (a string, or text parts joined); other part types are refused. Assistant
turns may carry earlier ``tool_calls`` and thoughts (``reasoning_content``, or vLLM's
``reasoning``, for templates that render them); a ``tool`` turn must answer one of them, as OpenAI
requires: it carries the ``tool_call_id`` of a call made by the assistant turn it follows
(after that turn's other results), else the request is a 400 saying which message and why.
"""

from __future__ import annotations

from typing import Any

from raylm.router.errors import invalid

_ROLES = {"system", "developer", "user", "assistant", "tool"}


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages with string content, ``developer`` as ``system``, tool calls and results checked."""
    if messages is None:
        raise invalid("you must provide a messages parameter", "messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    out = []
    open_calls: list[str] | None = None  # ids of the calls the latest assistant turn made, while results follow
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(f"{where} must be an object with role and content", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise invalid(f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}"[:300], f"{where}.role")
        _text_field(message, "name", where)
        content = _content(message.get("content"), role, where)
        entry: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
        if role == "assistant" and message.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
        if role == "assistant":  # earlier thoughts, as replies carry them: a thinking model's template shows them
            thoughts = _text_field(message, "reasoning_content", where) or _text_field(message, "reasoning", where)
            if thoughts:
                entry["reasoning_content"] = thoughts
        if role == "tool":
            entry["tool_call_id"] = _tool_result_id(message, where, open_calls)
        else:
            open_calls = [c["id"] for c in entry.get("tool_calls", ())] or None
        out.append(entry)
    return out


def _content(content: Any, role: str, where: str) -> str:
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(
                    f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}; "
                    "this model reads text only", f"{where}.content",
                )
            texts.append(part["text"])
        return "".join(texts)
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    raise invalid(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def _text_field(message: dict[str, Any], field: str, where: str) -> str | None:
    value = message.get(field)
    if value is not None and not isinstance(value, str):
        raise invalid(f"{where}.{field} must be a string, got {type(value).__name__}", f"{where}.{field}")
    return value


def _tool_result_id(message: dict[str, Any], where: str, open_calls: list[str] | None) -> str:
    """The ``tool_call_id`` of a tool turn, which must name a call of the assistant turn before it."""
    call_id = _text_field(message, "tool_call_id", where)
    if not call_id:
        raise invalid(f"{where}: a message with role 'tool' must carry the tool_call_id of the call it answers",
                      f"{where}.tool_call_id")
    if open_calls is None:
        raise invalid(f"{where}: a message with role 'tool' must answer a preceding assistant message with "
                      "tool_calls (only other tool results may come between them)", f"{where}.role")
    if call_id not in open_calls:
        raise invalid(f"{where}.tool_call_id {call_id!r} is not the id of a call in the preceding assistant "
                      f"message's tool_calls ({', '.join(map(repr, open_calls))})"[:400], f"{where}.tool_call_id")
    return call_id


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant turn's earlier calls: ``[{id, type: function, function: {name, arguments}}]``."""
    if not isinstance(calls, list):
        raise invalid(f"{where} must be a list", where)
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments", ""), str)):
            raise invalid(f"{where}[{i}] must be {{'id': ..., 'type': 'function', 'function': "
                          "{'name': ..., 'arguments': '<JSON text>'}}", f"{where}[{i}]")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise invalid(f"{where}[{i}].id must be a string", f"{where}[{i}].id")
        out.append({"id": call_id or "", "type": "function",
                    "function": {"name": function["name"], "arguments": function.get("arguments", "")}})
    return out
