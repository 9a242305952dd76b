"""``mooncake-lookout bench``: the subcommand's parser, and the glue that runs the bench (:mod:`..bench.run`)."""

from __future__ import annotations

import argparse
from typing import Any


def run_bench_command(args: argparse.Namespace) -> int:
    """``bench``: run the scenarios, write JSON, table and plots to ``--out``."""
    from mooncake_lookout.connector.bench.run import run_bench

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


__all__ = ["add_bench_parser", "run_bench_command"]
