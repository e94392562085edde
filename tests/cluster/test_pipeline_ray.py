"""Pipeline stages as Ray actors on the session's cluster: the offline ``LLM`` with its first
stage in an actor of its own matches HF; a served replica of two stages answers HTTP
completions, shows its stages in its report, fails the streams in flight promptly when a
stage's process is killed, and is replaced whole by Serve. (Two stages on two nodes of the fake
multi-node cluster: tests/cluster/test_pipeline_multinode.py.)"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
import time

import httpx
import pytest
import ray

from raylm.benchmarks.soak_bench import greedy_answer, long_stream, seconds_until_serving, serves
from raylm.workers.core.sampling_params import SamplingParams
from raylm.workers.engine.llm import LLM
from raylm.workers.wire.replica_protocol import replica_reports
from tests.reference import hf_greedy
from tests.serving import TEST_DEPLOY

END_WITHIN_S = 30.0
RECOVER_WITHIN_S = 300.0


def test_offline_llm_with_a_stage_actor_matches_hf(serve_cluster, bundled_model, hf_bundled_model, bundled_path):
    ids = bundled_model.tokenizer.encode("The capital of France is")
    llm = LLM(str(bundled_path), pipeline_parallel_size=2, pipeline_placement="pack", max_num_batched_tokens=16,
              num_kv_blocks=64)
    try:
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=12, temperature=0.0))
        assert out[0].outputs[0].token_ids == hf_greedy(hf_bundled_model, ids, 12)
        (stage,) = llm.engine.runner.stages
        held = stage.describe()
        assert held["layers"] == [0, 15] and held["pid"] != os.getpid()
        llm.engine.runner.check_stages(5.0)
        ray.kill(stage.actor)
        with pytest.raises(RuntimeError, match="stage 0"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # (ray.kill is asynchronous)
                llm.engine.runner.check_stages(2.0)
                time.sleep(0.2)
        group = stage.own_group.id.hex()
    finally:
        llm.engine.close()
    # The stages' own placement group goes with them: its reservation is free again.
    assert ray.util.placement_group_table()[group]["state"] == "REMOVED"


@pytest.fixture(scope="module")
def pipeline_app(serve_cluster):
    config = copy.deepcopy(TEST_DEPLOY)
    config["name"] = "pipeline"
    config["workers"].update(num_replicas=1, graceful_shutdown_timeout_s=1, pipeline_parallel_size=2,
                             pipeline_placement="pack")
    config["engine"].update(num_scheduler_steps=1, hidden_state_slots=0)
    app = serve_cluster.deploy(config, route_prefix="/pipeline")
    yield app
    serve_cluster.remove(app)


def _stages(app_name: str) -> list[dict]:
    (report,) = replica_reports(app_name).values()
    return report.stages


def test_a_replica_of_two_stages_serves_and_a_dead_stage_replaces_it(pipeline_app, capsys):
    from raylm.deploy.cli import main

    app = pipeline_app
    before = greedy_answer(app.base_url, app.model)
    assert before.strip()
    stages = _stages(app.config.name)
    assert [(s["stage"], s["layers"]) for s in stages] == [(0, [0, 15]), (1, [15, 30])]
    assert stages[0]["pid"] != stages[1]["pid"]
    assert main(["status", "--app", app.config.name]) == 0
    rows = capsys.readouterr().out.split("Pipeline stages\n")[1].split("\n\n")[0].splitlines()[2:]
    assert [row.split()[1:3] for row in rows] == [["0", "0-14"], ["1", "15-29"]]
    assert [int(row.split()[-1]) for row in rows] == [s["pid"] for s in stages]

    async def kill_stage_under_streams() -> tuple[list[str], float, float]:
        first_chunk = asyncio.Event()
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [asyncio.create_task(long_stream(client, app.base_url, app.model, first_chunk)) for _ in range(3)]
            await asyncio.wait_for(first_chunk.wait(), 120)
            killed_at = time.monotonic()
            os.kill(stages[0]["pid"], signal.SIGKILL)
            endings = await asyncio.gather(*tasks)
        return [kind for kind, _ in endings], max(t for _, t in endings) - killed_at, killed_at

    endings, longest, killed_at = asyncio.run(kill_stage_under_streams())
    print(f"\nstage kill: endings {endings}, last {longest:.1f} s after the kill")
    assert all(kind == "error-event" or kind.startswith("status 5") for kind in endings), endings
    assert longest < END_WITHIN_S
    back = seconds_until_serving(app.base_url, app.model, killed_at, RECOVER_WITHIN_S)
    print(f"stage kill: served again {back:.1f} s after the kill")
    assert serves(app.base_url, app.model)
    assert {s["pid"] for s in _stages(app.config.name)}.isdisjoint({s["pid"] for s in stages})
    assert greedy_answer(app.base_url, app.model) == before
