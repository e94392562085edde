"""The ``raylm`` command line."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from deploy.generate_command import add_generate_parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raylm", description="JAX LLM inference on Ray")
    commands = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(commands)
    bench = commands.add_parser("bench", help="benchmarks (--offline: the engine in this process)", add_help=False)
    bench.add_argument("--offline", action="store_true")
    bench.set_defaults(run=_run_bench)
    return parser


def _run_bench(args: argparse.Namespace, extra: Sequence[str]) -> int:
    if not args.offline:
        print("only `raylm bench --offline ...` exists so far (the HTTP load generator comes with serving)",
              file=sys.stderr)
        return 2
    from deploy.benchmarks.offline_bench import main as offline_main

    offline_main(list(extra))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if args.command != "bench" and extra:
        build_parser().parse_args(argv)  # reports the unknown arguments
    return args.run(args, extra) if args.command == "bench" else args.run(args)


if __name__ == "__main__":
    sys.exit(main())
