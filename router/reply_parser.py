"""One generated reply, fed its text as the worker sends it, told apart into what every
agent-facing API reports separately: the thoughts (reasoning), the answer (content) and the
tool calls. The chat API streams its deltas as ``reasoning_content`` / ``content`` /
``tool_calls``; the Responses and Messages APIs can map the same deltas to their own events.

Thoughts come first (router/reasoning.py); tool calls are read from the answer only, in the
model family's format (router/tool_formats.py). Streamed content stops before anything that
is or may become a call; a reply that ends without a call sends the rest as content.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from raylm.model.text.tokenizer import Tokenizer
from raylm.router.reasoning import CLOSE, ReasoningSplitter, ThoughtsStart, reasoning_token_count
from raylm.router.tool_formats import CallStream, ToolFormat
from raylm.router.tools import ToolUse


@dataclasses.dataclass(frozen=True)
class ReplyDelta:
    """What one piece of a reply adds: thoughts, answer text and ``tool_calls`` entries
    (OpenAI's stream shape: ``{"index", "id", "type", "function": {"name", "arguments"}}``,
    then ``{"index", "function": {"arguments": piece}}``)."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class ReplyParser:
    """Parses one reply fed in pieces (``feed``) and tells the whole of it (``final``)."""

    def __init__(self, thoughts: ThoughtsStart | None = None, tool_format: ToolFormat | None = None,
                 tool_use: ToolUse | None = None):
        self._splitter: ReasoningSplitter | None = thoughts.splitter() if thoughts else None
        self._format = tool_format if tool_use is not None else None
        self._tool_use = tool_use
        self._calls: CallStream | None = self._format.stream(tool_use) if self._format and tool_use else None
        self.reasoning = ""  # the thoughts so far
        self.answer = ""  # the text after the thoughts so far (content and calls)
        self.streamed = 0  # characters of the answer told as content so far

    @property
    def thinks(self) -> bool:
        """Whether the reply may hold thoughts (a reasoning model that was not told not to think)."""
        return self._splitter is not None

    def feed(self, text: str, finished: bool = False) -> ReplyDelta:
        """The deltas of the next piece ``text``; ``finished`` on the reply's last piece (which
        then also tells what was held back)."""
        if self._splitter is not None:
            split = self._splitter.feed(text, finished)
            reasoning, answer = split.reasoning, split.content
        else:
            reasoning, answer = "", text
        self.reasoning += reasoning
        self.answer += answer
        if self._calls is None or self._format is None:
            self.streamed = len(self.answer)
            return ReplyDelta(reasoning, answer)
        calls = self._calls.deltas(self.answer, finished)
        visible = self.answer if finished and not self.called else self.answer[: self._format.held_back(self.answer)]
        content = visible[self.streamed:] if len(visible) > self.streamed else ""
        self.streamed = max(self.streamed, len(visible))
        return ReplyDelta(reasoning, content, calls)

    @property
    def called(self) -> bool:
        """Whether a streamed call has been told (the reply then finishes with tool_calls)."""
        return self._calls is not None and self._calls.called

    def reasoning_tokens(self, token_ids: list[int], tokenizer: Tokenizer) -> int:
        """``completion_tokens_details.reasoning_tokens``: counted up to the token that closed the
        thoughts; where ``</think>`` is not one token, the thoughts' text re-encoded (an estimate)."""
        if self._splitter is None:
            return 0
        count = reasoning_token_count(token_ids, tokenizer.token_to_id(CLOSE), self._splitter)
        return count if count is not None else len(tokenizer.encode(self.reasoning + CLOSE, False))

    def final(self) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """The whole reply: its thoughts (None without a reasoning parser or thoughts), its
        content and its calls (content before the first call, None when empty, if any)."""
        reasoning = (self.reasoning or None) if self.thinks else None
        if self._format is None or self._tool_use is None:
            return reasoning, self.answer, []
        content, calls = self._format.parse(self.answer, self._tool_use)
        return reasoning, (content if calls else self.answer), calls
