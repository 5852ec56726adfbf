"""The ``skewadam`` command. Each subcommand lives with the code it drives and registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# (subcommand, module that defines `register_cli(subparsers)`): the module adds its parser and sets `func`.
_SUBCOMMANDS = [
    ("tiers", "skewadam.classify"),
    ("plan", "skewadam.memory"),
    ("bench", "skewadam.harness.bench"),
    ("report", "skewadam.harness.report"),
    ("bench-step", "skewadam.harness.bench_step"),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="skewadam", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for _, module in _SUBCOMMANDS:
        importlib.import_module(module).register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
