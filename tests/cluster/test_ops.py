"""Operating a cluster: ``raylm status``, ``raylm profile``, and autoscaling under load."""

from __future__ import annotations

import asyncio
import time

import httpx

from raylm.cluster.replicas import replica_stats, running_replicas
from raylm.deploy.cli import main
from raylm.workers.wire.replica_protocol import replica_reports
from tests.serving import TEST_DEPLOY


def test_status_shows_nodes_replicas_and_queue(raylm_app, capsys):
    # The app is ready once one worker replica has reported its batch slots; the router's
    # capacity counts the second replica's 16 from its first report on (a second or so).
    full = "Router queue: high 0, normal 0, low 0; running 0 of 32 slots"
    deadline = time.monotonic() + 30
    while True:
        assert main(["status", "--app", "raylm"]) == 0
        out = capsys.readouterr().out
        if full in out or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert "Nodes (1 alive)" in out
    assert "Application raylm: RUNNING" in out
    for replica_id in replica_stats("raylm"):
        assert replica_id in out
    assert full in out
    assert "serving" in out and "warming up" not in out  # the test deploy file compiles on first use


def test_status_names_a_missing_app(raylm_app, capsys):
    assert main(["status", "--app", "nope"]) == 1
    assert "No Serve application named 'nope'" in capsys.readouterr().out


def test_profile_writes_a_jax_trace(raylm_app, tmp_path, capsys):
    assert main(["profile", "--seconds", "1", "--out", str(tmp_path), "--app", "raylm"]) == 0
    trace_dir = capsys.readouterr().out.strip().splitlines()[-1]
    assert trace_dir.startswith(str(tmp_path))
    assert list(tmp_path.rglob("*.xplane.pb")), list(tmp_path.rglob("*"))


def test_llm_autoscaling_policy_scales_up_under_load_and_back_down(serve_cluster):
    app = serve_cluster.deploy({
        "name": "autoscale",
        "workers": {"autoscaling_config": {
            "min_replicas": 1, "max_replicas": 2, "policy": "llm", "target_batch_utilization": 0.5,
            "metrics_interval_s": 0.5, "look_back_period_s": 2, "upscale_delay_s": 1, "downscale_delay_s": 5,
        }, "graceful_shutdown_timeout_s": 20},
        # The session's pool and context (TEST_DEPLOY's), so its programs are those the other
        # apps compiled; two batch slots, so six clients overload one replica.
        "engine": {**TEST_DEPLOY["engine"], "max_num_seqs": 2},
    }, route_prefix="/autoscale")
    try:
        assert running_replicas("autoscale") == 1

        def body(client: int, n: int) -> dict:
            return {"model": app.model, "prompt": [1000 + 31 * client + n + j for j in range(30)],
                    "max_tokens": 24, "ignore_eos": True}

        async def warm_up() -> None:
            """Compile what the load runs (one and two rows) before it starts: a compile on first
            use under load would hold requests in the router's queue past its timeout (a 503),
            and that is not what this test is about."""
            async with httpx.AsyncClient(timeout=300) as client:
                for burst in (1, 2):
                    replies = await asyncio.gather(*(client.post(f"{app.base_url}/v1/completions",
                                                                 json=body(-10 * burst - i, 0)) for i in range(burst)))
                    assert [r.status_code for r in replies] == [200] * burst

        asyncio.run(warm_up())
        statuses: list[int] = []
        stop = asyncio.Event()

        async def load() -> None:
            async with httpx.AsyncClient(timeout=300) as client:
                async def one_client(i: int) -> None:
                    n = 0
                    while not stop.is_set():
                        statuses.append((await client.post(f"{app.base_url}/v1/completions",
                                                           json=body(i, n))).status_code)
                        n += 1
                await asyncio.gather(*(one_client(i) for i in range(6)))

        async def scenario() -> float:
            started = time.monotonic()
            task = asyncio.create_task(load())
            try:
                while True:
                    reports = await asyncio.to_thread(replica_reports, "autoscale")
                    if len(reports) == 2 and all(r.engine.requests > 0 for r in reports.values()):
                        return time.monotonic() - started
                    assert time.monotonic() - started < 240, "never scaled to a second serving replica"
                    await asyncio.sleep(1)
            finally:
                stop.set()
                await task

        scale_up_s = asyncio.run(scenario())
        print(f"second replica serving {scale_up_s:.1f} s after the load started")
        deadline = time.monotonic() + 120
        while running_replicas("autoscale") != 1:
            assert time.monotonic() < deadline, "did not scale back down"
            time.sleep(1)
        assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))
    finally:
        serve_cluster.remove(app)
