"""``raylm status``: the cluster at a glance: nodes, worker replicas with their role, load, KV use
(in the pool and in the offload tiers beyond it) and (for a mixture of experts) expert-parallel
layout and load balance, each pipeline stage's layers, node and process, and the router's queue."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from raylm.cache.offload.tier import TierStats
from raylm.cluster.local_ray import apply_local_ray_env
from raylm.cluster.names import DEFAULT_APP_NAME, ROUTER_DEPLOYMENT
from raylm.deploy.byte_sizes import format_bytes_of
from raylm.workers.core.engine_stats import EngineStats, LoraStats, MoeStats
from raylm.workers.core.speculation import SpecDecodeStats
from raylm.workers.wire.replica_protocol import PERIODIC_READ_WAIT_S


def add_status_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("status", help="show nodes, replicas, load, KV use and queue depth")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: the one running here)")
    p.add_argument("--app", default=DEFAULT_APP_NAME, help="Serve application name (deploy file's `name`)")
    p.set_defaults(run=run_status)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def speculation_summary(spec: SpecDecodeStats | None) -> str:
    """``accepted/guessed (rate), mean per step`` of a replica's speculative decoding, or "off"."""
    if spec is None:
        return "off"
    drafted, accepted = spec.num_draft_tokens, spec.num_accepted_tokens
    rate = f"{100 * spec.acceptance_rate:.0f}%" if drafted else "-"
    mean = f"{spec.mean_accepted:.2f}" if spec.num_drafts else "-"
    return f"{accepted}/{drafted} ({rate}), {mean} per step"


def lora_summary(lora: LoraStats | None) -> str:
    """The adapters resident on a replica's device, or "off"."""
    if lora is None:
        return "off"
    return ", ".join(lora.resident) or "none"


def kv_offload_summary(tiers: Sequence[TierStats] | None) -> str:
    """Each KV offload tier's use, nearest first: bytes held of its capacity, the share of the
    blocks loads asked it for that it returned, and its failures by kind (each cost a recompute,
    never a request): ``host 1.2/4.0 GiB 93% hits, disk 0.5/64.0 GiB no loads (errors: 2 corrupt)``;
    "off" without offload."""
    if tiers is None:
        return "off"
    parts = []
    for tier in tiers:
        asked = tier.hits + tier.misses
        hits = f"{100 * tier.hits / asked:.0f}% hits" if asked else "no loads"
        part = f"{tier.tier} {format_bytes_of(tier.stored_bytes, tier.capacity_bytes)} {hits}"
        errors = ", ".join(f"{count} {kind}" for kind, count in sorted(tier.errors.items()) if count)
        parts.append(f"{part} (errors: {errors})" if errors else part)
    return ", ".join(parts)


def state_summary(engine: EngineStats, busy_s: float = 0.0) -> str:
    """Whether a replica still compiles programs in the background (it serves meanwhile; a
    request may then wait for one of them), else "serving"; and whether its engine thread has
    been in one step (or compile) for longer than its stats readers wait, so that its stats are
    from before it."""
    left = engine.warmup_programs_left
    state = f"warming up ({left} programs left)" if left else "serving"
    if busy_s >= PERIODIC_READ_WAIT_S:
        state += f", in one step for {busy_s:.0f} s (figures from before it)"
    return state


def experts_summary(moe: MoeStats | None) -> str:
    """A replica's expert-parallel layout (``ep x tp`` devices, experts per device) and how evenly
    its tokens spread over the experts, or "-" for a model without experts."""
    if moe is None:
        return "-"
    balance = f", busiest {moe.imbalance:.2f}x mean" if moe.imbalance else ""
    return (f"ep {moe.expert_parallel_size} x tp {moe.tensor_parallel_size}, "
            f"{moe.experts_per_device} of {moe.num_experts} per device{balance}")


def run_status(args: argparse.Namespace) -> int:
    apply_local_ray_env()
    import ray
    from ray import serve

    from raylm.workers.wire.replica_protocol import replica_reports

    if not ray.is_initialized():
        try:
            ray.init(address=args.address, log_to_driver=False)
        except ConnectionError as err:
            print(f"raylm status: no Ray cluster at {args.address}: {err}", file=sys.stderr)
            return 2
    nodes = [n for n in ray.nodes() if n["Alive"]]
    print(f"Nodes ({len(nodes)} alive)")
    print(table(["node", "address", "CPU", "GPU", "memory GiB"], [
        [n["NodeID"][:12], n["NodeManagerAddress"], n["Resources"].get("CPU", 0), n["Resources"].get("GPU", 0),
         f"{n['Resources'].get('memory', 0) / 2**30:.1f}"] for n in nodes
    ]))
    status = serve.status().applications.get(args.app)
    if status is None:
        print(f"\nNo Serve application named {args.app!r} (running: {sorted(serve.status().applications)})")
        return 1
    print(f"\nApplication {args.app}: {status.status.value}")
    print(table(["deployment", "status", "replicas"], [
        [name, d.status.value, ", ".join(f"{n} {state.value if hasattr(state, 'value') else state}"
                                         for state, n in d.replica_states.items())]
        for name, d in status.deployments.items()
    ]))
    reports = replica_reports(args.app)
    print("\nWorker replicas")
    print(table(["replica", "role", "node", "state", "running", "waiting", "loading", "queued tokens", "KV used",
                 "KV offload", "requests", "generated", "spec accepted", "LoRA adapters", "experts"], [
        [rid, r.role, r.node_id[:12], state_summary(r.engine, r.busy_s), r.engine.running, r.engine.waiting,
         r.engine.loading, r.engine.waiting_tokens, f"{100 * r.engine.pool.usage:.1f}%",
         kv_offload_summary(r.engine.kv_offload), r.engine.requests, r.engine.generation_tokens,
         speculation_summary(r.engine.spec), lora_summary(r.engine.lora), experts_summary(r.engine.moe)]
        for rid, r in sorted(reports.items(), key=lambda item: (item[1].role, item[0]))
    ]))
    staged = sorted(((rid, stage) for rid, r in reports.items() for stage in r.stages),
                    key=lambda item: (item[0], item[1]["stage"]))
    if staged:
        print("\nPipeline stages")
        print(table(["replica", "stage", "layers", "node", "pid"], [
            [rid, stage["stage"], f"{stage['layers'][0]}-{stage['layers'][1] - 1}", (stage["node_id"] or "-")[:12],
             stage["pid"]] for rid, stage in staged
        ]))
    try:
        router = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=args.app)
        queue = router.queue_status.remote().result(timeout_s=10)
        queued = ", ".join(f"{name} {depth}" for name, depth in queue["queued"].items())
        print(f"\nRouter queue: {queued}; running {queue['in_flight']} of {queue['capacity']} slots")
    except Exception as err:  # the table above is still useful without it
        print(f"\nRouter queue: unavailable ({type(err).__name__})")
    return 0
