"""A seeded generator of malformed and hostile OpenAI requests, and the checks every answer must pass.

Shared by the soak benchmark (``raylm.benchmarks.soak_bench``), the in-process fuzz test and the
HTTP fuzz test. Each request is raw bytes (so lone surrogates, invalid UTF-8, deep nesting and truncation
travel as a client would send them) plus a method and a path. Most requests are a valid body
with one or two fields replaced by a hostile value; the rest are transport quirks. Generated
work stays small: a body that would be valid asks for at most a few tokens.
"""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

# Values that are wrong, odd or extreme for some field; many are fine for others.
HOSTILE_VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2, 2**31, 2**63, 10**30, -(10**30), 0.5, -0.0, 1e308, -1e308, 3.7,
    "", " ", "x" * 5000, "josé", "😀🔥", "\u202eRTL", "a\u200bb", "e\u0301", "\x00", "\n\r\t", "0", "1e5", "true",
    [], [1], [[1], "a"], ["a", [1]], [None], [-1], [10**9], [{}], {}, {"a": 1}, {"type": "text"},
    {"include_usage": "maybe"}, {"include_usage": True}, [[]], [[1, 2], [3]],
]
# Raw JSON texts json.dumps cannot produce from a value (or that must stay unparsed).
RAW_VALUES = ['"\\ud800"', '"\\udfff tail"', '"ok\\ud83d"', "NaN", "Infinity", "-Infinity", "1e999",
              "[" * 5000 + "]" * 5000, '{"a":' * 200 + "1" + "}" * 200]
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
               "seed", "presence_penalty", "frequency_penalty", "stream", "stream_options", "user", "logit_bias",
               "logprobs", "top_logprobs", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos",
               "priority", "stop_token_ids", "skip_special_tokens", "include_stop_str_in_output",
               "response_format", "tools", "tool_choice", "store", "metadata", "bogus_field", "\u00fcnknown"]
COMPLETION_FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
                     "stream_options", "user", "logprobs", "echo", "suffix", "best_of", "top_k", "min_p",
                     "min_tokens", "ignore_eos", "priority", "stop_token_ids", "logit_bias", "bogus_field"]
MESSAGE_FIELDS = ["role", "content", "name", "tool_calls", "extra"]
# Fields whose valid values could ask for much work: kept small when a mutation leaves them valid.
_WORK_CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "min_tokens": 2, "logprobs": 2, "top_logprobs": 2}


@dataclasses.dataclass
class HostileRequest:
    method: str
    path: str
    body: bytes
    headers: dict[str, str | bytes]
    note: str  # what was done to it, for failure messages

    def describe(self) -> str:
        return f"{self.method} {self.path} [{self.note}] {self.body[:160]!r}"


def valid_body(path: str, model: str, rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": rng.choice([1, 2, 3]), "temperature": rng.choice([0, 0.7])}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": rng.choice(["Hi", "Say one word.", "¿Qué tal? 😀"])}]
    else:
        body["prompt"] = rng.choice(["Once upon a time", [1, 2, 3], ["a", "b"]])
    if rng.random() < 0.3:
        body["stream"] = True
    return body


def _mutate(body: dict[str, Any], path: str, rng: random.Random) -> tuple[str, str]:
    """Replace one field (maybe inside a message) by a hostile value; returns (json text, note)."""
    fields = CHAT_FIELDS if path == CHAT else COMPLETION_FIELDS
    field = rng.choice(fields)
    raw = rng.random() < 0.15
    value_text = rng.choice(RAW_VALUES) if raw else json.dumps(rng.choice(HOSTILE_VALUES))
    if path == CHAT and field == "messages" and rng.random() < 0.6:
        # Damage one message field instead of the whole list.
        message_field = rng.choice(MESSAGE_FIELDS)
        message = json.dumps({k: v for k, v in body["messages"][0].items() if k != message_field})[:-1]
        message += f'{", " if message != "{" else ""}"{message_field}": {value_text}}}'
        rest = json.dumps({k: v for k, v in body.items() if k != "messages"})[:-1]
        return f'{rest}, "messages": [{message}]}}', f"messages[0].{message_field}={value_text[:40]}"
    if not raw:
        value = json.loads(value_text)
        cap = _WORK_CAPS.get(field)
        if cap is not None and (value is None or (isinstance(value, int) and not isinstance(value, bool)
                                                  and 0 < value <= 10**6)):
            value_text = json.dumps(min(value or cap, cap))  # null may mean "the rest of the context"
    rest = json.dumps({k: v for k, v in body.items() if k != field})[:-1]
    return f'{rest}, "{field}": {value_text}}}', f"{field}={value_text[:40]}"


def _transport_quirk(model: str, rng: random.Random, max_request_bytes: int) -> HostileRequest:
    path = rng.choice([CHAT, COMPLETIONS])
    good = json.dumps(valid_body(path, model, rng)).encode()
    choices = [
        ("POST", path, b"", "empty body"),
        ("POST", path, good[: len(good) // 2], "truncated JSON"),
        ("POST", path, b"\xff\xfe\xfd", "invalid UTF-8"),
        ("POST", path, good.replace(b"Hi", b"H\xc3\x28"), "invalid UTF-8 inside a string"),
        ("POST", path, b"null", "null body"),
        ("POST", path, b"[1, 2]", "array body"),
        ("POST", path, b"[" * 20000 + b"]" * 20000, "deep nesting, top level"),
        ("POST", path, b'{"model": ' + b"[" * 20000 + b"]" * 20000 + b"}", "deep nesting in a field"),
        ("POST", path, b'{"\\ud800": 1, "model": "x"}', "lone surrogate in a key"),
        ("POST", path, b"{" + b'"a": 1, ' * 10 + b'"model": "\\udc00"}', "lone surrogate in model"),
        ("POST", path, b'{"model": "m"' + b" " * (max_request_bytes + 10) + b"}", "body over the limit"),
        ("GET", path, b"", "wrong method"),
        ("PUT", path, good, "wrong method"),
        ("DELETE", "/v1/models", b"", "wrong method"),
        ("POST", "/v1/nothing", good, "unknown path"),
        ("GET", "/v1/models/%F0%9F%98%80", b"", "unknown model path"),
        ("POST", "/v1/embeddings", good, "unsupported endpoint"),
    ]
    method, path, body, note = rng.choice(choices)
    return HostileRequest(method, path, body, {"Content-Type": "application/json"}, note)


def generate(count: int, model: str, seed: int, max_request_bytes: int = 1 << 20) -> list[HostileRequest]:
    """``count`` requests, the same for the same seed: 70 % mutated bodies, 10 % valid, 20 % transport."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.2:
            out.append(_transport_quirk(model, rng, max_request_bytes))
            continue
        path = rng.choice([CHAT, COMPLETIONS])
        body = valid_body(path, model, rng)
        if roll < 0.3:
            text, note = json.dumps(body), "valid"
        else:
            text, note = _mutate(body, path, rng)
            if rng.random() < 0.25:
                text, second = _mutate(json.loads(text) if _parses(text) else body, path, rng)
                note += f"; {second}"
        headers = {"Content-Type": "application/json"}
        if rng.random() < 0.05:
            headers["x-priority"] = rng.choice(["high", "²", "-1", "99", "ﾟ", "low"]).encode()  # raw UTF-8 bytes
        out.append(HostileRequest("POST", path, text.encode("utf-8", "surrogatepass"), headers, note))
    return out


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except (ValueError, RecursionError):
        return False


def check_answer(request: HostileRequest, status: int, headers: dict[str, str], body: bytes) -> str | None:
    """What is wrong with the answer to ``request``, or None: no 5xx except 503 with Retry-After,
    every error is OpenAI's error JSON, every 200 is a well-formed completion or event stream."""
    where = request.describe()
    if status >= 500 and not (status == 503 and headers.get("retry-after")):
        return f"{status} for {where}: {body[:300]!r}"
    if status >= 400:
        try:
            error = json.loads(body)["error"]
        except (ValueError, KeyError, TypeError):
            return f"{status} without OpenAI error JSON for {where}: {body[:300]!r}"
        if set(error) != {"message", "type", "param", "code"} or not error["message"]:
            return f"{status} with a malformed error object for {where}: {error}"
        return None
    if status != 200:
        return f"unexpected status {status} for {where}"
    if request.path == "/v1/models" or request.path.startswith("/v1/models/"):
        return None
    text = body.decode("utf-8")
    if "text/event-stream" in headers.get("content-type", ""):
        events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"stream without [DONE] for {where}: {text[-300:]!r}"
        for event in events[:-1]:
            payload = json.loads(event)
            if "error" in payload:
                return f"stream ended in an error event for {where}: {payload}"
        return None
    payload = json.loads(text)
    if not payload.get("choices"):
        return f"200 without choices for {where}: {text[:300]!r}"
    return None
