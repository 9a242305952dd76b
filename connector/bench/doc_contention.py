"""The doc block drawn from the newest committed run with scenarios (j) and (e) (``docs/bench/contention.json``,
or a whole run ``run-N.json``): what a busy host costs a lookup, per mode and deadline, and what a stopped store
costs the scheduler.

Why: docs/tuning.md states why ``lookup_timeout_ms: auto`` and ``lookup_block_ms: auto`` pick what they pick; the
figures come from a run anyone can repeat (``mooncake-lookout bench --only e,j --out DIR``, its ``bench.json``
committed as ``contention.json``, or a whole ``bench`` run), rendered here beside the run's load average, date and
commit; ``cli.docs --check`` fails when the doc drifts from them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mooncake_lookout.connector.bench.records import RUNS_DIR, command_of, newest_with, num

CONTENTION_FILE = RUNS_DIR / "contention.json"  # the bench.json of `mooncake-lookout bench --only e,j`


def load_contention(root: Path) -> tuple[Path, dict[str, Any]]:
    """The newest committed run with (j) and (e), and its path; ValueError naming the command when none."""
    return newest_with(root, ("e", "j"), CONTENTION_FILE)


def _ms(us: float | None) -> str:
    return num(None if us is None else us / 1e3, 1)


def _ended(v: dict[str, Any]) -> int:
    """Lookups that ended (a request whose first lookup was refused at once asks again: two lookups)."""
    return int(v.get("ended") or sum(k for o, k in (v.get("outcomes") or {}).items() if o != "discarded")
               or v["lookups"])


def _row(cond: str, v: dict[str, Any], ref: dict[str, Any] | None) -> str:
    rtt = v.get("answered_rpc_us") or {}
    deadline = "none" if v["client"] == "upstream" else f"{num(v.get('timeout_ms'), 0)} ms"
    if v["client"] == "upstream":
        lost = f"{v['unanswered']:,} never answered" if v.get("unanswered") else "-"
    else:
        lost = f"{v['failed']:,} of {_ended(v):,} ({num(100 * v['failed'] / max(1, _ended(v)), 2)}%)"
        if late := v.get("late_replies"):
            lost += f", {late:,} {'reply' if late == 1 else 'replies'} came late"
    hits = "(reference)" if v is ref else num(v["hit_tokens"] / ref["hit_tokens"], 3) if ref else "-"
    breaker = ("opened" if v.get("breaker_opened") else "closed") if v["client"] != "upstream" else "-"
    return (f"| {cond} | {v['label']} | {deadline} | {_ms(rtt.get('p99'))} / "
            f"{_ms(v.get('answered_rpc_p999_us'))} / {_ms(rtt.get('max'))} | {lost} | {breaker} | {hits} |")


def render_contention(run: tuple[Path, dict[str, Any]]) -> str:
    """(j)'s rows (round trips of answered lookups, lookups without the store's answer, hit tokens against the
    same mode with no deadline) and (e)'s stopped-store lines."""
    path, results = run
    m, j, e = results["machine"], results["j"], results["e"]
    start, end = m.get("loadavg_at_start") or [None], m.get("loadavg_at_end") or [None]
    lines = [f"From `{path}` (`{command_of(results)} --out DIR`, {'quick' if results.get('quick') else 'full'}, "
             f"{m.get('date', '-')}, commit `{m.get('commit', '-')}`, {m.get('cpus', '-')} CPUs, 1-minute load "
             f"average {num(start[0], 2)} -> {num(end[0], 2)}). (j): {j['steps']:,} steps of "
             f"{j['arrivals_per_step']} new requests, a {num(j['model_step_ms'], 0)} ms model step between "
             "steps, every stored prefix whole (each lookup can hit).", "",
             "| contention | client | deadline | answered round trip p99 / p99.9 / max (ms) | lookups ended without "
             "the store's answer | breaker | hit tokens / no deadline |", "| --- | --- | --- | --- | --- | --- | --- |"]
    names = {"cpu hogs": "a CPU hog per core", "gil loop": "a GIL-holding loop in the server's process"}
    for cond, c in j["conditions"].items():
        by = {v["label"]: v for v in c["variants"]}
        for v in c["variants"]:
            mode = "async" if v["lookup_async"] else "sync"
            ref = by.get(f"ours {mode}, no deadline")
            lines.append(_row(names.get(cond, cond), v, ref))
    stopped, quiet = e["stopped"], e.get("stopped_async")
    blocked = ", ".join(f"{name} {num(v['blocked_s'] * 1e3, 1)} ms" for name, v in stopped.items()
                        if isinstance(v, dict) and v.get("blocked_s") is not None)
    up = stopped.get("upstream", {})
    deadline = num(stopped["ours/pipelined"].get("deadline_ms"), 0)
    lines += ["", f"(e), the store stopped: one blocking call each, ours with a {deadline} ms deadline: {blocked}; "
              "vLLM's client "
              + (f"still blocked after {num(up.get('still_blocked_after_s'), 1)} s" if up.get("blocked_s") is None
                 else f"{num(up['blocked_s'] * 1e3, 1)} ms") + "."]
    if quiet is not None:
        lines.append(f"Ours async at its default deadline ({num(quiet['deadline_ms'], 0)} ms): {quiet['polls']:,} "
                     f"polls while the store was stopped, the longest {num(quiet['longest_call_ms'], 2)} ms; the "
                     f"lookup ended as a {quiet['outcome']} after {num(quiet['ended_after_s'], 2)} s.")
    return "\n".join(lines) + "\n"


__all__ = ["CONTENTION_FILE", "load_contention", "render_contention"]
