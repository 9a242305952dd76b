"""``mooncake-lookout bench``: upstream's lookup path vs ours, in one process, against one real master.

Scenarios (one module each in this package): (a) :mod:`.call` scheduler-path cost of one call; (b)
:mod:`.burst` a burst of new requests; (c) :mod:`.sched` vLLM's real scheduler per lookup mode; (d)
:mod:`.overhead` metrics and spans on vs off; (e) :mod:`.fault` the store slowed or stopped.
Writes ``bench.json`` (machines), ``bench.txt`` (the table printed) and PNG figures to ``--out``.
Each target's ratio (ours / upstream) is printed beside the absolute figures, with "met" or "MISSED".
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mooncake_lookout.connector.rigs.workload import shared_prefix_workload
from mooncake_lookout.connector.transport.names import UPSTREAM

BUDGET_US = 200


@dataclass(frozen=True)
class Sizes:
    """How much each scenario does: ``quick`` (a test, under ~90 s) or full (a few minutes)."""

    call_requests: int
    burst_n: int
    burst_repeats: int
    sched_steps: int
    overhead_rounds: int
    fault_requests: int
    fault_wait_s: float
    budgets_us: tuple[int, ...]


QUICK = Sizes(100, 256, 1, 100, 6, 20, 2.0, (BUDGET_US,))
FULL = Sizes(500, 256, 5, 400, 24, 100, 5.0, (BUDGET_US, 500, 1000))


def _modes(sizes: Sizes) -> list[Any]:
    from mooncake_lookout.connector.bench.sched import mode

    modes = [mode("upstream sync", False, lookup_async=False),
             mode("upstream async", False, lookup_async=True),
             mode("ours sync", True, lookup_async=False),
             mode("ours async", True, lookup_async=True)]
    modes += [mode(f"ours budget {b}us", True, lookup_async=True, lookup_wait_us=b) for b in sizes.budgets_us]
    modes.append(mode(f"ours budget {BUDGET_US}us upstream-wire", True, UPSTREAM, lookup_async=True,
                      lookup_wait_us=BUDGET_US))
    return modes


def run_bench(out_dir: str, *, quick: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every scenario, write the outputs, return the results (as written to ``bench.json``)."""
    from mooncake_lookout.connector.bench import burst, call, fault, overhead, sched
    from mooncake_lookout.connector.bench.plots import write_all
    from mooncake_lookout.connector.bench.rig import Rig

    sizes = QUICK if quick else FULL
    t_start = time.perf_counter()
    results: dict[str, Any] = {"quick": quick, "machine": _machine()}
    call_reqs = shared_prefix_workload(sizes.call_requests, num_prefixes=4, seed=1)
    burst_reqs = shared_prefix_workload(sizes.burst_n, num_prefixes=4, seed=2)
    log("starting a Mooncake master and the lookup server process ...")
    with Rig(namespace="bench") as rig:
        rig.index.store_prefixes([r.block_hashes[:4] if i % 2 else r.block_hashes
                                  for i, r in enumerate(call_reqs + burst_reqs)])
        results["rig_start_s"] = time.perf_counter() - t_start
        log("(a) scheduler-path cost of one call ...")
        a = call.run(rig, call_reqs)
        raw_latency = a.pop("raw")
        results["a"] = a
        log(f"(b) burst of {sizes.burst_n} ...")
        results["b"] = burst.run(rig, burst_reqs, repeats=sizes.burst_repeats)
        log("(c) vLLM's scheduler per lookup mode ...")
        workload = sched.Workload()
        results["c"] = {"steps": sizes.sched_steps, "arrivals_per_step": 4, "model_step_ms": 1.5,
                        "modes": [sched.run_mode(rig, workload, m, steps=sizes.sched_steps).as_dict()
                                  for m in _modes(sizes)]}
        log("(d) instrumentation on vs off ...")
        results["d"] = overhead.run(rig, call_reqs, rounds=sizes.overhead_rounds)
        log("(e) store slowed, then stopped ...")
        results["e"] = fault.run(rig, call_reqs[:sizes.fault_requests], wait_s=sizes.fault_wait_s)
    results["machine"]["loadavg_at_end"] = list(os.getloadavg())
    results["targets"] = targets(results)
    results["seconds"] = time.perf_counter() - t_start
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(results, f, indent=1, default=_json_default)
    table = format_report(results)
    with open(os.path.join(out_dir, "bench.txt"), "w") as f:
        f.write(table + "\n")
    results["plots"] = write_all(results, raw_latency, out_dir)
    log(table)
    return results


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return str(obj)


def _machine() -> dict[str, Any]:
    # The load average matters on a shared machine: other work on the cores shows up in every latency.
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform(),
            "loadavg_at_start": list(os.getloadavg())}


def _mode(results: dict[str, Any], label: str) -> dict[str, Any]:
    return next(m for m in results["c"]["modes"] if m["label"] == label)


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Each issue target: the figures, the ratio, the bound and whether it was met."""
    out = []
    a_up, a_ours = r["a"]["upstream"], r["a"]["ours/pipelined"]
    ratio = a_ours["async_per_lookup_us"]["p50"] / a_up["async_per_lookup_us"]["p50"]
    out.append({"id": "a", "what": "async scheduler-path cost per lookup, median, ours (metrics+spans) / upstream",
                "ours": a_ours["async_per_lookup_us"]["p50"], "upstream": a_up["async_per_lookup_us"]["p50"],
                "unit": "us", "ratio": ratio, "bound": "<= 1.0x", "met": ratio <= 1.0})
    b = r["b"]
    ratio = b["ours/pipelined"]["seconds"] / b["upstream"]["seconds"]
    out.append({"id": "b", "what": f"burst of {b['n']}: time to all answers, ours pipelined / upstream",
                "ours": b["ours/pipelined"]["seconds"] * 1e3, "upstream": b["upstream"]["seconds"] * 1e3,
                "unit": "ms", "ratio": ratio, "bound": "<= 0.25x", "met": ratio <= 0.25})
    budget, up_async = _mode(r, f"ours budget {BUDGET_US}us"), _mode(r, "upstream async")
    out.append({"id": "c1", "what": f"budget {BUDGET_US}us at admission: mean deferred steps per request",
                "ours": budget["mean_deferred_steps"], "upstream": up_async["mean_deferred_steps"], "unit": "steps",
                "ratio": _ratio(budget["mean_deferred_steps"], up_async["mean_deferred_steps"]),
                "bound": "<= 0.2", "met": budget["mean_deferred_steps"] <= 0.2})
    p99 = budget["call_us"]["p99"]
    out.append({"id": "c2", "what": f"budget {BUDGET_US}us: p99 of one scheduler call",
                "ours": p99, "upstream": _mode(r, "upstream sync")["call_us"]["p99"], "unit": "us",
                "ratio": _ratio(p99, _mode(r, "upstream sync")["call_us"]["p99"]),
                "bound": f"<= {BUDGET_US + 50} us", "met": p99 <= BUDGET_US + 50})
    out.append({"id": "c3", "what": "upstream async defers every request at least once (share deferred)",
                "ours": budget["requests_deferred"], "upstream": up_async["requests_deferred"], "unit": "share",
                "ratio": _ratio(budget["requests_deferred"], up_async["requests_deferred"]),
                "bound": "upstream = 1.0", "met": up_async["requests_deferred"] >= 1.0})
    d = r["d"]["median_overhead"]
    out.append({"id": "d", "what": "metrics+spans on: added end-to-end lookup time (median)",
                "ours": r["d"]["on_us"]["p50"], "upstream": r["d"]["off_us"]["p50"], "unit": "us (on / off)",
                "ratio": 1.0 + d, "bound": "<= 1.05x", "met": d <= 0.05})
    e = r["e"]["stopped"]
    ours_block = max(e[n]["blocked_s"] or float("inf") for n in ("ours/pipelined", "ours/upstream-wire"))
    up = e["upstream"]
    up_block = up["blocked_s"] if up.get("blocked_s") is not None else up["still_blocked_after_s"]
    deadline_s = e["ours/pipelined"]["deadline_ms"] / 1e3
    out.append({"id": "e", "what": "store stopped: longest blocking call, ours (deadline 100 ms) / upstream",
                "ours": ours_block * 1e3, "upstream": up_block * 1e3, "unit": "ms", "ratio": ours_block / up_block,
                "bound": "ours <= deadline (+5%), upstream blocks",
                "met": ours_block <= deadline_s * 1.05
                and (up.get("blocked_s") is None or up["blocked_s"] > deadline_s)})
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _f(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.{digits}f}"
    return str(v)


def format_report(r: dict[str, Any]) -> str:
    """The human-readable report: one block per scenario, then the targets."""
    load = r["machine"].get("loadavg_at_start", [float("nan")])[0]
    lines = [f"mooncake-lookout bench ({'quick' if r['quick'] else 'full'}; {r['machine']['cpus']} CPUs, "
             f"Python {r['machine']['python']}, load average {load:.2f} at start)", ""]
    lines.append("(a) scheduler-path cost of one lookup call, us (ours with metrics+spans on)")
    lines.append(f"  {'client':26} {'sync p50':>9} {'sync p99':>9} {'async 1st p50':>14} {'async/lookup p50':>17} "
                 f"{'x upstream':>10}")
    base = r["a"]["upstream"]["async_per_lookup_us"]["p50"]
    for name, v in r["a"].items():
        lines.append(f"  {name:26} {_f(v['sync_call_us']['p50']):>9} {_f(v['sync_call_us']['p99']):>9} "
                     f"{_f(v['async_first_call_us']['p50']):>14} {_f(v['async_per_lookup_us']['p50']):>17} "
                     f"{_f(v['async_per_lookup_us']['p50'] / base, 2):>10}")
    b = r["b"]
    lines += ["", f"(b) burst of {b['n']} new requests: time until every answer is ready"]
    for name, v in b.items():
        if isinstance(v, dict):
            lines.append(f"  {name:26} {v['seconds'] * 1e3:8.1f} ms  {v['steps']:5.0f} steps  "
                         f"hit tokens {v['hit_tokens']}  x upstream {v['seconds'] / b['upstream']['seconds']:.2f}")
    c = r["c"]
    lines += ["", f"(c) vLLM's scheduler, {c['steps']} steps, {c['arrivals_per_step']} arrivals/step, "
              f"model step {c['model_step_ms']} ms"]
    lines.append(f"  {'mode':34} {'call p50':>8} {'call p99':>8} {'call max':>8} {'blocked/step':>12} "
                 f"{'deferred/req':>12} {'% deferred':>10} {'answer p50 ms':>13} {'reuse':>6}")
    for m in c["modes"]:
        lines.append(f"  {m['label']:34} {_f(m['call_us'].get('p50')):>8} {_f(m['call_us'].get('p99')):>8} "
                     f"{_f(m['call_us'].get('max')):>8} {_f(m['blocked_per_step_us'].get('mean')):>12} "
                     f"{m['mean_deferred_steps']:12.2f} {100 * m['requests_deferred']:10.0f} "
                     f"{_f(m['answer_delay_us'].get('p50', 0) / 1e3, 2):>13} {m['reuse_ratio']:6.2f}")
    d = r["d"]
    lines += ["", "(d) instrumentation: blocking lookup end to end, us",
              f"  on  p50 {_f(d['on_us']['p50'])}  mean {_f(d['on_us']['mean'])}",
              f"  off p50 {_f(d['off_us']['p50'])}  mean {_f(d['off_us']['mean'])}",
              f"  added by both: median {100 * d['median_overhead']:+.1f}%, mean {100 * d['mean_overhead']:+.1f}%",
              f"  metrics only: median {100 * d['metrics_median_overhead']:+.1f}%; spans only: median "
              f"{100 * d['spans_median_overhead']:+.1f}%"]
    e = r["e"]
    lines += ["", "(e) store slowed (master frozen 20 ms of every 40 ms): us"]
    for name, v in e["slowed"].items():
        lines.append(f"  {name:22} sync call p50 {_f(v['sync_call_us']['p50'])} p99 {_f(v['sync_call_us']['p99'])} "
                     f"max {_f(v['sync_call_us']['max'])}; hits {v['sync_hits']}/{v['sync_answers']}; "
                     f"async per lookup p99 {_f(v['async_per_lookup_us']['p99'])}")
    lines.append(f"    store stopped (master frozen), one blocking call, bounded wait {e['stopped']['wait_s']} s:")
    for name, v in e["stopped"].items():
        if not isinstance(v, dict):
            continue
        if v.get("blocked_s") is None:
            lines.append(f"  {name:22} blocked > {v['still_blocked_after_s']} s (still blocked); returned "
                         f"{_f(v.get('returned_after_resume_s'), 2)} s after the master was thawed")
        else:
            lines.append(f"  {name:22} blocked {v['blocked_s'] * 1e3:.1f} ms, answered {v['hit_tokens']} hit tokens")
    lines += ["", "targets (ratio = ours / upstream):"]
    for t in r["targets"]:
        lines.append(f"  ({t['id']}) {t['what']}: ours {_f(t['ours'], 2)} vs {_f(t['upstream'], 2)} {t['unit']}, "
                     f"ratio {_f(t['ratio'], 2)} [{t['bound']}] -> {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)


__all__ = ["FULL", "QUICK", "Sizes", "format_report", "run_bench", "targets"]
