"""``raylm profile``: record a ``jax.profiler`` trace of one worker replica for N seconds.

The trace lands on the replica's node under ``--out`` (open it with TensorBoard's profile
plugin or Perfetto); the command prints the directory.
"""

from __future__ import annotations

import argparse
import sys

from raylm.cluster.local_ray import apply_local_ray_env
from raylm.cluster.names import DEFAULT_APP_NAME, WORKER_DEPLOYMENT


def add_profile_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("profile", help="record a JAX profiler trace of a worker replica")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--out", default="/tmp/raylm-profiles", help="directory on the replica's node")
    p.add_argument("--address", default="auto")
    p.add_argument("--app", default=DEFAULT_APP_NAME)
    p.set_defaults(run=run_profile)


def run_profile(args: argparse.Namespace) -> int:
    if not 0 < args.seconds <= 600:
        print("raylm profile: --seconds must be in (0, 600]", file=sys.stderr)
        return 2
    apply_local_ray_env()
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=args.address, log_to_driver=False)
    worker = serve.get_deployment_handle(WORKER_DEPLOYMENT, app_name=args.app)
    print(f"tracing a worker replica of {args.app} for {args.seconds:g} s ...", file=sys.stderr, flush=True)
    path = worker.profile.remote(args.seconds, args.out).result(timeout_s=args.seconds + 120)
    print(path)
    return 0
