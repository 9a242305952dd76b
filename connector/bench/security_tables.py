"""The doc blocks drawn from the committed security run (``docs/bench/security.json``): what CURVE costs, and what
a flooding peer costs another peer, against a control that shows the machine's own share.

Why: docs/security.md's figures come from a run anyone can repeat (``python -m
mooncake_lookout.connector.bench.security``, its ``security.json`` committed); ``python -m
mooncake_lookout.connector.cli.docs`` renders them beside the run's load average, date and commit, and ``--check``
fails when the doc drifts from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mooncake_lookout.connector.bench.records import RUNS_DIR, num

SECURITY_FILE = RUNS_DIR / "security.json"  # what `python -m mooncake_lookout.connector.bench.security` wrote


def load_security(root: Path) -> dict[str, Any]:
    """The committed security run; ValueError when it is missing or is not one."""
    path = root / SECURITY_FILE
    if not path.exists():
        raise ValueError(f"no committed security run: expected {SECURITY_FILE} (the security.json of `python -m "
                         "mooncake_lookout.connector.bench.security --out DIR`)")
    results: dict[str, Any] = json.loads(path.read_text())
    missing = [k for k in ("machine", "curve", "flood") if k not in results]
    if missing or "rounds" not in results.get("flood", {}):
        raise ValueError(f"{SECURITY_FILE} is not a security run: no {', '.join(missing) or 'flood rounds'}")
    return results


def _source(results: dict[str, Any]) -> str:
    m = results["machine"]
    start, end = m.get("loadavg_at_start") or [None], m.get("loadavg_at_end") or [None]
    return (f"From `{SECURITY_FILE}` ({'quick' if results.get('quick') else 'full'} run, {m.get('date', '-')}, "
            f"commit `{m.get('commit', '-')}`, {m.get('cpus', '-')} CPUs, 1-minute load average "
            f"{num(start[0], 2)} -> {num(end[0], 2)}).")


def _us(summary: dict[str, Any], key: str) -> str:
    return num(summary.get(key), 0)


def render_security_curve(results: dict[str, Any]) -> str:
    """CURVE's cost: plain and CURVE lookups interleaved in one run, one lookup and a 256-lookup frame."""
    c = results["curve"]
    rows = ["| | one lookup p50 (us) | p99 (us) | 256-lookup frame p50 (us) | p99 (us) |",
            "| --- | --- | --- | --- | --- |"]
    for name in ("plain", "curve"):
        one, frame = c[name]["single_us"], c[name]["frame256_us"]
        rows.append(f"| {name} | {_us(one, 'p50')} | {_us(one, 'p99')} | {_us(frame, 'p50')} | {_us(frame, 'p99')} |")
    rows.append(f"| added by CURVE, at p50 | {num(c['single_us_added_p50'], 0)} | | "
                f"{num(c['frame256_us_added_p50'], 0)} | |")
    return _source(results) + "\n\n" + "\n".join(rows) + "\n"


def _flooder(counts: dict[str, Any]) -> str:
    share = counts.get("busy_share")
    return f"{num(100 * share, 1) if share is not None else '-'}% busy, {num(counts.get('ok_per_s'), 0)} ok/s"


def render_security_flood(results: dict[str, Any]) -> str:
    """The other peer under a flood, at the flooded server and at the control, round by round; then the bounds off."""
    f = results["flood"]
    bound = f["bound_p99_ratio"]
    rows = ["| round (load) | the other at | alone p50 / p99 (us) | under the flood p50 / p99 (us) | served | "
            "the flooder | p99 flooded / control |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for number, r in enumerate(f["rounds"], 1):
        verdict = f"**{r['p99_ratio']:.2f}**: " + ("met" if r["met"] else "**missed**")
        for where, label in (("shared", "the flooded server"), ("control", "the control server")):
            alone, flood = r["unloaded_us"][where], r["flood_us"][where]
            rows.append(f"| {number} ({num(r.get('load'), 1)}) | {label} | {_us(alone, 'p50')} / "
                        f"{_us(alone, 'p99')} | {_us(flood, 'p50')} / {_us(flood, 'p99')} | "
                        f"{flood['served']:,} of {r['lookups']:,} | "
                        + (f"{_flooder(r['flooder'])} | {verdict} |" if where == "shared" else "| |"))
    off = f["bounds_off"]
    rows.append(f"| bounds off | the flooded server | {_us(off['unloaded_us'], 'p50')} / "
                f"{_us(off['unloaded_us'], 'p99')} | {_us(off['flood_us'], 'p50')} / {_us(off['flood_us'], 'p99')} | "
                f"{off['flood_us']['served']:,} of {off['lookups']:,} | {_flooder(off['flooder'])} | |")
    met = sum(r["met"] for r in f["rounds"])
    head = (f"A flooder keeping {f['window']:,} lookups in flight (frames of {f['frame_lookups']} lookups of "
            f"{f['hashes']} blocks) at one server; another peer's blocking lookups alternately at that server and "
            f"at the control. Bound: the other served every lookup, and its p99 at the flooded server at most "
            f"{bound:g}x its p99 at the control: **met in {met} of {len(f['rounds'])} rounds**.")
    return _source(results) + " " + head + "\n\n" + "\n".join(rows) + "\n"


__all__ = ["SECURITY_FILE", "load_security", "render_security_curve", "render_security_flood"]
