"""Bad input, overload and disconnects over real HTTP: right status, OpenAI error JSON, no leaks."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from raylm.router.routing_ledger import PENDING_TTL_S
from raylm.workers.wire.replica_protocol import replica_reports

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _post(app, path: str, body, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) or hasattr(body, "__next__") else json.dumps(body)
    return httpx.post(f"{app.base_url}{path}", content=content, headers={"Content-Type": "application/json"},
                      timeout=60, **kwargs)


def _assert_error(response: httpx.Response, status: int, param: str | None = "ANY") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    if param != "ANY":
        assert error["param"] == param
    return error


def _wait_idle(timeout_s: float = 60.0) -> dict:
    """Every worker replica back to no running requests and no KV blocks in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {rid: report.engine for rid, report in replica_reports().items()}
        if stats and all(s.running == 0 and s.waiting == 0 and s.pool.num_used_blocks == 0 for s in stats.values()):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"replicas still busy: {stats}")
        time.sleep(0.2)


def chat_body(app, **extra) -> dict:
    return {"model": app.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        (CHAT, b"{not json", 400, None),
        (CHAT, b"[1, 2]", 400, None),
        (CHAT, {"messages": [{"role": "user", "content": "Hi"}]}, 400, "model"),
        (CHAT, {"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}]}, 404, "model"),
        (CHAT, {"model": "M", "messages": []}, 400, "messages"),
        (CHAT, {"model": "M", "messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages[0].role"),
        (CHAT, {"model": "M", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
         "messages[0].content"),
        (CHAT, {"model": "M", "messages": [{"role": "user", "content": "Hi"}], "temperature": "hot"}, 400, "temperature"),
        (CHAT, {"model": "M", "messages": [{"role": "user", "content": "Hi"}], "temperature": 3}, 400, "temperature"),
        (CHAT, {"model": "M", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}, 400, "max_tokens"),
        (CHAT, {"model": "M", "messages": [{"role": "user", "content": "Hi"}], "n": 0}, 400, "n"),
        (CHAT, {"model": "M", "messages": [{"role": "user", "content": "Hi"}], "top_p": 0}, 400, "top_p"),
        (CHAT, {"model": "M", "messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
        (CHAT, {"model": "M", "messages": [{"role": "user", "content": "Hi"}], "bogus": 1}, 400, "bogus"),
        (CHAT, {"model": "M", "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function"}]}, 400,
         "tools[0]"),
        (CHAT, {"model": "M", "messages": [{"role": "user", "content": "Hi"}], "stream_options": {}}, 400,
         "stream_options"),
        (COMPLETIONS, {"model": "M"}, 400, "prompt"),
        (COMPLETIONS, {"model": "M", "prompt": [1, "a"]}, 400, "prompt"),
        (COMPLETIONS, {"model": "M", "prompt": [10**9]}, 400, "prompt"),
        (COMPLETIONS, {"model": "M", "prompt": "x", "logprobs": 99}, 400, "logprobs"),
        (COMPLETIONS, {"model": "M", "prompt": "x", "stop": ["ok", 3]}, 400, "stop"),
    ],
)
def test_bad_requests(raylm_app, path, body, status, param):
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": raylm_app.model}
    _assert_error(_post(raylm_app, path, body), status, param)


def test_context_overflow_names_the_numbers(raylm_app):
    limit = raylm_app.config.engine_args().max_model_len
    error = _assert_error(
        _post(raylm_app, COMPLETIONS, {"model": raylm_app.model, "prompt": [1000] * 1000, "max_tokens": 100}), 400,
        "prompt",
    )
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {limit} tokens" in error["message"]
    assert "1100 tokens (1000 in the prompt, 100 in the completion)" in error["message"]


def test_body_too_large(raylm_app):
    big = json.dumps(chat_body(raylm_app, user="x" * (raylm_app.config.router.max_request_bytes + 10)))
    _assert_error(_post(raylm_app, CHAT, big), 413)
    # Without a Content-Length header (chunked upload) the limit still holds.
    _assert_error(_post(raylm_app, CHAT, iter([big.encode()])), 413)


def test_unknown_path_and_method(raylm_app):
    _assert_error(httpx.get(f"{raylm_app.base_url}/v1/nothing"), 404)
    _assert_error(httpx.get(f"{raylm_app.base_url}{CHAT}"), 405)
    _assert_error(httpx.get(f"{raylm_app.base_url}/v1/models/other"), 404)


def test_fifty_malformed_requests_leave_the_server_healthy(raylm_app):
    junk = [b"", b"{", b"null", b'{"model": 5}', b"\xff\xfe", b'{"messages": "x"}']
    for i in range(50):
        response = _post(raylm_app, CHAT if i % 2 else COMPLETIONS, junk[i % len(junk)])
        assert response.status_code in (400, 404), response.text
    assert httpx.get(f"{raylm_app.base_url}/health", timeout=30).status_code == 200
    ok = _post(raylm_app, CHAT, chat_body(raylm_app, temperature=0))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]
    _wait_idle()


def test_disconnect_mid_stream_frees_blocks(raylm_app):
    before = sum(r.engine.generation_tokens for r in replica_reports().values())
    body = chat_body(raylm_app, max_tokens=600, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{raylm_app.base_url}{CHAT}", json=body, timeout=60) as response:
        assert response.status_code == 200
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data:")
            if seen >= 4:
                break  # hang up mid-stream
    stats = _wait_idle(timeout_s=30)
    generated = sum(s.generation_tokens for s in stats.values()) - before
    assert generated < 600, "the abandoned stream ran to completion instead of being aborted"


def test_disconnect_while_waiting_for_a_non_streaming_reply_frees_blocks(raylm_app):
    body = chat_body(raylm_app, max_tokens=900, ignore_eos=True)
    before = sum(r.engine.generation_tokens for r in replica_reports().values())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{raylm_app.base_url}{CHAT}", json=body, timeout=3.0)
    stats = _wait_idle(timeout_s=30)
    assert sum(s.generation_tokens for s in stats.values()) - before < 900


def test_overload_answers_429_fast(raylm_app):
    """Past the workers' batch slots plus the router's queue: 429 with Retry-After, at once."""
    engine, router = raylm_app.config.engine_args(), raylm_app.config.router
    capacity = raylm_app.config.workers.num_replicas * engine.max_num_seqs + router.max_queue_size
    body = chat_body(raylm_app, max_tokens=800, ignore_eos=True, stream=True)

    async def one(client: httpx.AsyncClient) -> tuple[int, float, dict]:
        start = time.monotonic()
        async with client.stream("POST", f"{raylm_app.base_url}{CHAT}", json=body) as response:
            headers = dict(response.headers)
            if response.status_code != 200:
                await response.aread()
            return response.status_code, time.monotonic() - start, headers

    async def main() -> list:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=200)) as client:
            tasks = [asyncio.create_task(one(client)) for _ in range(capacity + 24)]
            done = []
            for next_done in asyncio.as_completed(tasks):
                done.append(await next_done)
                if sum(status == 429 for status, _, _ in done) >= 10:
                    break
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            return done

    results = asyncio.run(main())
    rejected = [(t, h) for status, t, h in results if status == 429]
    assert len(rejected) >= 10
    assert all(h.get("retry-after") for _, h in rejected)
    assert max(t for t, _ in rejected) < 30
    _wait_idle(timeout_s=60)
    assert httpx.get(f"{raylm_app.base_url}/health", timeout=30).status_code == 200


def test_two_replicas_both_serve(raylm_app):
    """Prompts that share no prefix are spread by load over both replicas."""
    _wait_idle()
    # The request router sees each replica's load as of its last report (every stats_period_s):
    # right after a busy test, a replica's stale report would still show that test's work and
    # rightly send the whole burst to the other one. So would the charges of choices no replica
    # accepted (the overload test's cancelled streams), until PENDING_TTL_S after them. Start
    # from a quiet state as the router sees it.
    time.sleep(max(3 * raylm_app.config.router.prefix_routing.stats_period_s, PENDING_TTL_S) + 1.0)
    before = {rid: r.engine.requests for rid, r in replica_reports().items()}
    assert len(before) == 2

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            bodies = [{"model": raylm_app.model, "prompt": [1000 + 37 * i + j for j in range(40)], "max_tokens": 32,
                       "ignore_eos": True} for i in range(16)]
            responses = await asyncio.gather(*[client.post(f"{raylm_app.base_url}{COMPLETIONS}", json=b) for b in bodies])
            assert all(r.status_code == 200 for r in responses)

    asyncio.run(main())
    after = {rid: r.engine.requests for rid, r in replica_reports().items()}
    assert all(after[rid] > before[rid] for rid in before), (before, after)
