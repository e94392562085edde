"""The disaggregation benchmark's traffic: long-running decode streams, and long prompts arriving
at a fixed interval among them, with every streamed token's arrival time.

``run_traffic`` starts ``streams`` streamed completions (short prompts, ``ignore_eos``, more
output tokens than the window lasts), waits until each has its first token and a settle time,
then for ``duration_s`` sends a distinct long prompt every ``interval_s`` (random token ids, so
no prefix reuse between them or with the streams). When the window ends the streams are closed
(the client goes away: the server aborts them) and the long prompts are awaited.

Decode latency is read from the streams' tokens that arrived inside the window: a token's TPOT
is the time since the stream's previous token. The deployments run one decode step per engine
call (``num_scheduler_steps: 1``), so a text chunk is one token; a chunk carrying more (the
detokenizer holding back an incomplete character) counts as that many tokens, each charged the
chunk's gap divided among them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, Callable

import httpx
import numpy as np

from raylm.benchmarks.http_bench import PROMPT_TOKEN_RANGE, percentile

REQUEST_TIMEOUT_S = 600.0


@dataclasses.dataclass(frozen=True)
class PDWorkload:
    """The issue's workload by default: 16 decode streams, a 2,000-token prompt every 2 s."""

    streams: int = 16
    stream_prompt_tokens: int = 32
    stream_max_tokens: int = 2048  # above what a stream decodes in the window: none ends before it
    long_prompt_tokens: int = 2000
    long_output_tokens: int = 16
    interval_s: float = 2.0
    duration_s: float = 40.0
    settle_s: float = 3.0  # after every stream has its first token, before the window opens
    seed: int = 0
    token_range: tuple[int, int] = PROMPT_TOKEN_RANGE  # prompts' random token ids: ordinary tokens of the vocabulary


@dataclasses.dataclass
class StreamRecord:
    """One stream: each text chunk's arrival time and its token count (1 but for held-back text)."""

    times: list[float] = dataclasses.field(default_factory=list)
    tokens: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False  # ran to its end (max tokens) rather than being closed by the window
    error: str | None = None


@dataclasses.dataclass
class LongPromptRecord:
    sent: float
    ttft_s: float | None = None
    cached_tokens: int | None = None
    error: str | None = None


def prompts(workload: PDWorkload) -> tuple[list[list[int]], list[list[int]]]:
    """The streams' prompts and enough long prompts for the window, all distinct random token ids."""
    rng = np.random.RandomState(workload.seed)
    low, high = workload.token_range
    long_count = int(workload.duration_s / workload.interval_s) + 1
    streams = [rng.randint(low, high, workload.stream_prompt_tokens).tolist() for _ in range(workload.streams)]
    longs = [rng.randint(low, high, workload.long_prompt_tokens).tolist() for _ in range(long_count)]
    return streams, longs


def _body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], on_chunk) -> dict[str, Any] | None:
    """POST a streamed completion; call ``on_chunk(now, text)`` per chunk with choices (its text may
    be empty); return its usage."""
    usage = None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            event = json.loads(line[len("data:"):])
            if "error" in event:
                raise RuntimeError(f"stream error: {json.dumps(event['error'])[:200]}")
            if event.get("choices"):
                on_chunk(time.perf_counter(), "".join(c.get("text") or "" for c in event["choices"]))
            usage = event.get("usage") or usage
    return usage


async def _decode_stream(client: httpx.AsyncClient, url: str, body: dict[str, Any], record: StreamRecord,
                         first_token: asyncio.Event) -> None:
    pending = 0  # tokens whose text the detokenizer held back (chunks without text)

    def on_chunk(now: float, text: str) -> None:
        nonlocal pending
        if not text:
            pending += 1
            return
        record.times.append(now)
        record.tokens.append(1 + pending)
        pending = 0
        first_token.set()

    try:
        await _stream(client, url, body, on_chunk)
        record.finished = True
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported, never raised: one failed stream is a result
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        first_token.set()


async def _long_prompt(client: httpx.AsyncClient, url: str, body: dict[str, Any], record: LongPromptRecord) -> None:
    def on_chunk(now: float, text: str) -> None:
        if text and record.ttft_s is None:
            record.ttft_s = now - record.sent

    try:
        usage = await _stream(client, url, body, on_chunk)
        record.cached_tokens = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    except Exception as exc:  # noqa: BLE001 - reported as the request's error
        record.error = f"{type(exc).__name__}: {exc}"


async def run_traffic(base_url: str, model: str, workload: PDWorkload,
                      on_window_start: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Run the workload once against ``base_url``; the window's figures (``summarize``).
    ``on_window_start`` runs once every stream has its first token, before the window opens."""
    url = f"{base_url.rstrip('/')}/v1/completions"
    stream_prompts, long_prompts = prompts(workload)
    limits = httpx.Limits(max_connections=workload.streams + len(long_prompts) + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        records = [StreamRecord() for _ in stream_prompts]
        firsts = [asyncio.Event() for _ in stream_prompts]
        streams = [asyncio.create_task(_decode_stream(client, url, _body(model, p, workload.stream_max_tokens), r, f))
                   for p, r, f in zip(stream_prompts, records, firsts)]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), REQUEST_TIMEOUT_S)
        on_window_start()
        await asyncio.sleep(workload.settle_s)
        window_start = time.perf_counter()
        longs: list[LongPromptRecord] = []
        long_tasks = []
        for index, prompt in enumerate(long_prompts):
            due = window_start + index * workload.interval_s
            if due >= window_start + workload.duration_s:
                break
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            longs.append(LongPromptRecord(sent=time.perf_counter()))
            long_tasks.append(asyncio.create_task(
                _long_prompt(client, url, _body(model, prompt, workload.long_output_tokens), longs[-1])))
        await asyncio.sleep(max(0.0, window_start + workload.duration_s - time.perf_counter()))
        window_end = time.perf_counter()
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)
        await asyncio.gather(*long_tasks)
    return summarize(records, longs, window_start, window_end)


def token_gaps(record: StreamRecord, start: float, end: float) -> list[float]:
    """TPOT of each of the stream's tokens that arrived in ``[start, end]`` after an earlier one:
    the gap since the previous chunk, divided among the chunk's tokens."""
    gaps = []
    for previous, now, count in zip(record.times, record.times[1:], record.tokens[1:]):
        if start <= now <= end:
            gaps += [(now - previous) / count] * count
    return gaps


def summarize(records: list[StreamRecord], longs: list[LongPromptRecord], start: float, end: float) -> dict[str, Any]:
    """The window's figures: decode TPOT p50/p99 (ms) over the streams' tokens, decode tokens/s,
    the long prompts' TTFT p50/p99 (ms) and cached tokens (mean), and what went wrong."""
    gaps = [gap for record in records for gap in token_gaps(record, start, end)]
    ttfts = [r.ttft_s for r in longs if r.ttft_s is not None and r.error is None]
    cached = [r.cached_tokens for r in longs if r.cached_tokens is not None]

    def ms(value: float | None) -> float | None:
        return None if value is None else 1000 * value

    return {
        "window_s": end - start,
        "streams": len(records),
        "streams_ended_early": sum(r.finished for r in records),
        "stream_errors": [r.error for r in records if r.error][:3],
        "decode_tokens": len(gaps),
        "decode_tok_s": len(gaps) / (end - start),
        "tpot_ms_p50": ms(percentile(gaps, 50)),
        "tpot_ms_p99": ms(percentile(gaps, 99)),
        "tpot_ms_max": ms(max(gaps)) if gaps else None,
        "long_prompts_sent": len(longs),
        "long_prompts_completed": len(ttfts),
        "long_prompt_errors": [r.error for r in longs if r.error][:3],
        "long_ttft_ms_p50": ms(percentile(ttfts, 50)),
        "long_ttft_ms_p99": ms(percentile(ttfts, 99)),
        "long_cached_tokens_mean": float(np.mean(cached)) if cached else None,
    }
