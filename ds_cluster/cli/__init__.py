"""The `ds-cluster` command line: one module per subcommand, each registering its parser in SUBCOMMANDS.

Adding a subcommand = a module with `add_parser(subparsers)` that declares its
options and sets `handler=`, listed in SUBCOMMANDS. Heavy modules (torch,
DeepSpeed) are imported inside the command that needs them.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from ds_cluster.cli import analyze, export, plan, report, train
from ds_cluster.cli.common import FORMATTER, add_launcher_options

SUBCOMMANDS = (analyze, plan, report, export, train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ds-cluster", formatter_class=FORMATTER,
        description="CluSTER cluster-balanced sampling for DeepSpeed fine-tuning.",
        epilog="Run `ds-cluster COMMAND --help` for a command's options and an example.")
    add_launcher_options(parser, None)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in SUBCOMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    rank = os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == "0" else logging.WARNING,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
