"""gpt-oss's harmony replies: a reply is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>THOUGHTS<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>ANSWER<|return|>

(the prompt's generation prompt wrote the first ``<|start|>assistant``; a recipient may also
stand before the channel: ``<|start|>assistant to=functions.NAME<|channel|>commentary json``).
The analysis channel is the thoughts (``reasoning_content``); the final channel, and commentary
without a recipient (the preambles gpt-oss writes before a call), the content; a message to
``functions.NAME`` a tool call (router/tool_format_harmony.py). ``<|call|>`` and ``<|return|>``
end generation (gpt-oss's stop tokens), so a reply holds at most one call.

A reply that does not begin with a header (a grammar constrained it from its first token) is
all final-channel text. The markers are special tokens: harmony replies are decoded with them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Sequence

from raylm.model.text.tokenizer import Tokenizer
from raylm.router.reasoning import ThoughtsStart
from raylm.router.reply_parser import ReplyDelta, ReplyParser
from raylm.router.tool_formats import Calls, CallStream, ToolFormat, before_partial_marker, json_values, new_call
from raylm.router.tools import ToolUse

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
FUNCTIONS = "functions."
_ENDINGS = (END, CALL, RETURN, START)  # what ends a message's body (a new <|start|> too)
_HEADER_STARTS = (CHANNEL, START, "to=")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
JOIN = "\n\n"  # between two messages of the same kind (two preambles, say)


@dataclasses.dataclass(frozen=True)
class Message:
    channel: str  # analysis, commentary or final ("final" for a reply without headers)
    recipient: str | None  # functions.NAME for a call
    body: str  # so far: without a trailing piece that may be the start of a marker while open
    ending: str | None  # the marker that ended it (None: open, or the reply ended in it)

    @property
    def function(self) -> str | None:
        """The function a message calls (None: not a call)."""
        return self.recipient[len(FUNCTIONS):] if self.recipient and self.recipient.startswith(FUNCTIONS) else None


def read_messages(text: str, finished: bool = True) -> list[Message]:
    """The messages of a reply so far (``finished``: the reply has ended, so nothing written is
    the start of a marker still to come)."""
    stripped = text.lstrip()
    headed = _headed(stripped, finished)
    if headed is None:
        return []  # a header may still be coming
    if not headed:
        return [Message("final", None, text if finished else text[: _before_endings(text)], None)] if text else []
    messages, at = [], len(text) - len(stripped)
    while True:
        header_end = text.find(MESSAGE, at)
        if header_end < 0:
            return messages  # a header still being written (or cut off: no message)
        header = text[at:header_end]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        body_at = header_end + len(MESSAGE)
        end, marker = min(((i, m) for m in _ENDINGS if (i := text.find(m, body_at)) >= 0), default=(len(text), None))
        if marker is None and not finished:
            end = body_at + _before_endings(text[body_at:])
        messages.append(Message(channel.group(1) if channel else "final", recipient and recipient.group(1),
                                text[body_at:end], marker))
        if marker is None:
            return messages
        at = end + len(marker)
        if marker != START and text.startswith(START, at):
            at += len(START)


def _headed(stripped: str, finished: bool) -> bool | None:
    """Whether a reply (without its leading blanks) begins with a header; None while it cannot
    tell yet. A recipient may come first (``to=functions.NAME<|channel|>...``): a reply that
    begins ``to=`` is a header once its channel comes, text if it ends without one."""
    if stripped.startswith((CHANNEL, START)) or stripped.startswith("to=") and CHANNEL in stripped:
        return True
    if not finished and any(s.startswith(stripped) or stripped.startswith(s) for s in _HEADER_STARTS):
        return None
    return False


def _before_endings(text: str) -> int:
    return min(before_partial_marker(text, marker) for marker in _ENDINGS)


def is_content(message: Message, tool_use: ToolUse | None) -> bool:
    """Whether a message is told as content: the final channel, a preamble, a message to a
    recipient that is not one of the offered functions (a call of one is a tool call)."""
    return message.channel != "analysis" and not calls_offered(message, tool_use)


def calls_offered(message: Message, tool_use: ToolUse | None) -> bool:
    return tool_use is not None and message.function in tool_use.names


def calls_of(messages: list[Message], tool_use: ToolUse) -> Calls:
    """The calls of a whole reply: its messages to offered functions, each body a JSON object
    (the arguments as written); [] where one is not (the reply is then all content)."""
    calls = []
    for message in messages:
        if calls_offered(message, tool_use):
            values = json_values(message.body)
            if values is None or len(values) != 1 or not isinstance(values[0], dict):
                return []
            calls.append(new_call(str(message.function), message.body.strip()))
    return calls


def joined(messages: list[Message], keep: Callable[[Message], bool]) -> str:
    """The bodies of the messages ``keep`` selects, one after another."""
    return JOIN.join(m.body for m in messages if keep(m))


class HarmonyReplyParser:
    """``ReplyParser`` for a harmony reply (router/reply_parser.py): its thoughts, content and
    calls told apart as the reply comes, streamed pieces joining into the whole reply's."""

    thinks = True  # gpt-oss always has an analysis channel (however short its effort)

    def __init__(self, calls: CallStream | None, tool_use: ToolUse | None):
        self._calls, self._tool_use = calls, tool_use
        self.text = ""  # the raw reply so far
        self.reasoning = ""  # told so far
        self.content = ""

    def feed(self, text: str, finished: bool = False) -> ReplyDelta:
        self.text += text
        messages = read_messages(self.text, finished)
        reasoning = joined(messages, lambda m: m.channel == "analysis")
        content = joined(messages, lambda m: is_content(m, self._tool_use))
        delta = ReplyDelta(_grown(self.reasoning, reasoning), _grown(self.content, content),
                           self._calls.deltas(self.text, finished) if self._calls else [])
        self.reasoning += delta.reasoning
        self.content += delta.content
        return delta

    @property
    def called(self) -> bool:
        return self._calls is not None and self._calls.called

    def reasoning_tokens(self, token_ids: list[int], tokenizer: Tokenizer) -> int:
        """``completion_tokens_details.reasoning_tokens`` (the thoughts re-encoded where the
        tokens cannot tell)."""
        count = reasoning_token_count(token_ids, tokenizer.token_to_id(END), self.text)
        return count if count is not None else len(tokenizer.encode(self.reasoning, False))

    def final(self) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """The thoughts, the content (None when empty beside calls) and the calls; a reply whose
        calls are not well-formed has their bodies in its content."""
        messages = read_messages(self.text)
        calls = calls_of(messages, self._tool_use) if self._tool_use else []
        content = joined(messages, lambda m: m.channel != "analysis" and (not calls or is_content(m, self._tool_use)))
        reasoning = joined(messages, lambda m: m.channel == "analysis") or None
        return reasoning, (content or None) if calls else content, calls


def reply_parser(thoughts: ThoughtsStart | None, tool_format: ToolFormat | None,
                 tool_use: ToolUse | None) -> ReplyParser | HarmonyReplyParser:
    """The parser of one reply: by channel for a harmony reply, else thoughts then answer."""
    if thoughts is not None and thoughts.channels:
        return HarmonyReplyParser(tool_format.stream(tool_use) if tool_format and tool_use else None, tool_use)
    return ReplyParser(thoughts, tool_format, tool_use)


def _grown(told: str, now: str) -> str:
    """What ``now`` adds to what was told (nothing where it no longer extends it)."""
    return now[len(told):] if now.startswith(told) else ""


def reasoning_token_count(token_ids: Sequence[int], end_id: int | None, text: str) -> int | None:
    """The tokens up to and including the ``<|end|>`` that closes the last analysis message (all
    of them when the reply ends in its thoughts); None where that cannot be told (``<|end|>`` is
    not one token)."""
    messages = read_messages(text)
    analysis = [i for i, m in enumerate(messages) if m.channel == "analysis"]
    if not analysis:
        return 0
    if messages[analysis[-1]].ending is None:
        return len(token_ids)
    ends = sum(1 for m in messages[: analysis[-1] + 1] if m.ending == END)
    positions = [i for i, t in enumerate(token_ids) if t == end_id]
    if end_id is None or messages[analysis[-1]].ending != END or len(positions) < ends:
        return None
    return positions[ends - 1] + 1
