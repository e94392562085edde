"""A Messages API request, validated and restated as the chat completions body it means.

The router's chat pipeline (router/protocol.py) then renders, tokenizes and checks it as it
does every chat request, so the template, tool-call format, reasoning parser, limits and
sampling checks are the same for both APIs. What differs is the request's shape:

- ``system`` (a string or text blocks) is the first message;
- a user turn's ``tool_result`` blocks become ``tool`` messages (they come first in the turn,
  as Anthropic requires), its ``text`` blocks and text ``document`` blocks (title, context and
  text as paragraphs) one user message after them; an error result
  reaches the model as ``Error: <content>`` (chat templates have no error flag);
- an assistant turn's ``text``, ``tool_use`` (as ``tool_calls``) and ``thinking`` blocks (as
  ``reasoning_content``, for templates that render earlier thoughts) make one assistant message;
- ``tools`` / ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``; ``disable_parallel_tool_use``)
  become function tools; ``stop_sequences`` is ``stop``; ``metadata.user_id`` is ``user``;
- ``thinking`` sets the template's ``enable_thinking`` where the template reads it. A model that
  always thinks may not be told not to, one with no reasoning parser may not be told to think:
  both are 400s. ``budget_tokens`` (a positive integer below ``max_tokens``) bounds the thoughts
  (the chat request's ``thinking_token_budget``: router/reasoning_grammar.py) where the model
  ends them with ``</think>`` as one token; elsewhere (gpt-oss's channels, a ``</think>`` spelled
  in several tokens) only ``max_tokens`` bounds them, as vLLM and llama.cpp serve it.

``cache_control`` marks on blocks are accepted and need nothing: the prefix cache is automatic.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from raylm.router.errors import OpenAIError, invalid

_FIELDS = {"model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_p", "top_k",
           "tools", "tool_choice", "thinking", "metadata"}
_COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice", "thinking"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def chat_body(body: Any, reasoning_parser: str, chat_template: str | None, count_only: bool = False,
              budget_enforceable: bool = False) -> dict[str, Any]:
    """The chat completions body of a ``/v1/messages`` body (``count_only``: of a
    ``/v1/messages/count_tokens`` body, which has no ``max_tokens`` and no sampling fields).
    ``budget_enforceable``: the model's thoughts can be held to ``budget_tokens``."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - (_COUNT_FIELDS if count_only else _FIELDS))
    if unknown:
        raise invalid(f"{unknown[0]}: Extra inputs are not permitted", unknown[0])
    out: dict[str, Any] = {"model": body.get("model"), "messages": _system(body.get("system")) + _messages(body)}
    if not count_only:
        max_tokens = body.get("max_tokens")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise invalid("max_tokens: a positive integer is required", "max_tokens")
        out["max_tokens"] = max_tokens
        for field in ("temperature", "top_p", "top_k", "stream"):
            if body.get(field) is not None:
                out[field] = body[field]
        temperature = out.get("temperature")
        if isinstance(temperature, (int, float)) and not 0 <= temperature <= 1:
            raise invalid(f"temperature: must be in [0, 1], got {temperature}", "temperature")
        stops = body.get("stop_sequences")
        if stops not in (None, []):
            out["stop"] = stops
        out.update(_metadata(body.get("metadata")))
    out.update(_tools(body.get("tools"), body.get("tool_choice")))
    thinking, budget = _thinking(body.get("thinking"), out.get("max_tokens"), reasoning_parser, chat_template)
    if thinking is not None:
        out["chat_template_kwargs"] = {"enable_thinking": thinking}
    if budget is not None and budget_enforceable and not count_only:
        out["thinking_token_budget"] = budget
    return out


def _text_blocks(blocks: Any, where: str) -> str:
    """A string, or text blocks joined (``cache_control`` and ``citations`` allowed, unused)."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise invalid(f"{where}: must be a string or a list of text blocks", where)
    texts = []
    for i, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise invalid(f"{where}.{i}: must be a text block {{'type': 'text', 'text': ...}}", f"{where}.{i}")
        texts.append(block["text"])
    return "".join(texts)


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = _text_blocks(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages: a non-empty list of user and assistant messages is required", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise invalid(f"{where}.role: must be 'user' or 'assistant'", f"{where}.role")
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise invalid(f"{where}.{unknown[0]}: Extra inputs are not permitted", f"{where}.{unknown[0]}")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": message["role"], "content": content})
        elif not isinstance(content, list):
            raise invalid(f"{where}.content: must be a string or a list of content blocks", f"{where}.content")
        elif message["role"] == "user":
            out += _user_turn(content, where)
        else:
            out.append(_assistant_turn(content, where))
    return out


def _block_type(block: Any, where: str, allowed: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in allowed:
        raise invalid(f"{where}.type: this server reads {', '.join(allowed)} blocks here, got {kind!r}"[:300],
                      f"{where}.type")
    return kind


def _user_turn(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """Tool results (each a ``tool`` message), then the turn's text as one user message."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _block_type(block, at, ("text", "document", "tool_result"))
        if kind != "tool_result":  # (text, whether it is a document: its own paragraphs)
            texts.append((_text_blocks([block], f"{where}.content"), False) if kind == "text"
                         else (_document(block, at), True))
            continue
        if texts:
            raise invalid(f"{at}: tool_result blocks must come before any text in a user message", at)
        call_id = block.get("tool_use_id")
        if not isinstance(call_id, str) or not call_id:
            raise invalid(f"{at}.tool_use_id: the id of the tool_use block this result answers is required",
                          f"{at}.tool_use_id")
        content = _text_blocks(block.get("content", ""), f"{at}.content")
        is_error = block.get("is_error", False)
        if not isinstance(is_error, bool):
            raise invalid(f"{at}.is_error: must be a boolean", f"{at}.is_error")
        results.append({"role": "tool", "tool_call_id": call_id,
                        "content": f"Error: {content}" if is_error else content})
    # Text blocks join as they are; a document stands a blank line apart from the blocks beside it.
    text = "".join(("\n\n" if i and (document or texts[i - 1][1]) else "") + piece
                   for i, (piece, document) in enumerate(texts))
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def _document(block: dict[str, Any], at: str) -> str:
    """A text document (``source`` of type ``text``, or ``content`` text blocks) as the text the
    model reads: its title and context, if given, then the document, as separate paragraphs.
    PDFs and files are refused (this server reads text), and so are citations (it cannot cite)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "text":
        if not isinstance(source.get("data"), str):
            raise invalid(f"{at}.source.data: a text document's data must be a string", f"{at}.source.data")
        text = source["data"]
    elif kind == "content":
        text = _text_blocks(source.get("content"), f"{at}.source.content")
    else:
        raise invalid(f"{at}.source.type: this server reads text documents ('text' or 'content' sources), got "
                      f"{kind!r}"[:300], f"{at}.source.type")
    if isinstance(block.get("citations"), dict) and block["citations"].get("enabled"):
        raise invalid(f"{at}.citations: citations are not supported by this server", f"{at}.citations")
    parts = [block.get(key) for key in ("title", "context")]
    for key, part in zip(("title", "context"), parts):
        if part is not None and not isinstance(part, str):
            raise invalid(f"{at}.{key}: must be a string", f"{at}.{key}")
    return "\n\n".join(part for part in (*parts, text) if part)


def _assistant_turn(blocks: list[Any], where: str) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = _block_type(block, at, ("text", "tool_use", "thinking"))
        if kind == "text":
            texts.append(_text_blocks([block], f"{where}.content"))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise invalid(f"{at}.thinking: must be a string", f"{at}.thinking")
            thoughts.append(block["thinking"])
        else:
            name, call_id, arguments = block.get("name"), block.get("id"), block.get("input")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(arguments, dict):
                raise invalid(f"{at}: a tool_use block needs an id, a name and an input object", at)
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    return message


def _tools(tools: Any, choice: Any) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as the chat API's function tools."""
    out: dict[str, Any] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools: must be a list of {'name', 'description', 'input_schema'}", "tools")
        functions = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
                raise invalid(f"tools.{i}: only custom tools ({{'name', 'description', 'input_schema'}}) are "
                              "served here", f"tools.{i}")
            unknown = sorted(set(tool) - {"type", "name", "description", "input_schema", "cache_control"})
            if unknown:
                raise invalid(f"tools.{i}.{unknown[0]}: Extra inputs are not permitted", f"tools.{i}.{unknown[0]}")
            if not isinstance(tool.get("input_schema"), dict):
                raise invalid(f"tools.{i}.input_schema: a JSON schema object is required", f"tools.{i}.input_schema")
            function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            functions.append({"type": "function", "function": function})
        out["tools"] = functions
    if choice is None:
        return out
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in (*_TOOL_CHOICES, "tool"):
        raise invalid("tool_choice: must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                      "tool_choice")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise invalid("tool_choice.name: the name of the tool to call is required", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        out["tool_choice"] = _TOOL_CHOICES[kind]
    disable_parallel = choice.get("disable_parallel_tool_use")
    if disable_parallel is not None:
        if not isinstance(disable_parallel, bool):
            raise invalid("tool_choice.disable_parallel_tool_use: must be a boolean",
                          "tool_choice.disable_parallel_tool_use")
        if tools is not None:
            out["parallel_tool_calls"] = not disable_parallel
    return out


def _metadata(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        return {}
    if not isinstance(metadata, dict) or set(metadata) - {"user_id"}:
        raise invalid("metadata: only {'user_id': ...} is accepted", "metadata")
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise invalid("metadata.user_id: must be a string", "metadata.user_id")
    return {"user": user} if user else {}


def _thinking(thinking: Any, max_tokens: int | None, reasoning_parser: str, chat_template: str | None
              ) -> tuple[bool | None, int | None]:
    """The template's ``enable_thinking`` for ``thinking`` (None: leave the template's default),
    and its ``budget_tokens`` (None: thinking not enabled)."""
    if thinking is None:
        return None, None
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled"):
        raise invalid("thinking: must be {'type': 'enabled', 'budget_tokens': N} or {'type': 'disabled'}", "thinking")
    switchable = "enable_thinking" in (chat_template or "")
    if kind == "disabled":
        if reasoning_parser != "none" and not switchable:
            raise invalid("thinking: this model always thinks (its chat template cannot turn thinking off)",
                          "thinking")
        return (False if switchable else None), None
    budget = thinking.get("budget_tokens")
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise invalid("thinking.budget_tokens: a positive integer is required", "thinking.budget_tokens")
    if max_tokens is not None and budget >= max_tokens:
        raise invalid("thinking.budget_tokens: must be less than max_tokens", "thinking.budget_tokens")
    if reasoning_parser == "none":
        raise OpenAIError(400, "thinking: this model does not think (no reasoning parser: set the deploy file's "
                          "model.reasoning_parser for a reasoning model)", param="thinking")
    return (True if switchable else None), budget
