"""The ``mooncake-lookout`` command: ``demo``, ``bench``, ``serve`` and ``doctor``.

Each subcommand lives in its own module; this one only wires them into one ``argparse`` parser. Heavy
imports (vLLM, Mooncake) happen inside the subcommands, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.demo import add_demo_parser
from mooncake_lookout.connector.doctor import add_doctor_parser
from mooncake_lookout.connector.serve_cli import add_serve_parser


def run_bench_command(args: argparse.Namespace) -> int:
    """``bench``: run the scenarios, write JSON, table and plots to ``--out``."""
    from mooncake_lookout.connector.bench import run_bench

    results = run_bench(args.out, quick=args.quick)
    print(f"wrote {args.out}/bench.json, {args.out}/bench.txt and {len(results['plots'])} plots "
          f"in {results['seconds']:.0f} s")
    return 0


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand; returns its parser."""
    p = subparsers.add_parser("bench", help="upstream's lookup path vs ours: numbers, JSON and plots",
                              description="Scenarios (a)-(e) in one process against one real Mooncake master; "
                                          "see docs/tuning.md for how to read them.")
    p.add_argument("--quick", action="store_true", help="smaller runs (well under 2 minutes)")
    p.add_argument("--out", default="out", help="folder for bench.json, bench.txt and *.png (default out)")
    p.set_defaults(func=run_bench_command)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    parser = argparse.ArgumentParser(prog="mooncake-lookout",
                                     description="A hardened, observable prefix-cache lookup path for vLLM's "
                                                 "Mooncake store connector.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,serve,doctor}")
    add_demo_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    add_doctor_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
