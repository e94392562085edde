"""Shape worker deltas into OpenAI responses: streaming chunks and the final JSON with usage.

Choice index ``i * n + j`` is completion ``j`` of prompt ``i`` (the completions API's rule for
a list of prompts); chat always has one prompt. When a chat request offers tools, the calls a
reply makes are read back (``router/reply_parser.py``) into ``tool_calls`` with ``finish_reason:
tool_calls``; streamed, the content before a call goes out as it comes, then each call's name
and its arguments piece by piece, as OpenAI streams them.
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import numpy as np

from raylm.model.text.tokenizer import Tokenizer
from raylm.router.harmony import HarmonyReplyParser, reply_parser
from raylm.router.protocol import ParsedRequest
from raylm.router.reply_parser import ReplyDelta, ReplyParser
from raylm.workers.wire.replica_protocol import ChoiceDelta, GenerateChunk


@dataclasses.dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    hidden_states: np.ndarray | None = None  # return_hidden_states: [layers, positions, D]
    reply: ReplyParser | HarmonyReplyParser = dataclasses.field(default_factory=ReplyParser)  # thoughts, content, calls
    last: ReplyDelta = ReplyDelta()  # what the latest delta added to each


class ResponseBuilder:
    """Accumulates one request's deltas; emits stream chunks and the final response."""

    def __init__(self, parsed: ParsedRequest, response_id: str, created: int, tokenizer: Tokenizer):
        self.parsed = parsed
        self.id = response_id
        self.created = created
        self.tokenizer = tokenizer
        n = parsed.params.n
        self.choices = [_Choice(reply=reply_parser(parsed.thoughts, parsed.tool_format, parsed.tool_use))
                        for _ in range(n * len(parsed.prompts))]
        self.cached_tokens = [0] * len(parsed.prompts)
        self._token_text: dict[int, str] = {}
        if parsed.echo:
            for i, ids in enumerate(parsed.prompts):
                text = parsed.prompt_texts[i]
                echoed = text if text is not None else tokenizer.decode(ids, skip_special_tokens=False)
                for j in range(n):
                    self.choices[i * n + j].text = echoed

    # -- accumulation ----------------------------------------------------------------------------------
    def add(self, prompt_index: int, chunk: GenerateChunk) -> list[tuple[int, ChoiceDelta]]:
        """Record a worker chunk; returns (choice index, delta) pairs for streaming."""
        self.cached_tokens[prompt_index] = chunk.num_cached_tokens
        out = []
        for delta in chunk.choices:
            index = prompt_index * self.parsed.params.n + delta.index
            choice = self.choices[index]
            choice.text += delta.text
            choice.token_ids += delta.token_ids
            if delta.logprobs:
                choice.logprobs += delta.logprobs
            if delta.finish_reason is not None:
                choice.finish_reason = _openai_finish_reason(delta.finish_reason)
            choice.last = choice.reply.feed(delta.text, delta.finish_reason is not None)
            if delta.hidden_states is not None:
                choice.hidden_states = delta.hidden_states
            out.append((index, delta))
        return out

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p) for p in self.parsed.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)},
            **self._reasoning_usage(),
        }

    def _reasoning_usage(self) -> dict[str, Any]:
        """``completion_tokens_details.reasoning_tokens`` (each reply parser counts its own)."""
        if self.parsed.thoughts is None:
            return {}
        total = sum(c.reply.reasoning_tokens(c.token_ids, self.tokenizer) for c in self.choices)
        return {"completion_tokens_details": {"reasoning_tokens": total}}

    # -- final responses -----------------------------------------------------------------------------
    def final(self) -> dict[str, Any]:
        if self.parsed.kind == "chat":
            choices = []
            for i, c in enumerate(self.choices):
                reasoning, content, calls = c.reply.final()
                message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
                if c.reply.thinks:  # OpenAI-compatible servers' name, and vLLM's newer one
                    message["reasoning_content"] = message["reasoning"] = reasoning
                finish = c.finish_reason
                if calls:
                    message.update(content=content, tool_calls=calls)
                    finish = _finish_with_calls(finish)
                choices.append({"index": i, "message": message, "logprobs": self._chat_logprobs(c.token_ids, c.logprobs),
                                "finish_reason": finish})
            obj = "chat.completion"
        else:
            choices = [
                {
                    "index": i,
                    "text": c.text,
                    "logprobs": self._completion_logprobs(c.token_ids, c.logprobs, 0),
                    "finish_reason": c.finish_reason,
                    **self._hidden_states(c.hidden_states),
                }
                for i, c in enumerate(self.choices)
            ]
            obj = "text_completion"
        return {**self._envelope(obj), "choices": choices, "usage": self.usage()}

    # -- streaming -------------------------------------------------------------------------------------
    def stream_start(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role per choice; echo opens a completion stream."""
        if self.parsed.kind == "chat":
            return [
                self._stream_chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None})
                for i in range(len(self.choices))
            ]
        if self.parsed.echo:
            return [
                self._stream_chunk({"index": i, "text": c.text, "logprobs": None, "finish_reason": None})
                for i, c in enumerate(self.choices)
            ]
        return []

    def stream_delta(self, index: int, delta: ChoiceDelta) -> dict[str, Any] | None:
        """The chunk for one choice's delta (None when there is nothing to tell the client)."""
        finish = _openai_finish_reason(delta.finish_reason) if delta.finish_reason else None
        last = self.choices[index].last
        text, calls, reasoning = last.content, last.tool_calls, last.reasoning
        if finish is not None and self.choices[index].reply.called:
            finish = _finish_with_calls(finish)
        hidden = self._hidden_states(delta.hidden_states)
        if (not text and not calls and not reasoning and finish is None and not hidden
                and not (self.parsed.logprobs is not None and delta.token_ids)):
            return None
        if self.parsed.kind == "chat":
            message: dict[str, Any] = {"content": text} if text else {}
            if reasoning:
                message["reasoning_content"] = message["reasoning"] = reasoning
            if calls:
                message["tool_calls"] = calls
            choice = {
                "index": index,
                "delta": message,
                "logprobs": self._chat_logprobs(delta.token_ids, delta.logprobs or []),
                "finish_reason": finish,
            }
        else:
            offset = len(self.choices[index].text) - len(delta.text)
            choice = {
                "index": index,
                "text": delta.text,
                "logprobs": self._completion_logprobs(delta.token_ids, delta.logprobs or [], offset),
                "finish_reason": finish,
                **hidden,
            }
        return self._stream_chunk(choice)

    def _hidden_states(self, hidden: np.ndarray | None) -> dict[str, Any]:
        """The ``hidden_states`` field of a completion choice that asked for them: the layers,
        the array's shape and its float32 bytes (little-endian, C order), base64-encoded."""
        if hidden is None:
            return {}
        data = np.ascontiguousarray(hidden, dtype="<f4")
        return {"hidden_states": {"layers": list(self.parsed.params.return_hidden_states), "shape": list(data.shape),
                                  "dtype": "float32", "data": base64.b64encode(data.tobytes()).decode("ascii")}}

    def stream_usage(self) -> dict[str, Any]:
        return {**self._envelope(self._chunk_object()), "choices": [], "usage": self.usage()}

    def _stream_chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {**self._envelope(self._chunk_object()), "choices": [choice]}
        if self.parsed.include_usage:
            chunk["usage"] = None
        return chunk

    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.parsed.kind == "chat" else "text_completion"

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.parsed.model,
                "system_fingerprint": None}

    # -- logprobs --------------------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda item: -item[1])[: self.parsed.logprobs]

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        content = []
        for token_id, entry in zip(token_ids, logprobs):
            token = self._token(token_id)
            content.append({
                "token": token,
                "logprob": entry[token_id],
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [
                    {"token": self._token(t), "logprob": lp, "bytes": list(self._token(t).encode("utf-8"))}
                    for t, lp in self._top(entry)
                ],
            })
        return {"content": content, "refusal": None}

    def _completion_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]], offset: int
    ) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, logprobs):
            token = self._token(token_id)
            tokens.append(token)
            token_logprobs.append(entry[token_id])
            tops.append({self._token(t): lp for t, lp in self._top(entry)})
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _finish_with_calls(reason: str) -> str:
    """A reply that made tool calls finishes with tool_calls, unless it was cut short (length,
    with its complete calls): then it keeps saying so."""
    return "length" if reason == "length" else "tool_calls"


def _openai_finish_reason(reason: str) -> str:
    """The engine says stop / length / abort; OpenAI clients know stop and length."""
    return "length" if reason == "length" else "stop"
