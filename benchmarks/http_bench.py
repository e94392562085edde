"""OpenAI-endpoint load generator (``raylm bench --base-url URL``): what an HTTP client sees.

The offline bench measures the engine alone; this one measures the whole served path (HTTP,
router, Ray, engine, streaming) the way a user does, and can drive any OpenAI-compatible
server the same way (``--compare URL2``, e.g. llama.cpp's ``llama-server``; repeatable) for a ratio.

Every request is ``POST /v1/completions`` with random token-id prompts (so no tokenizer is
needed and both servers see identical inputs), greedy sampling, ``ignore_eos`` (so every
request produces exactly ``max_tokens``) and a stream with a final usage chunk. Per request:

- TTFT: from sending the request to the first chunk that carries text (queueing + prefill).
- ITL: gaps between successive text chunks. A server may pack several tokens into one chunk
  and the token count is only known from the usage chunk at the end, so the gaps are
  reported per chunk, not per token (for our server and llama-server a chunk is usually
  one token).
- end-to-end latency, output tokens (usage ``completion_tokens``, else the number of text
  chunks), and errors (non-200 status, an ``error`` event in the stream, or an exception).

Per workload: output tokens/s and successful requests/s over the wall time of the measured
run (after ``--warmup`` requests whose prompts differ, so they warm compilation but not the
prefix cache), TTFT/ITL p50/p99, e2e p50 and the error count. With ``--ray-app`` (a raylm
application on this Ray cluster), also what its worker replicas counted over the measured run:
speculative decoding's acceptance (``replica_counters.py``), and per step kind the steps,
tokens, seconds and achieved GFLOP/s against this machine's float32 GEMM peak
(``step_rates.py``); and before measuring it waits for the worker replicas to start and to finish
compiling their programs in the background (``--warmup-timeout``), which would otherwise be
timed as serving.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from typing import Any, Sequence

import httpx
import numpy as np

from raylm.benchmarks.replica_counters import ReplicaCounters, acceptance, wait_until_warm
from raylm.benchmarks.step_rates import PEAK_SHAPE, float32_gemm_peak, format_step_rates, step_rates

# Random prompt token ids: ordinary tokens of a 49152-vocab model (past the special/control ids).
PROMPT_TOKEN_RANGE = (1000, 30000)
REQUEST_TIMEOUT_S = 600.0
MAX_ERROR_MESSAGES = 5


@dataclasses.dataclass(frozen=True)
class Workload:
    """A request mix; a shared-prefix prompt is ``shared_prefix_tokens`` common + ``prompt_tokens`` unique."""

    name: str
    num_requests: int
    concurrency: int
    prompt_tokens: int = 128
    output_tokens: int = 128
    shared_prefix_tokens: int = 0
    prefix_groups: int = 1  # distinct shared prefixes, one drawn at random per request (e.g. per tenant or app)


WORKLOADS = {
    w.name: w
    for w in (
        Workload("single-stream", num_requests=8, concurrency=1),
        Workload("throughput", num_requests=64, concurrency=16),
        Workload("high-concurrency", num_requests=128, concurrency=64),
        Workload("shared-prefix", num_requests=64, concurrency=16, prompt_tokens=32, shared_prefix_tokens=512),
        Workload("multi-prefix", num_requests=96, concurrency=16, prompt_tokens=32, output_tokens=32,
                 shared_prefix_tokens=512, prefix_groups=8),
    )
}


@dataclasses.dataclass
class RequestResult:
    """One streamed request; ``error`` is set when it failed (the timings are then meaningless)."""

    e2e_s: float
    ttft_s: float | None = None
    chunk_gaps_s: list[float] = dataclasses.field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None


@dataclasses.dataclass
class WorkloadResult:
    """The measured run of one workload against one endpoint (latencies of successful requests only)."""

    base_url: str
    model: str
    workload: Workload
    wall_s: float
    completed: int
    errors: int
    output_tokens: int
    ttft_s: list[float]
    itl_s: list[float]
    e2e_s: list[float]
    error_messages: list[str]
    # Speculative decoding over the measured run (``--ray-app``; see replica_counters.py).
    speculation: dict[str, Any] = dataclasses.field(default_factory=lambda: acceptance(None, None))
    # Per step kind over the measured run (``--ray-app``; see step_rates.py); None without.
    step_rates: dict[str, Any] | None = None

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def requests_s(self) -> float:
        return self.completed / self.wall_s

    def summary(self) -> dict[str, Any]:
        """The reported numbers (latencies in ms; None where there was nothing to measure)."""
        return {
            "base_url": self.base_url,
            "model": self.model,
            "workload": dataclasses.asdict(self.workload),
            "wall_s": self.wall_s,
            "completed": self.completed,
            "errors": self.errors,
            "output_tokens": self.output_tokens,
            "output_tok_s": self.output_tok_s,
            "requests_s": self.requests_s,
            "ttft_ms_p50": _ms(percentile(self.ttft_s, 50)),
            "ttft_ms_p99": _ms(percentile(self.ttft_s, 99)),
            "itl_ms_p50": _ms(percentile(self.itl_s, 50)),
            "itl_ms_p99": _ms(percentile(self.itl_s, 99)),
            "e2e_ms_p50": _ms(percentile(self.e2e_s, 50)),
            "error_messages": self.error_messages,
            **self.speculation,
            "step_rates": self.step_rates,
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile, linearly interpolated between closest ranks (numpy's default); None if empty."""
    return float(np.percentile(values, q)) if len(values) else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def make_prompts(workload: Workload, seed: int) -> list[list[int]]:
    """The workload's token-id prompts; the same seed gives every endpoint the same prompts."""
    rng = np.random.RandomState(seed)
    low, high = PROMPT_TOKEN_RANGE
    prefixes = [rng.randint(low, high, size=workload.shared_prefix_tokens).tolist()
                for _ in range(workload.prefix_groups)]
    # Random, not round-robin: round-robin with as many clients as prefixes makes each freed
    # client send the prefix it just finished, which any least-loaded router keeps in place.
    groups = np.random.RandomState(seed + 7919).randint(0, len(prefixes), size=workload.num_requests)
    return [prefixes[g] + rng.randint(low, high, size=workload.prompt_tokens).tolist() for g in groups]


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def default_model(base_url: str, api_key: str | None = None) -> str:
    """The first model id of ``GET /v1/models`` (llama-server reports its model path)."""
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, headers=_headers(api_key)) as client:
        response = await client.get(f"{base_url.rstrip('/')}/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]


def _request_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }


async def _read_stream(response: httpx.Response, start: float) -> RequestResult:
    """Time the text chunks of an SSE completion stream as they arrive."""
    result = RequestResult(e2e_s=0.0)
    last: float | None = None
    chunks, usage_tokens = 0, None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            break
        chunk = json.loads(payload)
        if "error" in chunk:
            result.error = f"stream error: {json.dumps(chunk['error'])[:200]}"
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            now = time.perf_counter()
            if last is None:
                result.ttft_s = now - start
            else:
                result.chunk_gaps_s.append(now - last)
            last, chunks = now, chunks + 1
        if chunk.get("usage"):
            usage_tokens = chunk["usage"].get("completion_tokens")
    result.e2e_s = time.perf_counter() - start
    result.output_tokens = chunks if usage_tokens is None else usage_tokens
    return result


async def _send(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> RequestResult:
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return RequestResult(e2e_s=time.perf_counter() - start,
                                     error=f"HTTP {response.status_code}: {text[:200]}")
            return await _read_stream(response, start)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return RequestResult(e2e_s=time.perf_counter() - start, error=f"{type(exc).__name__}: {exc}")


async def _send_all(client: httpx.AsyncClient, url: str, bodies: list[dict[str, Any]],
                    concurrency: int) -> list[RequestResult]:
    """Send every body with at most ``concurrency`` in flight."""
    semaphore = asyncio.Semaphore(concurrency)

    async def one(body: dict[str, Any]) -> RequestResult:
        async with semaphore:
            return await _send(client, url, body)

    return await asyncio.gather(*(one(b) for b in bodies))


def _aggregate(base_url: str, model: str, workload: Workload, wall_s: float,
               results: list[RequestResult]) -> WorkloadResult:
    ok = [r for r in results if r.error is None]
    failed = [r.error for r in results if r.error is not None]
    return WorkloadResult(
        base_url=base_url, model=model, workload=workload, wall_s=wall_s,
        completed=len(ok), errors=len(failed), output_tokens=sum(r.output_tokens for r in ok),
        ttft_s=[r.ttft_s for r in ok if r.ttft_s is not None],
        itl_s=[gap for r in ok for gap in r.chunk_gaps_s],
        e2e_s=[r.e2e_s for r in ok],
        error_messages=failed[:MAX_ERROR_MESSAGES],
    )


async def run_workload(base_url: str, model: str, workload: Workload | str, *, seed: int = 0, warmup: int = 2,
                       api_key: str | None = None, counters: ReplicaCounters | None = None,
                       peak: float | None = None) -> WorkloadResult:
    """Warm up, then run ``workload`` (a ``Workload`` or a ``WORKLOADS`` name) against ``base_url``;
    with ``counters``, also the speculative decoding acceptance and each step kind's rate (held
    against ``peak`` GFLOP/s) over the measured run."""
    if isinstance(workload, str):
        workload = WORKLOADS[workload]
    base_url = base_url.rstrip("/")
    url = f"{base_url}/v1/completions"
    limits = httpx.Limits(max_connections=workload.concurrency, max_keepalive_connections=workload.concurrency)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits, headers=_headers(api_key)) as client:
        warm_prompts = make_prompts(dataclasses.replace(workload, num_requests=warmup), seed + 1)
        await _send_all(client, url, [_request_body(model, p, workload.output_tokens) for p in warm_prompts],
                        workload.concurrency)
        bodies = [_request_body(model, p, workload.output_tokens) for p in make_prompts(workload, seed)]
        before = counters.totals() if counters else None
        start = time.perf_counter()
        results = await _send_all(client, url, bodies, workload.concurrency)
        wall_s = time.perf_counter() - start
    result = _aggregate(base_url, model, workload, wall_s, results)
    if counters:
        after = counters.totals()
        result.speculation = acceptance(before.spec, after.spec)
        result.step_rates = step_rates(before.compute, after.compute, peak)
    return result


# -- report -------------------------------------------------------------------------------------------
_ROWS = (  # (label, summary key, number format, ratio: "rate" (higher is better), "time" (lower is), None)
    ("output tok/s", "output_tok_s", "{:.1f}", "rate"),
    ("requests/s", "requests_s", "{:.2f}", "rate"),
    ("TTFT p50 (ms)", "ttft_ms_p50", "{:.1f}", "time"),
    ("TTFT p99 (ms)", "ttft_ms_p99", "{:.1f}", None),
    ("ITL p50 (ms/chunk)", "itl_ms_p50", "{:.2f}", None),
    ("ITL p99 (ms/chunk)", "itl_ms_p99", "{:.2f}", None),
    ("e2e p50 (ms)", "e2e_ms_p50", "{:.1f}", None),
    ("output tokens", "output_tokens", "{:d}", None),
    ("errors", "errors", "{:d}", None),
    ("spec acceptance", "spec_acceptance", "{:.2f}", None),
    ("spec accepted/verify", "spec_mean_accepted", "{:.2f}", None),
)


def _cell(fmt: str, value: Any) -> str:
    return "-" if value is None else fmt.format(value)


def format_table(results: Sequence[WorkloadResult], peak: float | None = None) -> str:
    """One workload's numbers: a column per endpoint (A, B, C, ...) and, with others to compare,
    A's ratio to the best of them on the rates (A/B with one other, else A/best: the highest
    rate, the lowest time to first token), as a comparison with several peers reads. Then each
    endpoint's step kinds, where its replicas reported them (``step_rates``; ``peak``: the
    float32 GEMM peak they are held against, None if not measured)."""
    w = results[0].workload
    prefix = f"{w.shared_prefix_tokens} shared + " if w.shared_prefix_tokens else ""
    lines = [f"== {w.name}: {w.num_requests} requests x ({prefix}{w.prompt_tokens} prompt + "
             f"{w.output_tokens} output tokens), concurrency {w.concurrency} =="]
    names = [chr(ord("A") + i) for i in range(len(results))]
    lines += [f"  {n} = {r.base_url} (model {r.model})" for n, r in zip(names, results)]
    ratio = {1: [], 2: ["A/B"]}.get(len(results), ["A/best"])
    header = ["", *names] + ratio
    rows = [header]
    summaries = [r.summary() for r in results]
    for label, key, fmt, kind in _ROWS:
        row = [label, *(_cell(fmt, s[key]) for s in summaries)]
        if ratio:
            a, others = summaries[0][key], [s[key] for s in summaries[1:] if s[key]]
            best = (max if kind == "rate" else min)(others) if others and kind else None
            row.append(f"{a / best:.2f}x" if best and a is not None else "")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines += [("  " + "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)))
              .rstrip() for row in rows]
    lines += [f"  {n} error: {msg}" for n, r in zip(names, results) for msg in r.error_messages]
    for n, r in zip(names, results):
        if r.step_rates is not None:
            lines += format_step_rates(n, r.step_rates, peak)
    return "\n".join(lines)


# -- command line -------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raylm bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (serves /v1/completions)")
    parser.add_argument("--model", default=None, help="model name to send (default: first id of /v1/models)")
    parser.add_argument("--workload", default="all", choices=[*WORKLOADS, "all"])
    parser.add_argument("--compare", action="append", default=[], metavar="URL2",
                        help="run the same workloads against URL2 too (repeat for more peers: columns B, C, ...)")
    parser.add_argument("--compare-model", action="append", default=[],
                        help="model name for each --compare URL, in order (default: its /v1/models)")
    parser.add_argument("--api-key", default=None, help="sent as a Bearer token to both endpoints")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prompt length (shared-prefix: the unique part after the shared prefix)")
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=2, help="requests sent before measuring (default 2)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--ray-app", default=None, metavar="APP",
                        help="raylm Serve application behind --base-url (e.g. raylm): report its speculative "
                             "decoding acceptance and each step kind's achieved GFLOP/s, read from the worker "
                             "replicas over Ray")
    parser.add_argument("--no-gemm-peak", action="store_true",
                        help="with --ray-app: do not measure this machine's float32 GEMM peak (a few seconds at "
                             "start) that the step kinds' GFLOP/s are held against")
    parser.add_argument("--ray-address", default="auto", help="Ray cluster of --ray-app (default: the one here)")
    parser.add_argument("--warmup-timeout", type=float, default=900.0, metavar="S",
                        help="with --ray-app: wait up to S seconds for the worker replicas to start and finish "
                             "compiling their programs in the background before measuring (default 900; 0: "
                             "do not wait)")
    return parser


def _workloads(args: argparse.Namespace) -> list[Workload]:
    chosen = list(WORKLOADS.values()) if args.workload == "all" else [WORKLOADS[args.workload]]
    overrides = {k: v for k in ("num_requests", "concurrency", "prompt_tokens", "output_tokens")
                 if (v := getattr(args, k)) is not None}
    return [dataclasses.replace(w, **overrides) for w in chosen]


async def _run(args: argparse.Namespace) -> tuple[list[list[WorkloadResult]], float | None]:
    """Every workload against every endpoint, and the float32 GEMM peak if measured."""
    if len(args.compare_model) > len(args.compare):
        raise SystemExit("raylm bench: more --compare-model than --compare URLs")
    models = args.compare_model + [None] * (len(args.compare) - len(args.compare_model))
    endpoints = [(args.base_url, args.model), *zip(args.compare, models)]
    endpoints = [(url, model or await default_model(url, args.api_key)) for url, model in endpoints]
    counters = ReplicaCounters(args.ray_app, args.ray_address) if args.ray_app else None
    if counters and args.warmup_timeout > 0:
        wait_until_warm(counters.warmup_programs_left, args.warmup_timeout)
    peak = None
    if counters and not args.no_gemm_peak:
        peak = float32_gemm_peak()
        m, n, k = PEAK_SHAPE
        print(f"float32 GEMM peak of the bench's machine (XLA dot, {m} x {n} x {k}): {peak:.0f} GFLOP/s\n", flush=True)
    runs = []
    for workload in _workloads(args):
        results = [await run_workload(url, model, workload, seed=args.seed, warmup=args.warmup, api_key=args.api_key,
                                      counters=counters if i == 0 else None, peak=peak)
                   for i, (url, model) in enumerate(endpoints)]
        print(format_table(results, peak) + "\n", flush=True)
        runs.append(results)
    return runs, peak


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        runs, peak = asyncio.run(_run(args))
    except httpx.HTTPError as exc:  # the model lookup: the server is down or not OpenAI-compatible
        print(f"raylm bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"float32_gemm_peak_gflops": peak, "runs": [[r.summary() for r in results] for results in runs]},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
