"""The ``mooncake-lookout`` command: ``demo``, ``bench``, ``serve``, ``doctor``, ``advise`` and ``size``; and the doc
generator.

Each subcommand lives in its own module (:mod:`.demo`, :mod:`.bench`, :mod:`.serve`, :mod:`.doctor`,
:mod:`.advise` with :mod:`.advise_prom` reading Prometheus and :mod:`.advise_rules` deciding, :mod:`.size` with
:mod:`.size_prom`; both reach Prometheus through :mod:`.prom_http`: authentication, TLS, headers); this
one only wires them into one ``argparse`` parser. Heavy imports (vLLM, Mooncake) happen inside the
subcommands, so ``--help`` answers at once. :mod:`.docs` regenerates (or ``--check``s) every generated
block of the documentation.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mooncake_lookout.connector.cli.advise import add_advise_parser
from mooncake_lookout.connector.cli.bench import add_bench_parser
from mooncake_lookout.connector.cli.demo import add_demo_parser
from mooncake_lookout.connector.cli.doctor import add_doctor_parser
from mooncake_lookout.connector.cli.serve import add_serve_parser
from mooncake_lookout.connector.cli.size import add_size_parser


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    parser = argparse.ArgumentParser(prog="mooncake-lookout",
                                     description="A hardened, observable prefix-cache lookup path for vLLM's "
                                                 "Mooncake store connector.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{demo,bench,serve,doctor,advise,size}")
    add_demo_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    add_doctor_parser(sub)
    add_advise_parser(sub)
    add_size_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
