"""The ``raylm`` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from raylm.deploy.generate_command import add_generate_parser
from raylm.deploy.profile_command import add_profile_parser
from raylm.deploy.serve_command import add_serve_parser
from raylm.deploy.status_command import add_status_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raylm", description="JAX LLM inference on Ray")
    commands = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(commands)
    add_serve_parser(commands)
    add_status_parser(commands)
    add_profile_parser(commands)
    bench = commands.add_parser(
        "bench", help="benchmarks (--offline: the engine in this process; --base-url URL: an OpenAI endpoint)",
        add_help=False,
    )
    bench.add_argument("--offline", action="store_true")
    bench.add_argument("--base-url", default=None)
    bench.set_defaults(run=_run_bench)
    return parser


def _run_bench(args: argparse.Namespace, extra: Sequence[str]) -> int:
    """Forward the remaining arguments to the chosen benchmark (imported late: each pulls in its own stack)."""
    if args.offline == (args.base_url is not None):
        print("raylm bench: pass --offline (the engine in this process) or --base-url URL (an OpenAI endpoint)",
              file=sys.stderr)
        return 2
    if args.base_url is not None:
        from raylm.benchmarks.http_bench import main as http_main

        return http_main(["--base-url", args.base_url, *extra])
    from raylm.benchmarks.offline_bench import main as offline_main

    offline_main(list(extra))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if args.command != "bench" and extra:
        build_parser().parse_args(argv)  # reports the unknown arguments
    return args.run(args, extra) if args.command == "bench" else args.run(args)


if __name__ == "__main__":
    sys.exit(main())
