"""Pipeline parallelism on two nodes against one node on the same cores (issue 68's numbers).

Starts a private two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: two raylets,
node A and node B, one CPU each, each with a Ray ``memory`` resource of 3/4 of the model's weights)
and runs the offline ``LLM`` in a Ray actor (``pipeline_host.py``; not Serve), one layout after the
other on the same two cores:

- ``pp1``: the whole model in one process on node A, its threads pinned to both cores (XLA's pool
  of two threads); it reserves no ``memory`` (the limit is the third case's);
- ``pp2``: two stages, one per node (a ``STRICT_SPREAD`` placement group of two bundles of one CPU
  and 3/4 of the weights' bytes each: the host takes bundle 0 and is the last stage, the first
  stage's actor bundle 1), each stage process pinned to a core of its own (``NPROC=1``: XLA's pool
  of one thread);
- ``pp1 placed like pp2``: a placement group of one bundle reserving the whole weights' bytes, which
  no node has: Ray reports it infeasible (asked within a bounded wait), so only ``pp2`` serves a
  model larger than a node's memory limit.

Per layout: greedy batches of 1, 4 and 16 prompts at once (each compiled by a first pass of the
same shapes; prefix caching off, so each pass computes its prompts); output tokens/s; the
single-stream time per output token (the 1-prompt batch's wall less a 1-token batch's, over the
other tokens); the bubble fraction of each stage over each batch (1 - busy / wall,
``PipelineRunner.stage_busy_seconds``); the resident memory of each process (RSS) and the weight and
KV bytes each stage holds. Then the time of a ``ray.get`` on node A of a stage output made on node
B (``[16, 1, D]``: a decode step; ``[512, 1, D]``: a prompt chunk), and the ratios pp2 / pp1
against the issue's targets (memory per node <= 0.6, 16-stream tokens/s >= 0.8, TPOT <= 1.3).

    python -m raylm.benchmarks.random_checkpoint /tmp/llama-1b --tokenizer DIR --shape 1b
    python -m raylm.benchmarks.pipeline_bench --model /tmp/llama-1b [--json out.json]
    python -m raylm.benchmarks.pipeline_bench --smoke --model TINY_HF_DIR   # seconds: checks it runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MIB = 1 << 20
NODE_SHARE = 0.75  # each node's memory resource, of the whole model's weights
ITEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TARGETS = {"memory_per_node": ("<=", 0.6), "tok_s_16": (">=", 0.8), "tpot": ("<=", 1.3)}


@dataclasses.dataclass(frozen=True)
class Workload:
    levels: tuple[int, ...] = (1, 4, 16)
    prompt_tokens: int = 32
    max_tokens: int = 32
    engine: dict[str, Any] = dataclasses.field(default_factory=lambda: {
        "max_num_seqs": 16, "max_num_batched_tokens": 512, "max_model_len": 128, "num_kv_blocks": 160,
        "enable_prefix_caching": False, "compilation_cache_dir": "~/.cache/raylm/jax"})
    transfer_repeats: int = 20
    infeasible_wait_s: float = 15.0


SMOKE = Workload(prompt_tokens=8, max_tokens=4, transfer_repeats=3, infeasible_wait_s=10.0, engine={
    "max_num_seqs": 16, "max_num_batched_tokens": 128, "max_model_len": 64, "num_kv_blocks": 64,
    "enable_prefix_caching": False})


# -- arithmetic ---------------------------------------------------------------------------------
def bubble_fractions(busy_s: list[float], wall_s: float) -> list[float]:
    """Each stage's share of ``wall_s`` spent outside steps."""
    return [1.0 - busy / wall_s for busy in busy_s]


def time_per_output_token(wall_s: float, first_token_wall_s: float, tokens: int) -> float:
    """Seconds per token after the first: a ``tokens``-token batch's wall less a 1-token batch's."""
    return (wall_s - first_token_wall_s) / (tokens - 1)


def ratios(pp1: dict[str, Any], pp2: dict[str, Any]) -> dict[str, float]:
    """pp2 / pp1 of the issue's figures; memory per node: the larger node's over the one node's."""
    return {
        "memory_per_node": max(pp2["rss_bytes"]) / max(pp1["rss_bytes"]),
        "held_bytes_per_node": max(pp2["held_bytes"]) / max(pp1["held_bytes"]),
        "tok_s_16": pp2["tok_s"][str(16)] / pp1["tok_s"][str(16)],
        "tpot": pp2["tpot_s"] / pp1["tpot_s"],
    }


def meets(name: str, value: float) -> bool:
    op, bound = TARGETS[name]
    return value <= bound if op == "<=" else value >= bound


def served_weight_bytes(model: Path, dtype: str) -> int:
    """The checkpoint's tensor bytes as served in ``dtype`` (safetensors stored in config.json's
    ``dtype``, ``torch_dtype`` before transformers 5): weights stored narrower than ``dtype`` stay
    as stored (a bfloat16 file served float32 holds its bfloat16 matrices, computing in float32)."""
    config = json.loads((model / "config.json").read_text())
    stored = config.get("dtype") or config.get("torch_dtype") or "float32"
    stored_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    return stored_bytes * min(ITEM_BYTES[dtype], ITEM_BYTES[stored]) // ITEM_BYTES[stored]


def prompts_of(count: int, tokens: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    return [rng.randint(3, 300, size=tokens).tolist() for _ in range(count)]


# -- the cluster -------------------------------------------------------------------------------
def start_cluster(node_memory: int) -> Any:
    """Two raylets with one CPU, a ``node_a`` / ``node_b`` resource and ``node_memory`` each."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 1}, "memory": node_memory, "object_store_memory": 256 * MIB,
        "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"node_b": 1}, memory=node_memory, object_store_memory=256 * MIB)
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def infeasible_whole_model(weight_bytes: int, wait_s: float) -> dict[str, Any]:
    """Ask for one bundle of the whole weights' memory; Ray's verdict within ``wait_s``."""
    from ray.util import placement_group_table
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group([{"CPU": 1, "memory": weight_bytes}])
    started, state = time.monotonic(), None
    try:
        while time.monotonic() - started < wait_s:
            state = placement_group_table(group)["stats"]["scheduling_state"]
            if state == "INFEASIBLE" or group.wait(timeout_seconds=0.5):
                break
        placed = group.wait(timeout_seconds=0)
    finally:
        remove_placement_group(group)
    return {"requested_memory_bytes": weight_bytes, "placed": placed, "scheduling_state": state,
            "seconds": round(time.monotonic() - started, 1)}


def measure(host: Any, work: Workload) -> dict[str, Any]:
    """The layout's batches (each after a compiling pass of the same shapes)."""
    import ray

    batches = {n: prompts_of(n, work.prompt_tokens, seed=n) for n in work.levels}
    single = prompts_of(1, work.prompt_tokens, seed=0)
    for n, prompts in batches.items():
        ray.get(host.run.remote(prompts, work.max_tokens))
    ray.get(host.run.remote(single, 1))
    runs = {n: ray.get(host.run.remote(prompts, work.max_tokens)) for n, prompts in batches.items()}
    first = ray.get(host.run.remote(single, 1))
    return {
        "tok_s": {str(n): r["output_tokens"] / r["wall_s"] for n, r in runs.items()},
        "wall_s": {str(n): r["wall_s"] for n, r in runs.items()},
        "tpot_s": time_per_output_token(runs[1]["wall_s"], first["wall_s"], work.max_tokens),
        "bubble": {str(n): bubble_fractions(r["busy_s"], r["wall_s"]) for n, r in runs.items()},
        "tokens": {str(n): r["tokens"] for n, r in runs.items()},
    }


def run_layout(model: str, dtype: str, work: Workload, pp: int, node_memory: int) -> dict[str, Any]:
    """One layout's figures (module docstring), its processes pinned, then ended."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raylm.benchmarks.pipeline_host import EngineHost, pin_process, resident_bytes

    cores = sorted(os.sched_getaffinity(0))[:2]
    engine = {**work.engine, "pipeline_parallel_size": pp}
    group = None
    if pp == 1:  # node A, XLA's pool over both cores
        options = dict(num_cpus=1, resources={"node_a": 0.01}, runtime_env={"env_vars": {"NPROC": str(len(cores))}})
    else:
        group = placement_group([{"CPU": 1, "memory": node_memory}] * pp, strategy="STRICT_SPREAD")
        ray.get(group.ready(), timeout=60)
        options = dict(num_cpus=1, memory=node_memory, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group, placement_group_bundle_index=0))
        engine["pipeline_placement"] = "spread"
    started = time.perf_counter()
    host = ray.remote(EngineHost).options(max_restarts=0, **options).remote(model, dtype, engine)
    try:
        stages = ray.get(host.processes.remote(), timeout=1800)["stages"]
        out: dict[str, Any] = {"load_s": time.perf_counter() - started, "stages": stages}
        pins = [set(cores)] if pp == 1 else [{core} for core in cores]
        out["pinned"] = []
        for stage, stage_cores in zip(stages, pins):
            threads, pool = pin_process(stage["pid"], stage_cores)
            out["pinned"].append(f"pid {stage['pid']} ({threads} threads, XLA pool {pool}) -> "
                                 f"cores {sorted(stage_cores)}")
        started = time.perf_counter()
        out.update(measure(host, work))
        out["measure_s"] = time.perf_counter() - started
        out["rss_bytes"] = [resident_bytes(s["pid"]) for s in stages]
        out["held"] = ray.get(host.held_bytes.remote())
        out["held_bytes"] = [h["weight_bytes"] + h["kv_bytes"] for h in out["held"]]
        ray.get(host.close.remote())
    finally:
        ray.kill(host, no_restart=True)
        if group is not None:
            remove_placement_group(group)
    return out


def transfer_ms(hidden_size: int, dtype: str, repeats: int) -> dict[str, float]:
    """Median ms of a ``ray.get`` on node A of an array made (and stored) on node B: a decode
    step's stage output ``[16, 1, D]`` and a prompt chunk's ``[512, 1, D]``."""
    import ray

    @ray.remote(num_cpus=0, resources={"node_b": 0.01})
    def make(rows: int) -> list[np.ndarray]:
        import ml_dtypes  # (numpy's own dtypes lack bfloat16)

        served = np.dtype(getattr(ml_dtypes, dtype, dtype))
        return [np.random.default_rng(rows).standard_normal((rows, 1, hidden_size)).astype(served)]

    @ray.remote(num_cpus=0, resources={"node_a": 0.01})
    def fetch(wrapped: list) -> float:
        started = time.perf_counter()
        ray.get(wrapped[0])
        return time.perf_counter() - started

    out = {}
    for rows in (16, 512):
        times = []
        for _ in range(repeats):
            ref = make.remote(rows)
            ray.wait([ref], fetch_local=False)
            times.append(ray.get(fetch.remote([ref])))
        out[f"[{rows}, 1, {hidden_size}]"] = statistics.median(times) * 1e3
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure, on a cluster of this process's own (torn down at the end)."""
    import ray

    from raylm.model.config.model_info import load_model_info

    work = SMOKE if args.smoke else Workload()
    model = Path(args.model)
    weights = served_weight_bytes(model, args.dtype)
    node_memory = int(weights * NODE_SHARE)
    report: dict[str, Any] = {"model": str(model), "dtype": args.dtype, "weight_bytes": weights,
                              "node_memory_bytes": node_memory, "engine": "offline LLM in a Ray actor"}
    cluster = start_cluster(node_memory)
    try:
        report["pp1_whole_model_reservation"] = infeasible_whole_model(weights, work.infeasible_wait_s)
        report["pp1"] = run_layout(str(model), args.dtype, work, 1, node_memory)
        report["pp2"] = run_layout(str(model), args.dtype, work, 2, node_memory)
        hidden = load_model_info(str(model)).config.hidden_size
        report["transfer_ms"] = transfer_ms(hidden, args.dtype, work.transfer_repeats)
    finally:
        ray.shutdown()
        cluster.shutdown()
    report["same_tokens"] = report["pp1"].pop("tokens") == report["pp2"].pop("tokens")
    report["ratios"] = ratios(report["pp1"], report["pp2"])
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


def print_report(report: dict[str, Any]) -> None:
    print(f"== pipeline parallelism: {report['model']} ({report['dtype']}, weights {report['weight_bytes'] / MIB:.0f} "
          f"MiB, node memory resource {report['node_memory_bytes'] / MIB:.0f} MiB)")
    for name in ("pp1", "pp2"):
        r = report[name]
        tok_s = " / ".join(f"{v:.1f}" for v in r["tok_s"].values())
        bubbles = "; ".join(f"{n}: " + ", ".join(f"{b:.2f}" for b in v) for n, v in r["bubble"].items() if v)
        print(f"{name}: RSS per process (MiB) {[round(b / MIB) for b in r['rss_bytes']]}, weights+KV "
              f"{[round(b / MIB) for b in r['held_bytes']]}; tok/s at {'/'.join(r['tok_s'])} streams {tok_s}; "
              f"TPOT {r['tpot_s'] * 1e3:.1f} ms; bubble per stage {bubbles or '-'}; loaded in {r['load_s']:.0f} s, "
              f"measured in {r['measure_s']:.0f} s; pinned {', '.join(r['pinned'])}")
    reservation = report["pp1_whole_model_reservation"]
    print(f"pp1 reserving the whole weights: placed {reservation['placed']}, Ray's state "
          f"{reservation['scheduling_state']} after {reservation['seconds']} s")
    print("stage-to-stage ray.get (ms, median): " + ", ".join(f"{k} {v:.2f}" for k, v in report["transfer_ms"].items()))
    print(f"greedy tokens pp1 == pp2: {report['same_tokens']}")
    for name, value in report["ratios"].items():
        target = f" (target {' '.join(map(str, TARGETS[name]))}: {'met' if meets(name, value) else 'MISSED'})" \
            if name in TARGETS else ""
        print(f"pp2 / pp1 {name}: {value:.2f}{target}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF checkpoint directory (random_checkpoint.py --shape 1b)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--smoke", action="store_true", help="a few tokens a batch: checks the script runs")
    parser.add_argument("--json", default=None, help="also write the report here")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # Before Ray is imported: a private temp dir (no other cluster found or touched), local-only
    # settings, and XLA's pool of one thread in every process the cluster starts (pp1's own two).
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rppb", dir="/tmp")
    os.environ["NPROC"] = "1"
    from raylm.cluster.local_ray import apply_local_ray_env

    apply_local_ray_env()
    try:
        run(args)
    finally:
        shutil.rmtree(os.environ["RAY_TMPDIR"], ignore_errors=True)


if __name__ == "__main__":
    main()
