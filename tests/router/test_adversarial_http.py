"""Hostile and unusual input over real HTTP, each case with its one right answer.

``test_hostile_http.py`` fuzzes with the seeded generator and checks the rules every answer must
follow (no 5xx but 503 with Retry-After, OpenAI error JSON); it cannot tell a right 400 from a
valid request wrongly refused. Here:

- the cases issue 18 found and the transport quirks each get their exact 4xx with OpenAI error
  JSON (deep nesting anywhere, lone surrogates in values, keys and ``model``, invalid UTF-8,
  wrong types, out-of-range values, unknown fields, wrong methods and paths);
- valid but unusual input must be *served*: any Unicode text (non-ASCII, emoji, RTL, zero-width,
  combining marks, NUL) in ``user``, ``name``, content, prompt and stop strings, and any sampling
  parameter inside its documented range however extreme (tiny temperatures, huge seeds, top_k at
  int32 max...). Only a real engine behind the router can fail these (NaN logits, seed
  overflow, metric tags built from ``user``), so the in-process fuzz with a fake worker cannot.

After each test every router slot, lease and queue entry and every worker request and KV block
is back to zero, and a greedy request answers exactly as before the test.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raylm.benchmarks.soak_bench import greedy_answer, wait_back_to_baseline

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ANY = object()  # any ``param`` in the error is fine
DEEP = 10_000
VOCAB = 49152
# Valid text that once broke the server (issue 18) or plausibly could: non-ASCII, emoji with
# joiners and skin tones, RTL with an override, zero-width, combining marks, CJK, NUL, specials.
ODD_TEXT = ["josé", "😀🔥", "👩‍👩‍👧‍👦👍🏽", "\u202eשלום עולם", "a\u200bb\u200d", "e\u0301\u0327", "中文テキスト",
            "nul\u0000byte", "<|im_start|>system\nx<|im_end|>", "\ufeffbom", "\U0010fffd"]


def _show(data: bytes | str, limit: int = 200) -> str:
    """A request or answer shortened for a failure message (bodies here can be 20 kB)."""
    text = data if isinstance(data, str) else repr(data)
    return text if len(text) <= limit else f"{text[:limit // 2]} ...[{len(text)} chars]... {text[-limit // 4:]}"


@pytest.fixture(scope="module")
def greedy_before(raylm_app) -> str:
    return greedy_answer(raylm_app.base_url, raylm_app.model)


def _assert_nothing_held_and_greedy_unchanged(app, before: str) -> None:
    held = wait_back_to_baseline(app.config.name)
    assert held["router_replicas"] > 0 and held["worker_replicas"] > 0, held
    assert not any(v for k, v in held.items() if not k.endswith("_replicas")), f"still held after the test: {held}"
    assert greedy_answer(app.base_url, app.model) == before


def _check_error_json(response: httpx.Response, where: str) -> dict:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        raise AssertionError(f"{response.status_code} without OpenAI error JSON for {where}: "
                             f"{_show(response.content)}") from None
    assert set(error) == {"message", "type", "param", "code"} and error["message"], f"{where}: {error}"
    assert "Traceback" not in error["message"], f"{where}: {error}"
    return error


def _check_served(response: httpx.Response, where: str, stream: bool) -> dict | None:
    """A 200 with a well-formed completion (or an overload refusal with Retry-After); returns the
    final JSON (the last chunk's for streams) or None when refused."""
    if response.status_code in (429, 503) and response.headers.get("retry-after"):
        _check_error_json(response, where)
        return None
    assert response.status_code == 200, f"{response.status_code} for valid {where}: {_show(response.content)}"
    if not stream:
        payload = response.json()
        assert payload.get("choices"), f"200 without choices for {where}: {_show(response.content)}"
        return payload
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"stream without [DONE] for {where}: {_show(response.text)}"
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c for c in chunks if "error" in c]
    assert not errors, f"error event for valid {where}: {errors}"
    return chunks[-1] if chunks else None


# -- exact answers ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    """One request whose answer is known. ``@M@`` in the body stands for the served model name."""

    id: str
    path: str
    body: bytes
    status: int = 400
    param: Any = ANY
    method: str = "POST"


def _chat(extra: str = "", messages: str = '[{"role": "user", "content": "Hi"}]') -> bytes:
    return f'{{"model": "@M@", "max_tokens": 2, "messages": {messages}{extra}}}'.encode()


def _completion(extra: str = "", prompt: str = '"Hi"') -> bytes:
    return f'{{"model": "@M@", "max_tokens": 2, "prompt": {prompt}{extra}}}'.encode()


def _nest(inner: str = "1", depth: int = DEEP) -> str:
    return "[" * depth + inner + "]" * depth


REFUSED = [
    # Deep nesting (a RecursionError was a 500): at the top level and inside every kind of field.
    Case("deep array body", CHAT, _nest().encode()),
    Case("deep object body", COMPLETIONS, ('{"a": ' * DEEP + "1" + "}" * DEEP).encode()),
    Case("deep messages", CHAT, _chat(messages=_nest())),
    Case("deep content", CHAT, _chat(messages=f'[{{"role": "user", "content": {_nest()}}}]')),
    Case("deep prompt", COMPLETIONS, _completion(prompt=_nest())),
    Case("deep logit_bias", COMPLETIONS, _completion(', "logit_bias": ' + '{"1": ' * DEEP + "1" + "}" * DEEP)),
    Case("deep unknown field", CHAT, _chat(f', "extra": {_nest()}')),
    # Lone UTF-16 surrogates: valid JSON escapes, not valid text (a 500 in prompt, key and model).
    Case("surrogate in prompt", COMPLETIONS, _completion(prompt='"\\ud800"')),
    Case("surrogate in prompt list", COMPLETIONS, _completion(prompt='["ok", "x\\udfff"]')),
    Case("surrogate in a key", COMPLETIONS, _completion(', "\\ud800": 1')),
    Case("surrogate in a message key", CHAT, _chat(messages='[{"role": "user", "content": "Hi", "\\udc00": 1}]')),
    Case("surrogate in model", CHAT, b'{"model": "\\ud800", "messages": [{"role": "user", "content": "Hi"}]}'),
    Case("surrogate in user", CHAT, _chat(', "user": "jos\\ud83d"')),
    Case("surrogate in content", CHAT, _chat(messages='[{"role": "user", "content": "\\ud83d\\u0041"}]')),
    Case("surrogate in stop", COMPLETIONS, _completion(', "stop": ["\\udfff"]')),
    # Bytes that are not UTF-8 JSON.
    Case("invalid UTF-8 body", CHAT, b"\xff\xfe\xfd"),
    Case("invalid UTF-8 in a string", CHAT,
         _chat(messages='[{"role": "user", "content": "H@BAD@"}]').replace(b"@BAD@", b"\xc3\x28")),
    Case("UTF-16 body with BOM", CHAT, '{"model": "x", "messages": []}'.encode("utf-16")),
    Case("truncated JSON", CHAT, _chat()[:-7]),
    Case("trailing garbage", CHAT, _chat() + b" }"),
    Case("NaN (not JSON)", CHAT, _chat(', "temperature": NaN'), param=None),
    Case("overflowing number", CHAT, _chat(', "top_p": 1e999'), param="top_p"),
    Case("string body", CHAT, b'"hello"'),
    # Wrong types, each field that once slipped through or answered 500 (issue 18).
    Case("role as a list", CHAT, _chat(messages='[{"role": ["user"], "content": "Hi"}]'), param="messages[0].role"),
    Case("name as a number", CHAT, _chat(messages='[{"role": "user", "content": "Hi", "name": 7}]'),
         param="messages[0].name"),
    Case("prompt of mixed lists", COMPLETIONS, _completion(prompt='[[1], "a"]'), param="prompt"),
    Case("prompt of mixed items", COMPLETIONS, _completion(prompt='["a", [1]]'), param="prompt"),
    Case("empty token list", COMPLETIONS, _completion(prompt="[[]]"), param="prompt"),
    Case("logit_bias as a list", CHAT, _chat(', "logit_bias": []'), param="logit_bias"),
    Case("include_usage maybe", CHAT, _chat(', "stream": true, "stream_options": {"include_usage": "maybe"}'),
         param="stream_options.include_usage"),
    Case("messages as a string", CHAT, _chat(messages='"Hi"'), param="messages"),
    Case("message as a list", CHAT, _chat(messages='[["user", "Hi"]]')),
    Case("content as a number", CHAT, _chat(messages='[{"role": "user", "content": 5}]'), param="messages[0].content"),
    Case("user as a number", CHAT, _chat(', "user": 5'), param="user"),
    Case("user as a list", COMPLETIONS, _completion(', "user": ["josé"]'), param="user"),
    Case("model as a list", CHAT, b'{"model": ["x"], "messages": [{"role": "user", "content": "Hi"}]}', param="model"),
    Case("max_tokens as a float", COMPLETIONS, _completion(', "max_tokens": 1.5'), param="max_tokens"),
    Case("max_tokens as a bool", COMPLETIONS, _completion(', "max_tokens": true'), param="max_tokens"),
    Case("n as a huge float", CHAT, _chat(', "n": 1e308'), param="n"),
    Case("seed as a string", CHAT, _chat(', "seed": "1"'), param="seed"),
    Case("stream as a string", CHAT, _chat(', "stream": "yes"'), param="stream"),
    Case("stop with a number", COMPLETIONS, _completion(', "stop": ["a", 1]'), param="stop"),
    Case("stop_token_ids as a dict", COMPLETIONS, _completion(', "stop_token_ids": {"1": 2}'), param="stop_token_ids"),
    Case("priority as an object", COMPLETIONS, _completion(', "priority": {}'), param="priority"),
    # Out of range.
    Case("max_tokens negative", COMPLETIONS, _completion(', "max_tokens": -1'), param="max_tokens"),
    Case("max_tokens 2**64", COMPLETIONS, _completion(f', "max_tokens": {2**64}'), param="prompt"),
    Case("top_k past int32", COMPLETIONS, _completion(f', "top_k": {2**31}'), param="top_k"),
    Case("min_tokens over max_tokens", COMPLETIONS, _completion(', "min_tokens": 3'), param="min_tokens"),
    Case("repetition_penalty zero", COMPLETIONS, _completion(', "repetition_penalty": 0'), param="repetition_penalty"),
    Case("temperature negative", CHAT, _chat(', "temperature": -0.5'), param="temperature"),
    Case("n past the limit", CHAT, _chat(', "n": 1000000'), param="n"),
    Case("17 stop strings", COMPLETIONS, _completion(f', "stop": {json.dumps([str(i) for i in range(17)])}'),
         param="stop"),
    Case("empty stop string", COMPLETIONS, _completion(', "stop": [""]'), param="stop"),
    Case("stop token outside the vocabulary", COMPLETIONS, _completion(f', "stop_token_ids": [{VOCAB}]'),
         param="stop_token_ids"),
    Case("token id outside the vocabulary", COMPLETIONS, _completion(prompt=f"[{VOCAB}]"), param="prompt"),
    Case("negative token id", COMPLETIONS, _completion(prompt="[-1]"), param="prompt"),
    Case("unknown priority class", COMPLETIONS, _completion(', "priority": "urgent😀"'), param="priority"),
    # Unknown fields and models.
    Case("unknown field", CHAT, _chat(', "bogus": 1'), param="bogus"),
    Case("unknown non-ASCII field", COMPLETIONS, _completion(', "ünknown": 1'), param="ünknown"),
    Case("unknown model", CHAT, b'{"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}]}', 404, "model"),
    Case("non-ASCII unknown model", CHAT, b'{"model": "mod\xc3\xa8le", "messages": []}', 404, "model"),
    # Wrong methods and paths.
    Case("GET completions", COMPLETIONS, b"", 405, method="GET"),
    Case("PUT chat", CHAT, _chat(), 405, method="PUT"),
    Case("DELETE models", "/v1/models", b"", 405, method="DELETE"),
    Case("POST models", "/v1/models", b"{}", 405),
    Case("POST health", "/health", b"{}", 405),
    Case("GET embeddings", "/v1/embeddings", b"", 405, method="GET"),
    Case("embeddings of a dict", "/v1/embeddings", b'{"model": "@M@", "input": {"text": "x"}}', 400, "input"),
    Case("embeddings of an unknown model", "/v1/embeddings", b'{"model": "gpt-4o", "input": "x"}', 404, "model"),
    Case("path below chat", CHAT + "/x", _chat(), 404),
    Case("emoji model path", "/v1/models/%F0%9F%98%80", b"", 404, method="GET"),
    Case("surrogate bytes in the path", "/v1/models/%ED%A0%80", b"", 404, method="GET"),
    Case("invalid UTF-8 in the path", "/v1/models/%FF%FE", b"", 404, method="GET"),
]


@pytest.mark.parametrize("case", REFUSED, ids=[c.id for c in REFUSED])
def test_refused_with_the_right_error(raylm_app, case: Case):
    body = case.body.replace(b"@M@", raylm_app.model.encode())
    where = f"{case.method} {case.path} [{case.id}] {_show(body)}"
    response = httpx.request(case.method, f"{raylm_app.base_url}{case.path}", content=body,
                             headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == case.status, f"{response.status_code} for {where}: {_show(response.content)}"
    error = _check_error_json(response, where)
    if case.param is not ANY:
        assert error["param"] == case.param, f"param {error['param']!r} for {where}: {error}"


def test_refused_cases_leave_nothing_held(raylm_app, greedy_before):
    """Sends every case above again: each refusal gave back whatever it took (issue 18: refused
    requests leaked admission slots until the server wedged)."""
    for case in REFUSED:
        httpx.request(case.method, f"{raylm_app.base_url}{case.path}", timeout=60,
                      content=case.body.replace(b"@M@", raylm_app.model.encode()))
    _assert_nothing_held_and_greedy_unchanged(raylm_app, greedy_before)


# -- valid but unusual: must be served -------------------------------------------------------------------------
def _served_cases(model: str) -> list[tuple[str, str, dict]]:
    cases = []
    for i, text in enumerate(ODD_TEXT):
        stream = i % 2 == 1
        cases.append((f"user {text!r}", CHAT, {"messages": [{"role": "user", "content": "Hi"}], "user": text,
                                               "stream": stream}))
        cases.append((f"content {text!r}", CHAT, {"messages": [{"role": "system", "content": text},
                                                               {"role": "user", "content": text, "name": text}],
                                                  "stream": not stream}))
        cases.append((f"prompt {text!r}", COMPLETIONS, {"prompt": [text, "x"], "user": text, "stop": [text],
                                                        "stream": stream}))
    return [(name, path, {"model": model, "max_tokens": 2, **body}) for name, path, body in cases]


def test_unusual_but_valid_text_is_served(raylm_app, greedy_before):
    """Issue 18: a non-ASCII ``user`` answered 500 and leaked an admission slot, 64 of them wedged
    the server. Every such request must be served, streaming or not, and leave nothing held."""
    failures = []
    for name, path, body in _served_cases(raylm_app.model):
        response = httpx.post(f"{raylm_app.base_url}{path}", json=body, timeout=60)
        try:
            _check_served(response, f"{name}: {_show(json.dumps(body))}", body["stream"])
        except AssertionError as err:
            failures.append(str(err))
    assert not failures, "\n".join(failures)
    _assert_nothing_held_and_greedy_unchanged(raylm_app, greedy_before)


_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=24)  # any valid Unicode, NUL included
_SLOW = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


def test_any_unicode_text_is_served(raylm_app, greedy_before):
    """Any valid Unicode (NUL, specials and unassigned code points included) in ``user``, content,
    prompt and stop strings is served."""

    @settings(max_examples=25, deadline=None, suppress_health_check=_SLOW)
    @given(user=_TEXT, content=_TEXT, stop=st.lists(_TEXT.filter(bool), max_size=3), chat=st.booleans(),
           stream=st.booleans())
    def example(user: str, content: str, stop: list[str], chat: bool, stream: bool) -> None:
        body: dict[str, Any] = {"model": raylm_app.model, "max_tokens": 2, "user": user, "stream": stream}
        if stop:
            body["stop"] = stop
        if chat:
            body["messages"] = [{"role": "user", "content": content}]
        else:
            body["prompt"] = content or "x"
        response = httpx.post(f"{raylm_app.base_url}{CHAT if chat else COMPLETIONS}", json=body, timeout=60)
        _check_served(response, _show(json.dumps(body)), stream)

    example()
    _assert_nothing_held_and_greedy_unchanged(raylm_app, greedy_before)


def _unit(low_open: bool = False) -> st.SearchStrategy[float]:
    """Floats in [0, 1] (or (0, 1]) with the edges and subnormals hypothesis likes to try."""
    return st.floats(0.0, 1.0, exclude_min=low_open, allow_subnormal=True)


_SAMPLING = st.fixed_dictionaries({}, optional={
    "temperature": st.floats(0.0, 2.0) | st.sampled_from([0, 1e-300, 5e-324, 2]),
    "top_p": _unit(low_open=True) | st.just(5e-324),
    "top_k": st.sampled_from([-1, 0, 1, 2, VOCAB - 1, VOCAB, VOCAB + 1, 2**31 - 1]),
    "min_p": _unit(),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.0, 2.0, exclude_min=True) | st.just(5e-324),
    "seed": st.integers() | st.sampled_from([0, -1, 2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 10**40]),
    "stop_token_ids": st.lists(st.sampled_from([0, 1, 2, VOCAB - 1]) | st.integers(0, VOCAB - 1), max_size=4),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
})


def test_in_range_sampling_parameters_are_served(raylm_app, greedy_before):
    """Every value inside its documented range reaches the real engine and must come back as a
    well-formed completion: n choices per prompt, a finish reason, no more tokens than asked.
    A seed outside int64 may instead be refused by name (vLLM refuses those too)."""

    @settings(max_examples=30, deadline=None, suppress_health_check=_SLOW)
    @given(sampling=_SAMPLING, chat=st.booleans(), stream=st.booleans(), n=st.integers(1, 2),
           max_tokens=st.integers(1, 3), min_tokens=st.integers(0, 3), logprobs=st.none() | st.integers(0, 20),
           prompts=st.integers(1, 2), data=st.data())
    def example(sampling: dict, chat: bool, stream: bool, n: int, max_tokens: int, min_tokens: int,
                logprobs: int | None, prompts: int, data: st.DataObject) -> None:
        body: dict[str, Any] = {"model": raylm_app.model, "n": n, "max_tokens": max_tokens,
                                "min_tokens": min(min_tokens, max_tokens), "stream": stream, **sampling}
        if stream and data.draw(st.booleans()):
            body["stream_options"] = {"include_usage": True}
        if chat:
            body["messages"] = [{"role": "user", "content": "Count to three."}]
            if logprobs is not None:
                body.update(logprobs=True, top_logprobs=logprobs)
            prompts = 1
        else:
            body["prompt"] = ["One, two,", "Red, green,"] if prompts > 1 else "One, two,"
            if logprobs is not None:
                body["logprobs"] = logprobs
            elif data.draw(st.booleans()):
                body["echo"] = True
        where = _show(json.dumps(body), 400)
        response = httpx.post(f"{raylm_app.base_url}{CHAT if chat else COMPLETIONS}", json=body, timeout=120)
        if response.status_code == 400 and not -(2**63) <= body.get("seed", 0) < 2**63:
            assert _check_error_json(response, where)["param"] == "seed", where
            return
        final = _check_served(response, where, stream)
        if final is None or stream:
            return  # a stream's chunks carry one choice each; its well-formedness is checked above
        choices = final["choices"]
        assert sorted(c["index"] for c in choices) == list(range(n * prompts)), f"choices for {where}: {choices}"
        assert all(c["finish_reason"] in ("stop", "length") for c in choices), f"{where}: {choices}"
        assert final["usage"]["completion_tokens"] <= n * prompts * max_tokens, f"{where}: {final['usage']}"
        if logprobs is not None:
            assert all(c["logprobs"] for c in choices), f"no logprobs for {where}: {choices}"

    example()
    _assert_nothing_held_and_greedy_unchanged(raylm_app, greedy_before)
