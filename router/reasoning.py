"""Reasoning output: a thinking model's thoughts apart from its answer.

Qwen3 and DeepSeek-R1 write their thoughts between ``<think>`` and ``</think>``, then the
answer. A ``ReasoningSplitter`` is fed a reply's text as it comes (any split, a tag may arrive
in pieces) and tells which part is reasoning and which is content, so the chat API can put
the thoughts in ``reasoning_content`` and stream them as their own deltas; other endpoints
(Responses, Messages) reuse it as is.

The families differ in where the thoughts begin:

- ``qwen3``: the model opens ``<think>`` itself, unless the prompt already did (Qwen3's
  template with ``enable_thinking: false`` writes an empty ``<think></think>`` block into the
  prompt, so the reply is all answer).
- ``deepseek_r1``: the template's generation prompt opens ``<think>``, so the reply starts in
  the thoughts (a ``<think>`` the model repeats at the start is dropped).

A reply that ends inside its thoughts (cut short by ``max_tokens``) is all reasoning: what was
streamed as reasoning stays reasoning.

``harmony`` (gpt-oss, whose template writes ``<|channel|>``): the thoughts are the analysis
channel of a reply made of messages; router/harmony.py reads such replies whole.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

REASONING_PARSERS = ("qwen3", "deepseek_r1", "harmony", "none")
HARMONY_CHANNEL = "<|channel|>"
OPEN, CLOSE = "<think>", "</think>"


def detect_reasoning_parser(chat_template: str | None) -> str:
    """The parser a chat template implies: a template whose generation prompt opens ``<think>``
    is DeepSeek-R1's, one that knows ``<think>`` otherwise is Qwen3's; one that writes harmony
    channels is gpt-oss's; else none."""
    if chat_template and HARMONY_CHANNEL in chat_template:
        return "harmony"
    if not chat_template or OPEN not in chat_template:
        return "none"
    generation = chat_template[chat_template.rfind("add_generation_prompt"):]
    return "deepseek_r1" if OPEN in generation and "enable_thinking" not in generation else "qwen3"


def reasoning_parser_for(name: str, chat_template: str | None, tool_format: str) -> str:
    """The deploy file's ``model.reasoning_parser``, ``auto`` resolved from the chat template.
    A harmony reply's channels hold both its thoughts and its calls: both parsers are harmony
    or neither (``tool_format``: the tool-call format's name)."""
    parser = detect_reasoning_parser(chat_template) if name == "auto" else name
    if parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be auto or one of {REASONING_PARSERS}, got {name!r}")
    if (parser == "harmony") != (tool_format == "harmony"):
        raise ValueError(f"harmony replies need both parsers harmony: reasoning_parser {parser}, tool_call_parser "
                         f"{tool_format}")
    return parser


def prompt_opens_thoughts(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an open ``<think>`` block (the reply continues it)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


def prompt_closes_thoughts(prompt_text: str) -> bool:
    """Whether a rendered prompt ends with a closed, empty-of-answer ``<think>`` block: thinking
    was turned off in the template (Qwen3's ``enable_thinking: false``)."""
    tail = prompt_text.rstrip()
    return tail.endswith(CLOSE) and prompt_text.rfind(OPEN) < tail.rfind(CLOSE)


@dataclasses.dataclass(frozen=True)
class Split:
    """What one piece of a reply adds to its reasoning and to its content."""

    reasoning: str = ""
    content: str = ""


class ReasoningSplitter:
    """Splits one reply, fed in pieces, into reasoning and content.

    ``in_thoughts``: whether the reply starts inside the thoughts (the prompt opened them). A
    ``<think>`` at the very start of the reply opens them (or, repeated, is dropped). A piece
    that may be the start of a tag is held back until the next piece tells."""

    def __init__(self, in_thoughts: bool):
        self.in_thoughts = in_thoughts
        self.closed = False  # whether the thoughts ended (</think> seen)
        self._at_start = True  # no text told yet: a <think> may still open the reply
        self._pending = ""  # text not yet told: it may be the start of a tag
        self._strip_content = False  # the whitespace between </think> and the answer is neither

    def feed(self, text: str, finished: bool = False) -> Split:
        """The reasoning and content that ``text`` (the next piece of the reply) adds; with
        ``finished``, also what was held back."""
        pending = self._pending + text
        reasoning: list[str] = []
        content: list[str] = []
        while pending:
            if self._at_start:
                stripped = pending.lstrip()
                if not finished and (not stripped or OPEN.startswith(stripped)):
                    break  # maybe a <think> still coming
                self._at_start = False
                if stripped.startswith(OPEN):
                    self.in_thoughts = True
                    pending = stripped[len(OPEN):]
                    continue
            if not self.in_thoughts:
                piece = pending.lstrip() if self._strip_content else pending
                self._strip_content = self._strip_content and not piece
                content.append(piece)
                pending = ""
                break
            end = pending.find(CLOSE)
            if end >= 0:
                reasoning.append(pending[:end])
                pending = pending[end + len(CLOSE):]
                self.in_thoughts, self.closed, self._strip_content = False, True, True
                continue
            keep = 0 if finished else _partial_tag(pending, CLOSE)
            reasoning.append(pending[: len(pending) - keep])
            pending = pending[len(pending) - keep:]
            break
        self._pending = pending
        return Split("".join(reasoning), "".join(content))


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def reasoning_token_count(token_ids: Sequence[int], close_id: int | None, splitter: ReasoningSplitter) -> int | None:
    """``completion_tokens_details.reasoning_tokens``: the tokens up to and including the one
    that closed the thoughts; all of them when the reply ended inside its thoughts, none when it
    had none. None when this cannot be told exactly (the close tag is not one token)."""
    if splitter.in_thoughts:
        return len(token_ids)
    if not splitter.closed:
        return 0
    if close_id is None or close_id not in token_ids:
        return None
    return list(token_ids).index(close_id) + 1


@dataclasses.dataclass(frozen=True)
class ThoughtsStart:
    """How a request's reply begins, as its rendered prompt left it (see the module docstring)."""

    in_thoughts: bool
    channels: bool = False  # a harmony reply: its thoughts are a channel (router/harmony.py)

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.in_thoughts)


def thoughts_start(parser: str, prompt_text: str) -> ThoughtsStart | None:
    """For a reasoning ``parser`` and a rendered prompt: how the reply begins; None when it
    holds no thoughts (no parser, or the template turned thinking off)."""
    if parser == "harmony":
        return ThoughtsStart(in_thoughts=False, channels=True)
    if parser == "none" or prompt_closes_thoughts(prompt_text):
        return None
    if parser == "deepseek_r1" or prompt_opens_thoughts(prompt_text):
        return ThoughtsStart(in_thoughts=True)
    return ThoughtsStart(in_thoughts=False)
