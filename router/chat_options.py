"""A chat request's options for the chat template: vLLM's ``chat_template_kwargs`` (such as
Qwen3's ``{"enable_thinking": false}``) and OpenAI's ``reasoning_effort``, which reaches the
template as the variable of that name where the template reads one (gpt-oss-style templates)
and is refused where it would do nothing."""

from __future__ import annotations

from typing import Any, Mapping

from raylm.router.errors import invalid

REASONING_EFFORTS = ("minimal", "low", "medium", "high")
# Variables the router itself gives the template: a request may not replace them.
_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def template_variables(body: Mapping[str, Any], chat_template: str | None) -> dict[str, Any]:
    """The extra chat-template variables a request asks for."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise invalid("chat_template_kwargs must be an object of chat template variables", "chat_template_kwargs")
    reserved = sorted(_RESERVED.intersection(kwargs))
    if reserved:
        raise invalid(f"chat_template_kwargs may not set {reserved[0]!r}: the server sets it", "chat_template_kwargs")
    out = dict(kwargs)
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise invalid(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}"[:300],
                          "reasoning_effort")
        if "reasoning_effort" not in (chat_template or ""):
            raise invalid("reasoning_effort is not supported by this model: its chat template has no reasoning "
                          "effort (to turn thinking off, try chat_template_kwargs {\"enable_thinking\": false})",
                          "reasoning_effort")
        out["reasoning_effort"] = effort
    return out
