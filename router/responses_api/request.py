"""A ``POST /v1/responses`` body, checked and turned into the chat request the router already
serves (router/protocol.py ``parse_chat``): ``instructions`` become the system message, the
input items (after the stored conversation of ``previous_response_id``) become chat turns,
function tools and ``tool_choice`` the chat API's, ``text.format`` the ``response_format``,
``reasoning.effort`` the ``reasoning_effort``. One request path, so tools, grammars, reasoning
and limits behave the same on both APIs.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from raylm.router.errors import invalid

_FIELDS = {
    "model", "input", "instructions", "tools", "tool_choice", "max_output_tokens", "temperature", "top_p", "text",
    "reasoning", "previous_response_id", "store", "stream", "metadata", "parallel_tool_calls", "user", "truncation",
    "background", "include",
}
_ROLES = {"user", "system", "developer", "assistant"}
_TEXT_PARTS = {"input_text", "output_text"}
MAX_INPUT_ITEMS = 2048
MAX_METADATA_PAIRS = 16  # OpenAI's bounds on metadata
MAX_METADATA_VALUE = 512


@dataclasses.dataclass
class ResponsesRequest:
    """A checked request: the chat body to generate with, this turn's input items (with ids, as
    ``input_items`` lists them) and the chat turns of the whole conversation so far."""

    body: dict[str, Any]  # the request as the client sent it
    chat_body: dict[str, Any]
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]  # previous turns and this input, without the instructions

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def background(self) -> bool:
        return bool(self.body.get("background"))

    @property
    def store(self) -> bool:
        return self.body.get("store", True) is not False


def parse_responses_request(body: Any, previous: dict[str, Any] | None) -> ResponsesRequest:
    """Check ``body``; ``previous`` is the stored record of its ``previous_response_id`` (found by
    the caller: a missing one is a 404 before this)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise invalid(f"unrecognized request argument supplied: {unknown[0]}"[:300], unknown[0])
    for flag in ("store", "stream", "background", "parallel_tool_calls"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise invalid(f"{flag} must be a boolean", flag)
    if body.get("background") and body.get("store") is False:
        raise invalid("a background response must be stored (store: true): it is fetched with "
                      "GET /v1/responses/{id}", "background")
    if body.get("truncation", "disabled") not in ("disabled", None):
        raise invalid("truncation must be 'disabled': this server does not drop earlier turns", "truncation")
    if body.get("include"):
        raise invalid("include is not supported by this server", "include")
    _check_metadata(body.get("metadata"))
    items = _input_items(body.get("input"))
    earlier = list(previous["conversation"]) if previous else []
    conversation = earlier + _chat_turns(items, _call_ids(earlier))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions must be a string", "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("parallel_tool_calls", "parallel_tool_calls"), ("user", "user")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    effort = _reasoning_effort(body.get("reasoning"))
    if effort is not None:
        chat["reasoning_effort"] = effort
    return ResponsesRequest(body, chat, items, conversation)


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if (not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS
            or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= MAX_METADATA_VALUE
                       for k, v in metadata.items())):
        raise invalid(f"metadata must be an object of at most {MAX_METADATA_PAIRS} string pairs (keys up to 64 "
                      f"characters, values up to {MAX_METADATA_VALUE})", "metadata")


def _input_items(value: Any) -> list[dict[str, Any]]:
    """The input as items with ids: a string is one user message."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise invalid("input must be a string or a non-empty list of input items", "input")
    if len(value) > MAX_INPUT_ITEMS:
        raise invalid(f"input has {len(value)} items; at most {MAX_INPUT_ITEMS} are accepted", "input")
    return [_item(item, f"input[{i}]") for i, item in enumerate(value)]


def _item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise invalid(f"{where} must be an object", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise invalid(f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}"[:300], f"{where}.role")
        return {"id": item.get("id") or f"msg_{uuid.uuid4().hex}", "type": "message", "role": role,
                "content": _parts(item.get("content"), role, where), "status": "completed"}
    if kind == "function_call":
        name, call_id, arguments = (_string(item, key, where) for key in ("name", "call_id", "arguments"))
        return {"id": item.get("id") or f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call_id,
                "name": name, "arguments": arguments, "status": "completed"}
    if kind == "function_call_output":
        call_id, output = _string(item, "call_id", where), item.get("output")
        if not isinstance(output, str):
            raise invalid(f"{where}.output must be a string", f"{where}.output")
        return {"id": item.get("id") or f"fco_{uuid.uuid4().hex}", "type": "function_call_output",
                "call_id": call_id, "output": output, "status": "completed"}
    if kind == "reasoning":  # earlier thoughts sent back: templates drop them from earlier turns
        return {**item, "id": item.get("id") or f"rs_{uuid.uuid4().hex}"}
    raise invalid(f"{where}.type {kind!r} is not supported; use message, function_call, function_call_output "
                  "or reasoning"[:300], f"{where}.type", code="unsupported_item_type")


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise invalid(f"{where}.{key} must be a non-empty string", f"{where}.{key}")
    return value


def _parts(content: Any, role: str, where: str) -> list[dict[str, Any]]:
    """Content as typed text parts (``output_text`` for the assistant, else ``input_text``)."""
    part_type = "output_text" if role == "assistant" else "input_text"
    if isinstance(content, str):
        return [{"type": part_type, "text": content, **({"annotations": []} if role == "assistant" else {})}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content parts", f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise invalid(f"{where}.content[{j}] must be an input_text or output_text part: this model reads text "
                          "only", f"{where}.content")
        parts.append(dict(part))
    return parts


def _call_ids(turns: list[dict[str, Any]]) -> set[str]:
    return {c["id"] for t in turns for c in t.get("tool_calls", ())}


def _chat_turns(items: list[dict[str, Any]], calls_made: set[str]) -> list[dict[str, Any]]:
    """Chat messages of the items: consecutive function calls join one assistant turn (after its
    text, if the turn before them is the assistant's); every output must answer a call made."""
    turns: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if item["type"] == "message":
            turns.append({"role": item["role"], "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not (turns and turns[-1]["role"] == "assistant"):
                turns.append({"role": "assistant", "content": ""})
            turns[-1].setdefault("tool_calls", []).append(call)
            calls_made.add(item["call_id"])
        elif item["type"] == "function_call_output":
            if item["call_id"] not in calls_made:
                raise invalid(f"input[{i}]: no function call with call_id {item['call_id']!r} comes before this "
                              "function_call_output (in this input or the previous response)"[:400],
                              f"input[{i}].call_id")
            turns.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return turns


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise invalid("tools must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise invalid(f"tools[{i}].type {kind!r} is not supported: this server runs function tools only"[:300],
                          f"tools[{i}].type")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice must be none, auto, required or {'type': 'function', 'name': ...}", "tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise invalid(f"text.format must be of type text, json_object or json_schema, got {json.dumps(fmt)[:100]}",
                  "text.format")


def _reasoning_effort(reasoning: Any) -> str | None:
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise invalid("reasoning must be an object such as {'effort': 'low'}", "reasoning")
    return reasoning.get("effort")
