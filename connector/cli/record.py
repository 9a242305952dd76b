"""Record what a newcomer sees, for the docs: ``python -m mooncake_lookout.connector.cli.record demo|first-run``.

Why: the README shows the demo's output and what its first run costs; both are measurements, so both are
committed as files with their date, commit and the machine's load, and the README's blocks are generated from
them (``python -m mooncake_lookout.connector.cli.docs``; a test fails when they drift):

* ``demo``: runs ``bash scripts/demo.sh --duration small`` in this checkout, as the README says, and writes its
  whole output (stdout and stderr, merged in the order they came) to ``docs/bench/demo.txt`` under one line
  that says when, on which commit and under which load it ran; ``engine-demo`` does the same for ``bash
  scripts/demo.sh --engine`` (real engines) in a fresh clone of HEAD, to ``docs/bench/engine-demo.txt``;
* ``sink-cost``: what telemetry costs per lookup (:mod:`mooncake_lookout.metrics.sink_cost`), to
  ``docs/bench/sink-cost.json``;
* ``security``: what CURVE and the per-peer bounds cost and buy (:mod:`~..bench.security`, full sizes), to
  ``docs/bench/security.json``;
* ``first-run``: clones this checkout's HEAD into a scratch folder and runs the same command there, as a first
  run does (its own ``.venv``, an empty pip cache), timing the set-up and the demo; then sums the wheels that venv
  holds (``pip download`` of each installed distribution, what a machine without local copies downloads) and
  the venv's size; writes ``docs/bench/first-run.json``.

Each then regenerates the docs. A checkout with local changes to tracked files is refused (``--allow-dirty``
records anyway, marked ``+dirty``): the docs quote commits. Numbers depend on the machine and its load: every file
carries the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mooncake_lookout.connector.bench.records import DEMO_FILE, ENGINE_DEMO_FILE, RUNS_DIR
from mooncake_lookout.connector.rigs.machine import CHECKOUT, DIRTY, commit, load_average, machine

DEMO_ARGS = ("--duration", "small")
ENGINE_DEMO_ARGS = ("--engine",)  # every mode, the default duration: the engines' start-up is most of it
FIRST_RUN_FILE = RUNS_DIR / "first-run.json"
SINK_COST_FILE = RUNS_DIR / "sink-cost.json"
SECURITY_FILE = RUNS_DIR / "security.json"
SETUP_DONE = "[setup] done"


def demo_command(args: tuple[str, ...] = DEMO_ARGS) -> str:
    """The command a newcomer types, as recorded."""
    return "bash scripts/demo.sh " + " ".join(args)


def run_demo_script(root: Path, env: dict[str, str] | None = None, timeout_s: float = 3600,
                    args: tuple[str, ...] = DEMO_ARGS) -> dict[str, Any]:
    """Run the demo script in ``root``: its merged output lines, exit code, seconds to the set-up's end, in all."""
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", "scripts/demo.sh", *args], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    setup_s = None
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if setup_s is None and line.startswith(SETUP_DONE):
            setup_s = time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            proc.kill()
            break
    code = proc.wait()
    return {"lines": lines, "code": code, "setup_s": setup_s, "total_s": time.monotonic() - t0}


def provenance(m: dict[str, Any], load_end: list[float], args: tuple[str, ...] = DEMO_ARGS) -> str:
    """The first line of a recorded output: command, date, commit, machine, load average at start and end."""
    return (f"# {demo_command(args)}: {m['date']}, commit {m['commit']}, {m['cpus']} CPUs, load average (1 min) "
            f"{m['loadavg_at_start'][0]:.2f} -> {load_end[0]:.2f}; its whole output, stdout and stderr as they came")


def record_demo(root: Path = CHECKOUT, args: tuple[str, ...] = DEMO_ARGS, file: Path = DEMO_FILE) -> int:
    """Run the demo script here (with ``args``) and write its output to ``file`` (``docs/bench/demo.txt``)."""
    m = machine()
    run = run_demo_script(root, args=args)
    if run["code"] != 0:
        print("\n".join(run["lines"][-30:]), file=sys.stderr)
        print(f"record: the demo exited with {run['code']}; nothing written", file=sys.stderr)
        return 1
    (root / file).write_text(provenance(m, load_average(), args) + "\n" + "\n".join(run["lines"]) + "\n")
    print(f"wrote {file}")
    return 0


@contextlib.contextmanager
def _scratch_clone(root: Path, scratch: Path | None, prefix: str) -> Iterator[tuple[Path, Path, dict[str, str]]]:
    """A clone of ``root``'s HEAD in ``scratch`` (a new temporary folder, removed after, when None), the scratch
    folder and the environment a newcomer's shell has (no LOOKOUT_* settings, no active venv)."""
    made = scratch is None
    scratch = Path(tempfile.mkdtemp(prefix=prefix)) if scratch is None else scratch
    try:
        clone = scratch / "clone"
        subprocess.run(["git", "clone", "-q", str(root), str(clone)], check=True)
        yield clone, scratch, {k: v for k, v in os.environ.items() if not k.startswith(("LOOKOUT_", "VIRTUAL_ENV"))}
    finally:
        if made:
            shutil.rmtree(scratch, ignore_errors=True)


def record_engine_demo(root: Path = CHECKOUT, scratch: Path | None = None) -> int:
    """Clone HEAD into a scratch folder, run ``bash scripts/demo.sh --engine`` there as a newcomer does (its own
    ``.venv`` and ``.venv-engine``; the machine's pip cache and shared engine venv are reused), and write its
    output to ``docs/bench/engine-demo.txt`` here."""
    m = machine()
    with _scratch_clone(root, scratch, "lookout-engine-demo-") as (clone, _, env):
        run = run_demo_script(clone, env, args=ENGINE_DEMO_ARGS)
        m["commit"] = commit(clone)  # what was measured: the clone's HEAD
    if run["code"] != 0:
        print("\n".join(run["lines"][-30:]), file=sys.stderr)
        print(f"record: the engine demo exited with {run['code']}; nothing written", file=sys.stderr)
        return 1
    text = provenance(m, load_average(), ENGINE_DEMO_ARGS) + "\n" + "\n".join(run["lines"]) + "\n"
    (root / ENGINE_DEMO_FILE).write_text(text)
    print(f"wrote {ENGINE_DEMO_FILE}")
    return 0


def _wheels_bytes(venv: Path, scratch: Path) -> tuple[int, int]:
    """(number, bytes) of the wheels of every distribution installed in ``venv`` but the editable checkout."""
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    frozen = subprocess.run([*pip, "freeze", "--exclude-editable"], capture_output=True, text=True, check=True)
    reqs = scratch / "installed.txt"
    reqs.write_text(frozen.stdout)
    wheels = scratch / "wheels"
    subprocess.run([*pip, "download", "-q", "--no-deps", "-d", str(wheels), "-r", str(reqs)], check=True,
                   capture_output=True, text=True)
    files = [p for p in wheels.iterdir() if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def record_first_run(root: Path = CHECKOUT, scratch: Path | None = None) -> int:
    """Clone HEAD into a scratch folder, run the demo script there as a first run, write ``first-run.json``."""
    m = machine()
    with _scratch_clone(root, scratch, "lookout-first-run-") as (clone, scratch, env):
        env["PIP_CACHE_DIR"] = str(scratch / "pip-cache")  # an empty cache, as on a new machine
        env["LOOKOUT_CACHE"] = str(scratch / "lookout-cache")  # no shared venv yet, as on a new machine
        run = run_demo_script(clone, env)
        if run["code"] != 0:
            print("\n".join(run["lines"][-30:]), file=sys.stderr)
            print(f"record: the first run exited with {run['code']}; nothing written", file=sys.stderr)
            return 1
        count, wheel_bytes = _wheels_bytes(clone / ".venv", scratch)
        m["commit"] = commit(clone)  # what was measured: the clone's HEAD
        result = {"command": demo_command(), "machine": {**m, "loadavg_at_end": load_average()},
                  "setup_s": run["setup_s"], "total_s": run["total_s"], "wheels": count, "wheel_bytes": wheel_bytes,
                  "venv_bytes": _tree_bytes(clone / ".venv") + _tree_bytes(scratch / "lookout-cache")}
    (root / FIRST_RUN_FILE).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {FIRST_RUN_FILE}")
    return 0


def record_sink_cost(root: Path = CHECKOUT) -> int:
    """Measure telemetry's cost per lookup and write ``docs/bench/sink-cost.json``."""
    from mooncake_lookout.metrics.sink_cost import measure

    m = machine()
    lifecycles, repeats = 10_000, 5
    results = measure(lifecycles, repeats)
    data = {"lifecycles": lifecycles, "repeats": repeats, "ns_per_lookup": results,
            "machine": {**m, "loadavg_at_end": load_average()}}
    (root / SINK_COST_FILE).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {SINK_COST_FILE}")
    return 0


def record_security(root: Path = CHECKOUT) -> int:
    """Run the security bench at full size and write ``docs/bench/security.json``."""
    from mooncake_lookout.connector.bench import security

    m = machine()
    with tempfile.TemporaryDirectory(prefix="lookout-security-") as out:
        results = security.run(out, log=lambda text: print(text, file=sys.stderr, flush=True))
    data = {**results, "machine": {**m, "loadavg_at_end": load_average()}}
    (root / SECURITY_FILE).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {SECURITY_FILE}")
    return 0


def load_recorded(root: Path, file: Path) -> dict[str, Any]:
    """A committed recording (``first-run.json``, ``sink-cost.json``, ...); ValueError naming the command if missing."""
    path = root / file
    if not path.exists():
        what = file.stem
        raise ValueError(f"no committed {file}: record it with python -m mooncake_lookout.connector.cli.record {what}")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def where(m: dict[str, Any]) -> str:
    """When, on what code and how loaded a recording ran, in a few words."""
    return (f"{m['date'][:10]}, commit `{m['commit']}`, {m['cpus']} CPUs, load average (1 min) "
            f"{m['loadavg_at_start'][0]:.2f} -> {m['loadavg_at_end'][0]:.2f}")


def render_sink_cost(data: dict[str, Any]) -> str:
    """The overhead table of docs/metrics.md, from ``sink-cost.json``."""
    from mooncake_lookout.metrics.sink_cost import render

    return (render(data["ns_per_lookup"]) + f"\n\nMedian of {data['repeats']} repeats of {data['lifecycles']:,} "
            f"lifecycles each ({where(data['machine'])}; `{SINK_COST_FILE}`).\n")


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest:02d} s" if minutes else f"{rest} s"


def render_first_run(data: dict[str, Any]) -> str:
    """The README's sentence on what a first run costs, from ``first-run.json``."""
    setup = _duration(data["setup_s"]) if data.get("setup_s") is not None else "?"
    return (f"A first run of `{data['command']}` from a fresh clone took {setup} to set up and "
            f"{_duration(data['total_s'])} in all, here: no GPU, shared with other work ({where(data['machine'])}), "
            f"pip finding most wheels on local disk. Its venv holds {data['wheels']} wheels, "
            f"{data['wheel_bytes'] / 1e6:,.0f} MB to download where they are not at hand "
            f"({data['venv_bytes'] / 1e9:.1f} GB installed). Later runs skip the set-up. "
            f"(`{FIRST_RUN_FILE}`, by `python -m mooncake_lookout.connector.cli.record first-run`.)\n")


RECORDERS = {"demo": record_demo, "engine-demo": record_engine_demo, "first-run": record_first_run,
             "sink-cost": record_sink_cost,
             "security": record_security}


def dirty_refusal(what: str, root: Path = CHECKOUT, *, allow: bool = False) -> str | None:
    """Why ``what`` may not be recorded here (None: it may): a recording the docs quote must be of a commit, and a
    checkout with local changes to tracked files is not one. ``first-run`` and ``engine-demo`` clone HEAD, so they
    measure a commit."""
    code = commit(root) or ""
    if allow or what in ("first-run", "engine-demo") or not code.endswith(DIRTY):
        return None
    return (f"record: this checkout has local changes to tracked files (commit {code}): the docs would quote code "
            "that is in no commit; commit first (or pass --allow-dirty, and the recording says +dirty)")


def main(argv: list[str] | None = None) -> int:
    """Record, then regenerate the docs."""
    parser = argparse.ArgumentParser(prog="python -m mooncake_lookout.connector.cli.record",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=tuple(RECORDERS), help="what to record (see the module's doc)")
    parser.add_argument("--scratch", type=Path,
                        help="first-run, engine-demo: the folder to clone into (default: a new temp one)")
    parser.add_argument("--allow-dirty", action="store_true", help="record on a checkout with local changes (the "
                        "recording's commit then ends in +dirty)")
    args = parser.parse_args(argv)
    refused = dirty_refusal(args.what, allow=args.allow_dirty)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    if args.what in ("first-run", "engine-demo"):
        code = RECORDERS[args.what](scratch=args.scratch)
    else:
        code = RECORDERS[args.what]()
    if code == 0:
        from mooncake_lookout.connector.cli.docs import main as docs

        code = docs([])
    return code


__all__ = ["ENGINE_DEMO_ARGS", "FIRST_RUN_FILE", "RECORDERS", "SECURITY_FILE", "SINK_COST_FILE", "demo_command",
           "dirty_refusal", "load_recorded", "main", "provenance", "record_demo", "record_engine_demo",
           "record_first_run", "record_security", "record_sink_cost", "render_first_run", "render_sink_cost",
           "run_demo_script", "where"]

if __name__ == "__main__":
    sys.exit(main())
