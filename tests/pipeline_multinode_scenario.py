"""A served replica split into two pipeline stages on two nodes, on one machine.

Run as ``python -m tests.pipeline_multinode_scenario`` (``tests/cluster/test_pipeline_multinode.py``
does). It starts its own two-node Ray cluster (``ray.cluster_utils.Cluster``: the head with
resource ``node_a``, a second raylet with ``node_b``, each with exactly one CPU) under a private
temp dir (``RAY_TMPDIR``: no other cluster on the machine is touched or found), and deploys raylm
with Serve on it: the bundled model, one replica, ``pipeline_parallel_size: 2``,
``pipeline_placement: spread``. Each stage's placement-group bundle takes one CPU, a node has one,
so the two stages must land on different nodes. Then it

* reads the replica's report (its stages: index, layers, node, process);
* sends concurrent greedy HTTP completions and, meanwhile, computes the same prompts' greedy
  completions with the offline ``LLM`` unsplit (``pipeline_parallel_size: 1``) in this process:
  the reference;
* starts long streams, SIGKILLs the stage process on the node the replica is not on, and records
  how each stream ended and when; then how long until the replica (replaced whole by Serve) serves
  again, where its new stages are, and its greedy answers again.

It prints one JSON line with its findings (and how long each part took) and always tears the
cluster down.
"""

from __future__ import annotations

import os
import tempfile

_TEMP_DIR = tempfile.mkdtemp(prefix="rppx", dir="/tmp")  # short: Ray's socket paths live under it
os.environ["RAY_TMPDIR"] = _TEMP_DIR

from raylm.cluster.local_ray import apply_local_ray_env  # noqa: E402

apply_local_ray_env()  # before ray is imported

import asyncio  # noqa: E402
import concurrent.futures  # noqa: E402
import copy  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from raylm.benchmarks.soak_bench import long_stream, seconds_until_serving  # noqa: E402
from tests.multinode_scenario import tear_down_private_cluster  # noqa: E402
from tests.serving import TEST_DEPLOY, free_port  # noqa: E402

MIB = 1 << 20
APP_NAME = "raylm"
PROMPTS = ["The capital of France is", "Water boils at a temperature of", "My favourite colour is"]
MAX_TOKENS = 12
STREAMS = 3
RECOVER_WITHIN_S = 120.0
DEPLOY: dict[str, Any] = copy.deepcopy(TEST_DEPLOY)
DEPLOY["workers"].update(num_replicas=1, num_cpus=1, pipeline_parallel_size=2, pipeline_placement="spread",
                         graceful_shutdown_timeout_s=1, health_check_period_s=1, health_check_timeout_s=10)
DEPLOY["engine"].update(num_kv_blocks=256, max_num_seqs=4, max_model_len=1024, num_scheduler_steps=1,
                        hidden_state_slots=0)


def reference_texts() -> list[str]:
    """The prompts' greedy completions of the unsplit model in this process: the served replica's
    engine arguments but ``pipeline_parallel_size: 1``."""
    from raylm.deploy.config import parse_deploy_config
    from raylm.workers.core.sampling_params import SamplingParams
    from raylm.workers.engine.llm import LLM

    config = parse_deploy_config(DEPLOY)
    engine = {**dataclasses.asdict(config.engine_args()), "pipeline_parallel_size": 1}
    llm = LLM(config.model.name, **engine)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
        return [o.outputs[0].text for o in outputs]
    finally:
        llm.engine.close()


def served_texts(base_url: str, model: str) -> list[str]:
    """The prompts' greedy completions over HTTP, sent at once (the replica batches them)."""
    def one(prompt: str) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        return response.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, PROMPTS))


def replica_stages() -> list[dict[str, Any]]:
    from raylm.workers.wire.replica_protocol import replica_reports

    (report,) = replica_reports(APP_NAME).values()
    return report.stages


async def kill_under_streams(base_url: str, model: str, pid: int) -> tuple[list[str], float, float]:
    """SIGKILL ``pid`` once ``STREAMS`` long streams have their first tokens; how they ended, the
    seconds from the kill to the last ending, and when the kill was (monotonic)."""
    first_chunk = asyncio.Event()
    async with httpx.AsyncClient(timeout=120) as client:
        tasks = [asyncio.create_task(long_stream(client, base_url, model, first_chunk)) for _ in range(STREAMS)]
        await asyncio.wait_for(first_chunk.wait(), 120)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        endings = await asyncio.gather(*tasks)
    return [kind for kind, _ in endings], max(t for _, t in endings) - killed_at, killed_at


def deploy(result: dict[str, Any], http_port: int) -> str:
    """Deploy on the cluster (``serve.run`` in a thread) while this thread computes the reference."""
    from ray import serve

    from raylm.deploy.app_builder import build_application
    from raylm.deploy.config import parse_deploy_config
    from raylm.deploy.readiness import wait_healthy

    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": http_port})
    config = parse_deploy_config({**DEPLOY, "route_prefix": "/"})
    application = build_application(config)
    errors: list[BaseException] = []

    def run_app() -> None:
        try:
            serve.run(application, name=APP_NAME, route_prefix="/")
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    started = time.perf_counter()
    thread = threading.Thread(target=run_app, daemon=True)
    thread.start()
    result["reference"] = reference_texts()
    result["reference_s"] = round(time.perf_counter() - started, 1)
    thread.join(300)
    if errors or thread.is_alive():
        raise RuntimeError(f"serve.run failed or did not finish: {errors}")
    base_url = f"http://127.0.0.1:{http_port}"
    wait_healthy(base_url, 120)
    result["deployed_s"] = round(time.perf_counter() - started, 1)
    return config.served_model_name


def run() -> dict[str, Any]:
    started = time.perf_counter()
    result: dict[str, Any] = {"ok": False}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 1}, "object_store_memory": 150 * MIB, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, resources={"node_b": 1}, object_store_memory=150 * MIB)
        ray.init(address=cluster.address, log_to_driver=False)
        result["cluster_nodes"] = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        http_port = free_port()
        base_url = f"http://127.0.0.1:{http_port}"
        model = deploy(result, http_port)

        result["stages"] = replica_stages()
        result["served"] = served_texts(base_url, model)

        last_node = result["stages"][-1]["node_id"]
        (other,) = [s for s in result["stages"] if s["node_id"] != last_node] or [None]
        if other is None:
            raise RuntimeError(f"the stages share a node: {result['stages']}")
        result["killed_stage"] = other["stage"]
        endings, longest, killed_at = asyncio.run(kill_under_streams(base_url, model, other["pid"]))
        result["endings"], result["last_ending_s"] = endings, round(longest, 1)
        result["serving_again_s"] = round(seconds_until_serving(base_url, model, killed_at, RECOVER_WITHIN_S), 1)
        result["stages_after"] = replica_stages()
        result["served_after"] = served_texts(base_url, model)
        result["ok"] = True
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        result["leftover_pids"] = tear_down_private_cluster(cluster, _TEMP_DIR)
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


if __name__ == "__main__":
    print(json.dumps(run()), flush=True)
