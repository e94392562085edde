"""``raylm status``: the cluster at a glance: nodes, worker replicas with their load and KV use,
and the router's queue."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Sequence

from deploy.serve_command import LOCAL_RAY_ENV


def add_status_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("status", help="show nodes, replicas, load, KV use and queue depth")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: the one running here)")
    p.add_argument("--app", default="raylm", help="Serve application name (deploy file's `name`)")
    p.set_defaults(run=run_status)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def speculation_summary(stats: dict[str, Any]) -> str:
    """``accepted/guessed (rate), mean per step`` of a replica's speculative decoding, or "off"."""
    if "spec_draft_tokens" not in stats:
        return "off"
    drafted, accepted, steps = stats["spec_draft_tokens"], stats["spec_accepted_tokens"], stats["spec_num_drafts"]
    rate = f"{100 * accepted / drafted:.0f}%" if drafted else "-"
    mean = f"{accepted / steps:.2f}" if steps else "-"
    return f"{accepted}/{drafted} ({rate}), {mean} per step"


def run_status(args: argparse.Namespace) -> int:
    for key, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(key, value)
    import ray
    from ray import serve

    from cluster.replicas import replica_stats

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
    stats = replica_stats(args.app, "LLMWorker")
    print("\nWorker replicas")
    print(table(["replica", "node", "running", "waiting", "queued tokens", "KV used", "requests", "generated",
                 "spec accepted"], [
        [rid, str(s.get("node_id", "?"))[:12], s["running"], s["waiting"], s["waiting_tokens"],
         f"{100 * s['kv_usage']:.1f}%", s["requests"], s["generation_tokens"], speculation_summary(s)]
        for rid, s in sorted(stats.items())
    ]))
    try:
        router = serve.get_deployment_handle("OpenAIRouter", app_name=args.app)
        queue = router.queue_status.remote().result(timeout_s=10)
        queued = ", ".join(f"{name} {depth}" for name, depth in queue["queued"].items())
        print(f"\nRouter queue: {queued}; running {queue['in_flight']} of {queue['capacity']} slots")
    except Exception as err:  # the table above is still useful without it
        print(f"\nRouter queue: unavailable ({type(err).__name__})")
    return 0
