"""``mooncake-lookout bench``: the subcommand's parser, and the glue that runs the bench (:mod:`..bench.run`),
or measures your own store or lookup server read-only (``--master`` / ``--server``, :mod:`..bench.remote`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from mooncake_lookout.connector.transport.names import PIPELINED, TRANSPORTS


def run_bench_command(args: argparse.Namespace) -> int:
    """``bench``: run the scenarios, write JSON, table and plots to ``--out``; or measure a deployment."""
    if args.only and (args.master or args.server):
        raise SystemExit("bench: --only goes without --master and --server")
    if args.master or args.server:
        return _run_remote(args)
    mine = [flag for flag, value in (("--master-http", args.master_http), ("--model", args.model),
                                     ("--prompts", args.prompts), ("--sample-keys", args.sample_keys)) if value]
    if mine:
        raise SystemExit(f"bench: {', '.join(mine)} only go with --master or --server")
    from mooncake_lookout.connector.bench.run import run_bench, selected

    only = [name.strip() for name in args.only.split(",") if name.strip()] if args.only else None
    try:
        selected(only)
    except ValueError as e:
        raise SystemExit(f"bench --only: {e}") from None
    from mooncake_lookout.connector.rigs.machine import DIRTY, commit

    if (code := commit() or "").endswith(DIRTY):
        print(f"bench: this checkout has local changes to tracked files: the run is marked commit {code} (its code is "
              "not that commit's); commit them before publishing it as docs/bench/run-N.json", file=sys.stderr)
    results = run_bench(args.out, quick=args.quick, only=only)
    print(f"wrote {args.out}/bench.json, {args.out}/bench.txt and {len(results['plots'])} plots "
          f"in {results['seconds']:.0f} s")
    return 0


def _run_remote(args: argparse.Namespace) -> int:
    from mooncake_lookout.connector.rigs.vllm_layout import Layout

    if args.master and not args.model:
        raise SystemExit("bench --master: --model is required (vLLM's store keys embed the model's name, e.g. "
                         "--model meta-llama/Llama-3.1-8B)")
    try:
        layout = Layout(args.model or "unnamed", args.cache_prefix, args.tp_size, args.block_size)
    except ValueError as e:
        raise SystemExit(f"bench: {e}") from None
    from mooncake_lookout.connector.bench.remote import run_remote
    from mooncake_lookout.connector.server.store import MasterError

    try:
        results = run_remote(args.out, layout, master=args.master, server=args.server, server_wire=args.server_wire,
                             master_http=args.master_http, prompts_file=args.prompts, sample_keys=args.sample_keys,
                             quick=args.quick)
    except (ValueError, OSError, MasterError) as e:
        raise SystemExit(f"bench: {e}") from None
    print(f"wrote {args.out}/bench.json and {args.out}/bench.txt in {results['seconds']:.0f} s")
    return 0


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` subcommand; returns its parser."""
    p = subparsers.add_parser("bench", help="upstream's lookup path vs ours: numbers, JSON and plots",
                              description="Without --master/--server: every scenario in one process against a "
                                          "Mooncake master of its own; see docs/tuning.md for how to read them. "
                                          "With --master and/or --server: your own store or lookup server, "
                                          "measured read-only (nothing is written or wiped).")
    p.add_argument("--quick", action="store_true", help="smaller runs (a few minutes)")
    p.add_argument("--only", metavar="IDS", default="",
                   help="run only these scenarios, comma-separated, among a, a4, backends, b, c, d, e, f, f-load, g, "
                        "j, h, i (i: real vllm serve engines, left out of --quick without --only) (e.g. --only h or "
                        "--only f,f-load); the targets they decide are judged")
    p.add_argument("--out", default="out", help="folder for bench.json, bench.txt and *.png (default out)")
    mine = p.add_argument_group("your own deployment (read-only: existence checks only)")
    mine.add_argument("--master", metavar="HOST:PORT", help="your Mooncake master's RPC address")
    mine.add_argument("--server", metavar="ADDRESS", help="your lookup server (ipc://PATH or tcp://HOST:PORT)")
    mine.add_argument("--server-wire", choices=TRANSPORTS, default=PIPELINED,
                      help=f"the protocol --server speaks (default {PIPELINED}: our server)")
    mine.add_argument("--model", help="the model as vLLM was given it (its store keys embed the last part)")
    mine.add_argument("--cache-prefix", default="", help="vLLM's cache_prefix, if the deployment sets one")
    mine.add_argument("--tp-size", type=int, default=1, help="the deployment's tensor-parallel size (default 1)")
    mine.add_argument("--block-size", type=int, default=16, help="vLLM's block size in tokens (default 16)")
    mine.add_argument("--master-http", metavar="URL",
                      help="the master's HTTP address (e.g. http://HOST:9003): master_key_count before and after")
    mine.add_argument("--prompts", metavar="FILE",
                      help="prompts to look up: one a line, its block hashes in hex (spaces or commas between)")
    mine.add_argument("--sample-keys", type=int, default=0, metavar="N",
                      help="look up N blocks sampled from the master's key listing (needs --master-http; the "
                           "listing is read once, at most 64 MiB of it)")
    p.set_defaults(func=run_bench_command)
    return p


__all__ = ["add_bench_parser", "run_bench_command"]
