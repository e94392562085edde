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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
