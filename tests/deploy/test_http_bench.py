"""The HTTP load generator against a fake OpenAI server: exact counts, plausible timings, the CLI.

The fake (starlette + uvicorn on a free local port, in a background thread) streams a known
number of chunks with known sleeps, so every count the bench reports can be checked exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from typing import Any, AsyncIterator, Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from raylm.benchmarks.http_bench import (
    PROMPT_TOKEN_RANGE,
    WORKLOADS,
    Workload,
    WorkloadResult,
    format_table,
    percentile,
    run_workload,
)
from raylm.benchmarks.replica_counters import sum_replicas, wait_until_warm
from raylm.benchmarks.step_rates import step_rates
from raylm.cache.block_pool import PoolStats
from raylm.deploy import cli
from raylm.workers.core.engine_stats import ComputeStats, EngineStats, StepWork
from tests.serving import free_port

FIRST_DELAY_S = 0.03  # before the first chunk: the fake's "prefill"
CHUNK_DELAY_S = 0.01  # between chunks: the fake's "decode step"


@dataclasses.dataclass
class FakeBehaviour:
    """What the fake does; tests change it, the fixture resets it."""

    fail_every: int = 0  # every n-th completion request gets a 503 (0: never)
    tokens_per_chunk: int = 1
    send_usage: bool = True
    model_id: str = "fake-model"


class FakeOpenAIServer:
    """A minimal streaming ``/v1/completions`` and ``/v1/models`` that records the bodies it got."""

    def __init__(self) -> None:
        self.behaviour = FakeBehaviour()
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
        ])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> FakeOpenAIServer:
        self._thread.start()
        deadline = time.monotonic() + 5
        while not self._server.started:
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5)

    def reset(self) -> None:
        self.behaviour = FakeBehaviour()
        self.bodies.clear()
        self.auth.clear()

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.behaviour.model_id, "object": "model"}]})

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("authorization"))
        every = self.behaviour.fail_every
        if every and len(self.bodies) % every == 0:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        return StreamingResponse(self._stream(body["max_tokens"]), media_type="text/event-stream")

    async def _stream(self, max_tokens: int) -> AsyncIterator[str]:
        b = self.behaviour
        await asyncio.sleep(FIRST_DELAY_S)
        for i in range(0, max_tokens, b.tokens_per_chunk):
            if i:
                await asyncio.sleep(CHUNK_DELAY_S)
            n = min(b.tokens_per_chunk, max_tokens - i)
            yield _sse({"object": "text_completion", "choices": [{"index": 0, "text": "x" * n, "finish_reason": None}]})
        if b.send_usage:
            yield _sse({"object": "text_completion", "choices": [], "usage": {"completion_tokens": max_tokens}})
        yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[FakeOpenAIServer, FakeOpenAIServer]]:
    with FakeOpenAIServer() as first, FakeOpenAIServer() as second:
        yield first, second


@pytest.fixture
def fake(servers) -> FakeOpenAIServer:
    for server in servers:
        server.reset()
    return servers[0]


def _run(fake: FakeOpenAIServer, workload: Workload, **kwargs: Any):
    return asyncio.run(run_workload(fake.base_url, "fake-model", workload, **kwargs))


SMALL = Workload("small", num_requests=6, concurrency=3, prompt_tokens=16, output_tokens=5)


def test_percentile_hand_computed():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([1, 2, 3, 4], 50) == 2.5  # rank 1.5: halfway between 2 and 3
    assert percentile([10, 20, 30, 40, 50], 25) == 20
    assert percentile([0, 100], 99) == pytest.approx(99)  # rank 0.99 of the way from 0 to 100
    assert percentile([3, 1, 2], 100) == 3  # order of the input does not matter


def test_counts_and_timings(fake):
    result = _run(fake, SMALL, warmup=2)
    assert len(fake.bodies) == 2 + 6
    assert (result.completed, result.errors, result.output_tokens) == (6, 0, 6 * 5)
    assert len(result.ttft_s) == len(result.e2e_s) == 6
    assert len(result.itl_s) == 6 * 4  # gaps between 5 one-token chunks
    assert all(FIRST_DELAY_S <= t < FIRST_DELAY_S + 1.0 for t in result.ttft_s)
    assert CHUNK_DELAY_S * 0.8 <= percentile(result.itl_s, 50) < CHUNK_DELAY_S + 0.1
    assert all(e >= FIRST_DELAY_S + 4 * CHUNK_DELAY_S for e in result.e2e_s)
    assert result.output_tok_s == pytest.approx(30 / result.wall_s)
    assert result.requests_s == pytest.approx(6 / result.wall_s)


def test_request_bodies(fake):
    result = _run(fake, SMALL, warmup=1, api_key="sekrit")
    measured = fake.bodies[1:]
    for body in measured:
        assert body["model"] == "fake-model" and body["max_tokens"] == 5 and body["temperature"] == 0
        assert body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert len(body["prompt"]) == 16
        assert all(PROMPT_TOKEN_RANGE[0] <= t < PROMPT_TOKEN_RANGE[1] for t in body["prompt"])
    assert fake.auth == ["Bearer sekrit"] * 7
    # The warmup prompts differ from the measured ones (so the prefix cache stays cold).
    assert fake.bodies[0]["prompt"] not in [b["prompt"] for b in measured]
    assert result.errors == 0


def test_shared_prefix_prompts(fake):
    workload = dataclasses.replace(WORKLOADS["shared-prefix"], num_requests=4, concurrency=4, output_tokens=2)
    _run(fake, workload, warmup=0)
    prompts = [b["prompt"] for b in fake.bodies]
    assert all(len(p) == 512 + 32 for p in prompts)
    assert all(p[:512] == prompts[0][:512] for p in prompts)
    assert len({tuple(p[512:]) for p in prompts}) == 4


def test_errors_are_counted(fake):
    fake.behaviour.fail_every = 3
    result = _run(fake, dataclasses.replace(SMALL, num_requests=9), warmup=0)
    assert (result.completed, result.errors, result.output_tokens) == (6, 3, 6 * 5)
    assert len(result.ttft_s) == 6
    assert result.error_messages and all(m.startswith("HTTP 503") for m in result.error_messages)


def test_multi_token_chunks_use_usage(fake):
    fake.behaviour.tokens_per_chunk = 2
    result = _run(fake, SMALL, warmup=0)
    assert result.output_tokens == 6 * 5  # from usage, not the 3 chunks each
    assert len(result.itl_s) == 6 * 2  # per-chunk gaps


def test_without_usage_chunks_are_counted(fake):
    fake.behaviour.send_usage = False
    result = _run(fake, SMALL, warmup=0)
    assert (result.completed, result.output_tokens) == (6, 6 * 5)


def test_unreachable_endpoint_counts_errors():
    result = asyncio.run(run_workload(f"http://127.0.0.1:{free_port()}", "m", SMALL, warmup=0))
    assert (result.completed, result.errors, result.output_tokens) == (0, 6, 0)
    assert result.error_messages[0].startswith("ConnectError")


def test_cli_single_stream(fake, capsys, tmp_path):
    out_json = tmp_path / "bench.json"
    rc = cli.main(["bench", "--base-url", fake.base_url, "--workload", "single-stream", "--num-requests", "3",
                   "--output-tokens", "4", "--json", str(out_json)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "== single-stream: 3 requests x (128 prompt + 4 output tokens), concurrency 1 ==" in out
    assert f"A = {fake.base_url} (model fake-model)" in out
    assert "output tok/s" in out and "TTFT p50 (ms)" in out and "A/B" not in out
    assert len(fake.bodies) == 2 + 3  # default warmup is 2
    [[summary]] = json.loads(out_json.read_text())["runs"]
    assert (summary["completed"], summary["errors"], summary["output_tokens"]) == (3, 0, 12)


def test_cli_compare_prints_ratios(servers, fake, capsys):
    first, second = servers
    second.behaviour.model_id = "/models/other.gguf"
    rc = cli.main(["bench", "--base-url", first.base_url, "--compare", second.base_url, "--workload", "throughput",
                   "--num-requests", "4", "--concurrency", "2", "--output-tokens", "3", "--warmup", "0"])
    assert rc == 0
    out = capsys.readouterr().out
    assert f"B = {second.base_url} (model /models/other.gguf)" in out
    assert second.bodies[0]["model"] == "/models/other.gguf" and first.bodies[0]["model"] == "fake-model"
    header = next(line for line in out.splitlines() if line.rstrip().endswith("A/B"))
    assert header.split() == ["A", "B", "A/B"]
    rate_row = next(line for line in out.splitlines() if line.strip().startswith("output tok/s"))
    assert rate_row.rstrip().endswith("x")
    errors_row = next(line for line in out.splitlines() if line.strip().startswith("errors"))
    assert errors_row.split()[1:] == ["0", "0"]


def test_cli_compares_against_the_best_of_several_peers(servers, capsys):
    first, second = servers
    rc = cli.main(["bench", "--base-url", first.base_url, "--compare", second.base_url, "--compare", first.base_url,
                   "--compare-model", "peer-model", "--workload", "single-stream", "--num-requests", "2",
                   "--output-tokens", "3", "--warmup", "0", "--json", "/dev/null"])
    assert rc == 0
    out = capsys.readouterr().out
    assert f"C = {first.base_url} (model fake-model)" in out  # C's model: looked up
    assert second.bodies[-1]["model"] == "peer-model"
    header = next(line for line in out.splitlines() if line.rstrip().endswith("A/best"))
    assert header.split() == ["A", "B", "C", "A/best"]
    rate = next(line.split() for line in out.splitlines() if line.strip().startswith("output tok/s"))
    # (the cells are rounded, the ratios computed from the unrounded numbers)
    assert float(rate[-1][:-1]) == pytest.approx(float(rate[2]) / max(float(rate[3]), float(rate[4])), abs=0.02)
    ttft = next(line.split() for line in out.splitlines() if line.strip().startswith("TTFT p50"))
    assert float(ttft[-1][:-1]) == pytest.approx(float(ttft[3]) / min(float(ttft[4]), float(ttft[5])), abs=0.02)


def _replica(integer: bool = False, **kinds: StepWork) -> EngineStats:
    """A replica's report with only its step counters set (the kinds not given: none run)."""
    pool = PoolStats(num_free_blocks=8, num_used_blocks=0, num_cached_blocks=0, num_usable_blocks=8, usage=0.0,
                     prefix_queries=0, prefix_hits=0)
    work = {kind: kinds.get(kind, StepWork()) for kind in ("prefill", "decode", "mixed", "verify")}
    return EngineStats(running=0, waiting=0, waiting_tokens=0, work_tokens=0, tokens_stored=0, token_capacity=0,
                       num_preemptions=0, requests=0, prompt_tokens=0, generation_tokens=0, pool=pool,
                       compute=ComputeStats(integer, work))


def test_step_kind_lines_from_two_readings_of_two_replicas():
    """Replica 1 ran 2 prefill steps (256 tokens, 0.5 s, 100 GFLOP) and 10 decode steps (80
    tokens, 0.4 s, 4 GFLOP) between the readings, replica 2 one prefill step (128 tokens,
    0.25 s, 50 GFLOP): prefill 150 GFLOP in 0.75 s = 200 GFLOP/s = 40% of a 500 GFLOP/s peak,
    decode 4 / 0.4 = 10 GFLOP/s = 2%; no mixed or verify step ran, so neither has a line."""
    before = sum_replicas([_replica(prefill=StepWork(2, 256, 0.5, 100 * 10**9)), _replica()])
    after = sum_replicas([_replica(prefill=StepWork(4, 512, 1.0, 200 * 10**9), decode=StepWork(10, 80, 0.4, 4 * 10**9)),
                          _replica(prefill=StepWork(1, 128, 0.25, 50 * 10**9))])
    rates = step_rates(before.compute, after.compute, peak=500.0)
    assert rates == {"unit": "GFLOP/s", "kinds": {
        "prefill": {"steps": 3, "tokens": 384, "seconds": 0.75, "rate": 200.0, "percent_of_peak": 40.0},
        "decode": {"steps": 10, "tokens": 80, "seconds": pytest.approx(0.4), "rate": pytest.approx(10.0),
                   "percent_of_peak": pytest.approx(2.0)}}}
    raylm = WorkloadResult("http://raylm", "m", SMALL, 1.0, 6, 0, 30, [0.1], [0.01], [0.2], [], step_rates=rates)
    peer = dataclasses.replace(raylm, base_url="http://llama-server", step_rates=None)
    lines = format_table([raylm, peer], peak=500.0).splitlines()
    at = lines.index("  A: model steps over the measured run, all replicas; % of the float32 GEMM peak of the "
                     "bench's machine (500 GFLOP/s)")
    assert [line.split() for line in lines[at + 1:]] == [
        ["step", "kind", "steps", "tokens", "seconds", "GFLOP/s", "%", "peak"],
        ["prefill", "3", "384", "0.750", "200", "40%"],
        ["decode", "10", "80", "0.400", "10", "2%"],
    ]  # and no lines for B, which reported none
    assert raylm.summary()["step_rates"] == rates and peer.summary()["step_rates"] is None
    # Integer matmuls: integer operations per second; without a measured peak, no percentage.
    integer = step_rates(_replica(True).compute, _replica(True, verify=StepWork(1, 4, 0.5, 10**9)).compute, None)
    result = dataclasses.replace(raylm, step_rates=integer)
    assert format_table([result]).splitlines()[-3:] == [
        "  A: model steps over the measured run, all replicas (integer operations); % of the float32 GEMM peak of "
        "the bench's machine (not measured)",
        "    step kind  steps  tokens  seconds  GOP/s  % peak",
        "    verify         1       4    0.500      2       -",
    ]


def test_cli_bench_needs_a_mode(capsys):
    assert cli.main(["bench"]) == 2
    assert "--offline" in capsys.readouterr().err
    assert cli.main(["bench", "--offline", "--base-url", "http://x"]) == 2


def test_cli_unreachable_model_lookup(capsys):
    assert cli.main(["bench", "--base-url", f"http://127.0.0.1:{free_port()}", "--workload", "single-stream"]) == 2
    assert "ConnectError" in capsys.readouterr().err


class _Clock:
    """A fake clock that ``sleep`` advances."""

    def __init__(self) -> None:
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_replica_warmup_is_summed_and_waited_for():
    """Two replicas with 3 and 2 programs left report 5; the bench polls until they are 0, says
    once that it waits, and measures nothing before."""
    assert sum_replicas([dataclasses.replace(_replica(), warmup_programs_left=3),
                         dataclasses.replace(_replica(), warmup_programs_left=2)]).warmup_programs_left == 5
    left, said, clock = iter([5, 4, 1, 0]), [], _Clock()
    assert wait_until_warm(lambda: next(left), 60, poll_s=2, say=said.append, clock=lambda: clock.now,
                           sleep=clock.sleep)
    assert clock.now == 6 and said == ["waiting for the replicas' warm-up: 5 programs left to compile"]
    # Already warm: no wait, nothing said.
    said.clear()
    assert wait_until_warm(lambda: 0, 60, say=said.append, clock=lambda: clock.now, sleep=clock.sleep)
    assert said == [] and clock.now == 6


def test_bench_waits_for_worker_replicas_to_start():
    """The router answers before any worker replica does (None): the bench waits for one, then
    for its warm-up, saying each once; a replica count comes with the totals."""
    assert sum_replicas([_replica(), _replica()]).replicas == 2 and sum_replicas([]).replicas == 0
    left, said, clock = iter([None, None, 3, 2, 0]), [], _Clock()
    assert wait_until_warm(lambda: next(left), 60, poll_s=2, say=said.append, clock=lambda: clock.now,
                           sleep=clock.sleep)
    assert clock.now == 8
    assert said == ["waiting for the application's worker replicas to start",
                    "waiting for the replicas' warm-up: 3 programs left to compile"]
    said.clear()
    assert not wait_until_warm(lambda: None, 4, poll_s=2, say=said.append, clock=lambda: clock.now, sleep=clock.sleep)
    assert said[-1] == "warning: no worker replica answered after 4 s; the figures below include their start-up"


def test_replica_warmup_wait_gives_up_with_a_warning():
    """Programs that never finish: the wait ends at the timeout and says the figures include them."""
    said, clock = [], _Clock()
    assert not wait_until_warm(lambda: 7, 10, poll_s=2, say=said.append, clock=lambda: clock.now, sleep=clock.sleep)
    assert clock.now == 10
    assert said[-1] == ("warning: still 7 warm-up programs left after 10 s; the figures below include their "
                        "compilation")
