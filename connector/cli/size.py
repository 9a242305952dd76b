"""``mooncake-lookout size``: how loaded a Mooncake master is by a fleet's lookups, ours vs vLLM's own client.

Given ``--engines E --rate R --blocks P --workload W`` it projects, with the sizing model
(:mod:`~..bench.fleet_model`, from the master's CPU per store call and per key that bench scenario (h) measured,
in the committed runs, shipped inside the package as :data:`SHIPPED_RUNS`, or the ``bench.json`` of your own
``bench --only h``), what E engines at R new requests a
second, prompts of P blocks, ask of the master: store calls and keys a second, the master's CPU for them, and the
engines one core of it serves, for our client and for vLLM's. Given ``--prometheus URL`` it reads those figures
from a live deployment instead (our connector's series and the master's own counters,
:mod:`.size_prom`): what the master is asked now, its CPU for it, and what vLLM's client would ask of it (every
block of every prompt, one call a lookup).

Exit codes: 0 printed; 2 bad input, Prometheus unreachable or no measured model; 3 no series under a selector;
4 too little traffic in the window.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, TextIO

from mooncake_lookout.connector.bench.fleet_model import Load, Model, from_runs, project
from mooncake_lookout.connector.cli.prom_http import Access, add_access_args

KINDS = ("shared-prefix", "multi-turn")
# Scenario (h) of each committed run (docs/bench/run-N.json), shipped as package data so that `size` answers from an
# installed wheel too. Generated from those runs by ``python -m mooncake_lookout.connector.cli.docs`` (whose
# ``--check`` fails when it drifts from them): the runs stay the one source.
SHIPPED_RUNS = Path(__file__).with_name("sizing-runs.json")


def add_size_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``size`` subcommand; returns its parser."""
    p = subparsers.add_parser("size", help="how loaded the Mooncake master is by a fleet's lookups, ours vs upstream",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, metavar="E", help="vLLM engines sharing the master")
    p.add_argument("--rate", type=float, metavar="R", help="new requests a second, per engine")
    p.add_argument("--blocks", type=float, metavar="P", help="blocks per prompt (prompt tokens / vLLM's block size)")
    p.add_argument("--workload", choices=KINDS, help="which measured workload the engines look like: shared-prefix "
                   "(prompts share a prefix, each asked once) or multi-turn (conversations re-sending their context); "
                   "with --prometheus, optional: whose cost per store call to use")
    p.add_argument("--master-cpus", type=float, default=1.0, help="CPU cores the master has (default 1)")
    p.add_argument("--runs", type=Path, default=None, metavar="PATH",
                   help="the measured model: a bench.json of `bench --only h`, or a folder of run-N.json (default: "
                        "the committed runs docs/bench/run-N.json, shipped with the package)")
    add_access_args(p, required=False)
    live = p.add_argument_group("a live deployment, with --prometheus (instead of --engines/--rate/--blocks/"
                                "--workload)")
    live.add_argument("--selector", default="{}", help="label matchers of the engines' series (default: every one)")
    live.add_argument("--master-selector", default="{}", help="label matchers of the master's series (default: any)")
    live.add_argument("--window", default="1h", help="how far back to look (a Prometheus duration; default 1h)")
    live.add_argument("--block-size", type=int, default=16, help="vLLM's block size in tokens (default 16)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the report")
    p.set_defaults(func=run_size)
    return p


def render_shipped_runs(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """:data:`SHIPPED_RUNS`' text: scenario (h) of each ``(path, bench.json)`` run that measured it."""
    doc = {"generated_by": "python -m mooncake_lookout.connector.cli.docs (do not edit): scenario (h) of each "
                           "committed bench run, the model `mooncake-lookout size` answers with",
           "runs": {path: results["h"] for path, results in runs
                    if isinstance(results.get("h"), dict) and results["h"].get("phases")}}
    return json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n"


def _measured_h(files: list[Path]) -> tuple[list[dict[str, Any]], list[str]]:
    hs, used = [], []
    for f in files:
        try:
            results = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise SystemExit(f"size: cannot read {f}: {e}") from None
        if isinstance(results, dict) and isinstance(results.get("h"), dict) and results["h"].get("phases"):
            hs.append(results["h"])
            used.append(str(f))
    return hs, used


def load_model(path: Path | None) -> tuple[Model, list[str]]:
    """The model of every run under ``path`` that measured scenario (h), and the files it came from; without
    ``path``, the committed runs' shipped with the package (:data:`SHIPPED_RUNS`)."""
    if path is None:
        try:
            shipped = json.loads(SHIPPED_RUNS.read_text())["runs"]
        except (OSError, ValueError, KeyError) as e:
            raise SystemExit(f"size: the package's measured model {SHIPPED_RUNS} is missing or damaged ({e}): "
                             "reinstall mooncake-lookout, or give --runs a bench.json of `mooncake-lookout bench "
                             "--only h`") from None
        hs, used = list(shipped.values()), list(shipped)
    else:
        files = [path] if path.is_file() else sorted(path.glob("run-*.json")) if path.is_dir() else []
        if not files:
            raise SystemExit(f"size: no bench run at {path}: give --runs a bench.json of `mooncake-lookout bench "
                             "--only h` (or a folder of run-N.json)")
        hs, used = _measured_h(files)
    if not hs:
        raise SystemExit(f"size: no run under {path or SHIPPED_RUNS} measured scenario (h) (a fleet on one master): "
                         "run `mooncake-lookout bench --only h` and pass its bench.json with --runs")
    return from_runs(hs), used


def _table(loads: dict[str, Load], engines: int, master_cpus: float) -> list[str]:
    lines = [f"  {'client':9} {'lookups/s':>10} {'calls/s':>10} {'keys/s':>12} {'us/lookup':>10} {'master CPU':>11} "
             f"{'of its CPU':>10} {'engines/core':>12}"]
    for client in ("upstream", "ours"):
        x = loads[client]
        per_core = x.engines_per_core(engines)
        engines_cell = f"{per_core:,.0f}" if per_core is not None else "-"
        lines.append(f"  {client:9} {x.lookups_per_s:>10,.0f} {x.calls_per_s:>10,.0f} {x.keys_per_s:>12,.0f} "
                     f"{x.per_lookup_us:>10,.1f} {x.master_cores:>9.3f} c {100 * x.master_cores / master_cpus:>9.1f}% "
                     f"{engines_cell:>12}")
    return lines


def report(model: Model, sources: list[str], heading: str, loads: dict[str, Load], engines: int,
           master_cpus: float, notes: list[str]) -> str:
    """The text the command prints."""
    up, ours = loads["upstream"].master_cores, loads["ours"].master_cores
    lines = [heading,
             f"model: {model.per_key_us:.2f} us of the master's CPU a key, and per store call what the "
             f"workload's calls cost (scenario h of {', '.join(sources)})", "",
             *_table(loads, engines, master_cpus), ""]
    if up:
        lines.append(f"ours / upstream: {ours / up:.2f} of the master's CPU")
    return "\n".join(lines + notes) + "\n"


def _projected(args: argparse.Namespace, model: Model) -> dict[str, Any]:
    missing = [f"--{n}" for n in ("engines", "rate", "blocks", "workload") if getattr(args, n) is None]
    if missing:
        raise SystemExit(f"size: {', '.join(missing)} required (or --prometheus URL for a live deployment)")
    try:
        loads = project(model, args.workload, engines=args.engines, rate=args.rate, blocks=args.blocks)
    except ValueError as e:
        raise SystemExit(f"size: {e}") from None
    heading = (f"Master load from lookups: {args.engines} engines x {args.rate:g} new requests/s, "
               f"{args.blocks:g}-block prompts, {args.workload} workload (its keys and calls per lookup as scenario h "
               "measured them)")
    return {"heading": heading, "engines": args.engines, "loads": loads, "notes": []}


def _live(args: argparse.Namespace, model: Model) -> dict[str, Any]:
    from mooncake_lookout.connector.cli.size_prom import read_live

    live = read_live(Access.from_args(args), args.selector, args.master_selector, args.window,
                     block_size=args.block_size)
    call_us = {c: model.shapes[args.workload][c].per_call_us if args.workload else model.per_call_us
               for c in ("ours", "upstream")}
    ours_us = live.calls_per_lookup * call_us["ours"] + live.keys_per_lookup * model.per_key_us
    up_us = call_us["upstream"] + live.blocks_per_lookup * model.per_key_us
    loads = {"ours": Load("ours", live.lookups_per_s, live.master_calls_per_s, live.master_keys_per_s,
                          live.lookups_per_s * ours_us / 1e6, ours_us),
             "upstream": Load("upstream", live.lookups_per_s, live.lookups_per_s,
                              live.lookups_per_s * live.blocks_per_lookup, live.lookups_per_s * up_us / 1e6, up_us)}
    heading = (f"Master load from lookups, measured over the last {args.window} at {args.prometheus}: {live.engines} "
               f"engines x {live.rate:.1f} new requests/s, {live.blocks_per_lookup:,.0f} blocks a prompt; the master "
               f"answered {live.calls_per_lookup:.2f} store calls and {live.keys_per_lookup:,.1f} keys per lookup")
    notes = ["upstream: what vLLM's own client would ask of the master (every block of every prompt, one call a "
             "lookup)",
             "ours: what the master was asked (all its existence checks, put on these engines' lookups)",
             "a call's cost: " + (f"the {args.workload} workload's" if args.workload
                                  else "the fit over every workload (--workload picks one)")]
    return {"heading": heading, "engines": live.engines, "loads": loads, "notes": notes, "live": vars(live)}


def run_size(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """``size``: project (or read) a fleet's load on the master and print it."""
    if args.master_cpus <= 0:
        raise SystemExit("size: --master-cpus must be > 0")
    model, sources = load_model(args.runs)
    if args.prometheus:
        from mooncake_lookout.connector.cli.advise_prom import AdviseError

        try:
            answer = _live(args, model)
        except AdviseError as e:
            print(f"size: {e}", file=sys.stderr)
            return e.code
    else:
        answer = _projected(args, model)
    loads = answer["loads"]
    if args.json:
        doc = {"model": model.as_dict(), "sources": sources, "engines": answer["engines"],
               "master_cpus": args.master_cpus, "loads": {c: vars(x) for c, x in loads.items()},
               **({"live": answer["live"]} if "live" in answer else {})}
        out.write(json.dumps(doc, indent=1) + "\n")
    else:
        out.write(report(model, sources, answer["heading"], loads, answer["engines"], args.master_cpus,
                         answer["notes"]))
    return 0


__all__ = ["KINDS", "SHIPPED_RUNS", "add_size_parser", "load_model", "render_shipped_runs", "report", "run_size"]
