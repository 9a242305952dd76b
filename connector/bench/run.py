"""``mooncake-lookout bench``: upstream's lookup path vs ours vs the machine's floors, in one run, on one real master.

Scenarios (one module each in this package): the floors (:mod:`.floors`, measured within (a)); (a)
:mod:`.call` scheduler-path cost of one call; (a4) :mod:`.per_step` k lookups arriving in one step; the
server side per backend (:mod:`.backends`, in-process, read-only); (b)
:mod:`.burst` a burst of new requests; (c) :mod:`.sched` vLLM's real scheduler per lookup mode; (d)
:mod:`.overhead` metrics and spans on vs off; (e) :mod:`.fault` the store slowed or stopped; (f)
:mod:`.long_prompts` prompts of 8 to 4,096 blocks through vLLM's scheduler; (g) :mod:`.multi_turn`
multi-turn conversations through vLLM's scheduler, the store keys each turn's lookup sends (the prefix
cache's issue).
Writes ``bench.json`` (machines), ``bench.txt`` (the table printed) and PNG figures to ``--out``.
Each target of the lookup-path issue is judged in :func:`targets`: ours, the reference (upstream, a
floor, a deadline), the ratio, the bound and "met" or "MISSED".
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mooncake_lookout.connector.bench import long_prompts, multi_turn
from mooncake_lookout.connector.bench.conversations import Shape
from mooncake_lookout.connector.bench.report import (
    a4_block,
    a_block,
    b_block,
    backends_block,
    c_block,
    d_block,
    e_block,
    f_block,
    floors_block,
    g_block,
    targets_block,
)
from mooncake_lookout.connector.bench.report import ratio as ratio_of
from mooncake_lookout.connector.rigs.machine import machine
from mooncake_lookout.connector.rigs.workload import shared_prefix_workload
from mooncake_lookout.connector.transport.names import UPSTREAM

BUDGET_US = 200
AUTO = "ours budget auto"
A4_K = 16  # the k of target a4
TARGET_IDS = ("a", "a1", "a4", "a2", "a3", "b", "c1", "c2", "d", "e", "f", "g1", "g2")


@dataclass(frozen=True)
class Sizes:
    """How much each scenario does: ``quick`` (a test, well under 2 minutes) or full (several minutes)."""

    call_requests: int
    burst_n: int
    burst_repeats: int
    sched_steps: int
    overhead_rounds: int
    fault_requests: int
    fault_wait_s: float
    budgets_us: tuple[int, ...]
    per_step_rounds: int
    lengths: tuple[long_prompts.Length, ...]
    backend_rounds: int
    conversations: tuple[Shape, ...]  # scenario (g): the example first, the 4,096-block context last
    vllm_layout: bool  # scenario (g) also through vLLM's key layout (a server process more: ~20 s to start)


QUICK = Sizes(100, 256, 1, 100, 6, 20, 2.0, (BUDGET_US,), 6, long_prompts.QUICK, 5, multi_turn.QUICK, False)
FULL = Sizes(500, 256, 5, 400, 24, 100, 5.0, (BUDGET_US, 500, 1000), 40, long_prompts.FULL, 30, multi_turn.FULL,
             True)


def _modes(sizes: Sizes) -> list[Any]:
    from mooncake_lookout.connector.bench.sched import mode

    modes = [mode("upstream sync", False, lookup_async=False),
             mode("upstream async", False, lookup_async=True),
             mode("ours sync", True, lookup_async=False),
             mode("ours async", True, lookup_async=True),
             mode(AUTO, True, lookup_async=True, lookup_wait_us="auto")]
    modes += [mode(f"ours budget {b}us", True, lookup_async=True, lookup_wait_us=b) for b in sizes.budgets_us]
    modes.append(mode(f"ours budget {BUDGET_US}us upstream-wire", True, UPSTREAM, lookup_async=True,
                      lookup_wait_us=BUDGET_US))
    return modes


def run_bench(out_dir: str, *, quick: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every scenario, write the outputs, return the results (as written to ``bench.json``)."""
    from mooncake_lookout.connector.bench import burst, call, fault, overhead, per_step, sched
    from mooncake_lookout.connector.bench.plots import write_all
    from mooncake_lookout.connector.bench.rig import Rig
    from mooncake_lookout.connector.rigs.scheduler_driver import freeze_startup_heap

    sizes = QUICK if quick else FULL
    t_start = time.perf_counter()
    results: dict[str, Any] = {"quick": quick, "machine": machine()}
    call_reqs = shared_prefix_workload(sizes.call_requests, num_prefixes=4, seed=1)
    burst_reqs = shared_prefix_workload(sizes.burst_n, num_prefixes=4, seed=2)
    log("starting a Mooncake master, the lookup server process and the floor's process ...")
    with Rig(namespace="bench", floor=True) as rig:
        rig.index.store_prefixes([r.block_hashes[:4] if i % 2 else r.block_hashes
                                  for i, r in enumerate(call_reqs + burst_reqs)])
        results["rig_start_s"] = time.perf_counter() - t_start
        freeze_startup_heap()  # as vLLM's engine does once started: no full collection lands in a timed call
        log("(a) scheduler-path cost of one call, with the round-trip and touch floors ...")
        a = call.run(rig, call_reqs, rig.floor)
        raw_latency = a.pop("raw")
        results["floors"] = a.pop("floors")
        results["a"] = a
        log("(a4) k lookups arriving in one step ...")
        results["a4"] = per_step.run(rig, call_reqs, rounds=sizes.per_step_rounds)
        log("server side: one lookup per backend ...")
        results["backends"] = _backends(rig, sizes.backend_rounds)
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
        log("(f) prompts of 8 to 4,096 blocks through vLLM's scheduler ...")
        results["f"] = long_prompts.run(rig, sizes.lengths)
        log("(g) multi-turn conversations through vLLM's scheduler"
            + (", also in vLLM's key layout ..." if sizes.vllm_layout else " ..."))
        results["g"] = multi_turn.run(rig, sizes.conversations, layout=sizes.vllm_layout)
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


def _backends(rig: Any, rounds: int) -> dict[str, Any]:
    """The server-side cost per backend, over a lookup-only client of the rig's master (vLLM's layout for a
    model named ``bench``)."""
    from mooncake_lookout.connector.bench import backends
    from mooncake_lookout.connector.rigs.vllm_layout import Layout, ReadOnlyStore, layout_worker
    from mooncake_lookout.connector.server.store import open_store

    client = open_store(rig.master.rpc_address)
    try:
        store = ReadOnlyStore(client)
        return backends.run(store, layout_worker(store, Layout("bench")), rounds=rounds)
    finally:
        client.close()


def _json_default(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return str(obj)


def _mode(modes: list[dict[str, Any]], label: str) -> dict[str, Any]:
    return next(m for m in modes if m["label"] == label)


def _target(id_: str, what: str, ours: float, ref: float | None, *, vs: str, unit: str, limit: float,
            ratio: float | None = None, judged: float | None = None, bound: str | None = None) -> dict[str, Any]:
    """One target: ``ours`` against ``ref`` (upstream's figure or a floor's, per ``vs``); met when the judged
    figure (the ratio, unless ``judged`` is given) is at most ``limit``."""
    ratio = ratio_of(ours, ref) if ratio is None else ratio
    figure = ratio if judged is None else judged
    entry: dict[str, Any] = {"id": id_, "what": what, "ours": ours, "vs": vs, "unit": unit}
    entry["floor" if "floor" in vs else "upstream"] = ref
    entry.update(ratio=ratio, bound=bound or f"<= {limit:g}", met=figure is not None and figure <= limit)
    return entry


def _has(r: dict[str, Any], *path: str) -> bool:
    for key in path:
        if not isinstance(r, dict) or key not in r:
            return False
        r = r[key]
    return True


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of the lookup-path issue, in :data:`TARGET_IDS` order: figures, ratio, bound, met.

    A target whose figures were not measured (``bench --server`` has no upstream, say) is left out.
    """
    out = []
    floors = r.get("floors", {})
    if _has(r, "a", "ours/pipelined"):
        a_ours = r["a"]["ours/pipelined"]
        async_ours, sync_ours = a_ours["async_per_lookup_us"]["p50"], a_ours["sync_call_us"]["p50"]
        a_up = r["a"].get("upstream")
        if a_up is not None:
            out.append(_target("a", "async scheduler-path cost per lookup, median, ours (metrics+spans) / upstream",
                               async_ours, a_up["async_per_lookup_us"]["p50"], vs="upstream", unit="us", limit=1.0))
        if floors:
            out.append(_target("a1", "the same, ours / touch floor (one send + one drain on the caller's thread)",
                               async_ours, floors["touch_us"]["p50"], vs="touch floor", unit="us", limit=1.5))
        if _has(r, "a4", "clients", "upstream", str(A4_K)) and _has(r, "a4", "clients", "ours/pipelined", str(A4_K)):
            a4 = r["a4"]["clients"]
            out.append(_target("a4", f"{A4_K} lookups arriving in one step: cost per lookup, median, ours / upstream",
                               a4["ours/pipelined"][str(A4_K)]["per_lookup_us"]["p50"],
                               a4["upstream"][str(A4_K)]["per_lookup_us"]["p50"], vs="upstream", unit="us",
                               limit=0.5))
        if a_up is not None:
            out.append(_target("a2", "blocking lookup p50, ours / upstream", sync_ours, a_up["sync_call_us"]["p50"],
                               vs="upstream", unit="us", limit=0.9))
        if floors:
            out.append(_target("a3", "blocking lookup p50, ours / round-trip floor", sync_ours,
                               floors["round_trip_us"]["p50"], vs="round-trip floor", unit="us", limit=1.2))
    if _has(r, "b", "upstream") and _has(r, "b", "ours/pipelined"):
        b = r["b"]
        out.append(_target("b", f"burst of {b['n']}: time to all answers, ours pipelined / upstream",
                           b["ours/pipelined"]["seconds"] * 1e3, b["upstream"]["seconds"] * 1e3, vs="upstream",
                           unit="ms", limit=0.1))
    if _has(r, "c", "modes") and floors:
        modes = r["c"]["modes"]
        auto, up_async = _mode(modes, AUTO), _mode(modes, "upstream async")
        out.append(_target("c1", "lookup_wait_us auto: mean deferred steps per request (upstream async beside it)",
                           auto["mean_deferred_steps"], up_async["mean_deferred_steps"], vs="upstream",
                           unit="steps", limit=0.2, judged=auto["mean_deferred_steps"], bound="ours <= 0.2 steps"))
        out.append(_target("c2", "lookup_wait_us auto: p99 of one scheduler call / the round-trip floor's p99",
                           auto["call_us"]["p99"], floors["round_trip_us"]["p99"], vs="round-trip floor", unit="us",
                           limit=1.5))
    if _has(r, "d"):
        d = r["d"]
        out.append(_target("d", "metrics+spans on: added end-to-end lookup time (median; reference: telemetry off)",
                           d["on_us"]["p50"], d["off_us"]["p50"], vs="telemetry off", unit="us", limit=0.05,
                           ratio=1.0 + d["median_overhead"], judged=d["median_overhead"], bound="<= 5% added"))
    if _has(r, "e", "stopped"):
        e = r["e"]["stopped"]
        ours_block = max(e[n]["blocked_s"] or float("inf") for n in ("ours/pipelined", "ours/upstream-wire"))
        up = e["upstream"]
        up_block = up["blocked_s"] if up.get("blocked_s") is not None else up["still_blocked_after_s"]
        deadline_s = e["ours/pipelined"]["deadline_ms"] / 1e3
        entry = _target("e", f"store stopped: longest blocking call / the deadline ({deadline_s * 1e3:g} ms); "
                             "upstream blocks beside it", ours_block * 1e3, up_block * 1e3,
                        vs="upstream blocked; ratio to the deadline", unit="ms", limit=1.05,
                        ratio=ours_block / deadline_s, bound="ours <= deadline + 5%, upstream blocks")
        entry["met"] = entry["met"] and (up.get("blocked_s") is None or up["blocked_s"] > deadline_s)
        entry["deadline_ms"] = deadline_s * 1e3
        out.append(entry)
    if _has(r, "f", "lengths"):
        longest = max(r["f"]["lengths"], key=lambda length: length["blocks"])
        f_modes = longest["modes"]
        out.append(_target("f", f"{longest['blocks']}-block prompts, both async: mean schedule() time per step, "
                                "ours / upstream", f_modes["ours async"]["schedule_us"]["mean"],
                           f_modes["upstream async"]["schedule_us"]["mean"], vs="upstream", unit="us", limit=1.0))
    return out + _g_targets(r)


def _g_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 19's two targets, judged on the prefix index's runs; vLLM's key layout's figures beside when measured."""
    if not _has(r, "g", "backends", multi_turn.INDEX):
        return []
    backends = r["g"]["backends"]

    def later(backend: str, shape_at: int, label: str) -> dict[str, Any]:
        return backends[backend][shape_at]["runs"][label]["from_turn_2"]

    def beside(entry: dict[str, Any], figure: Callable[[str, str], float | None], limit: float) -> None:
        if multi_turn.LAYOUT in backends:
            ours, up = figure(multi_turn.LAYOUT, "ours"), figure(multi_turn.LAYOUT, "upstream")
            ratio = ratio_of(ours, up)
            entry["vllm_layout"] = {"ours": ours, "upstream": up, "ratio": ratio,
                                    "met": ratio is not None and ratio <= limit}

    first = backends[multi_turn.INDEX][0]["shape"]
    longest = max(range(len(backends[multi_turn.INDEX])),
                  key=lambda i: backends[multi_turn.INDEX][i]["shape"]["context_blocks"])
    long_shape = backends[multi_turn.INDEX][longest]["shape"]

    def keys(backend: str, client: str) -> float | None:
        return later(backend, 0, f"{client} sync")["keys_per_lookup"]

    def answer(backend: str, client: str) -> float | None:
        return later(backend, longest, f"{client} sync")["path_us"].get("p50")

    g1 = _target("g1", f"multi-turn ({first['context_blocks']}-block context, {first['turns']} turns of "
                       f"{first['blocks_per_turn']} blocks): store keys sent per lookup from the second turn on, "
                       "ours / upstream (counted at the store client)", keys(multi_turn.INDEX, "ours"),
                 keys(multi_turn.INDEX, "upstream"), vs="upstream", unit="keys", limit=0.1)
    beside(g1, keys, 0.1)
    g2 = _target("g2", f"multi-turn, {long_shape['context_blocks']}-block context: time to answer (sync lookup path, "
                       "p50, from the second turn on), ours / upstream", answer(multi_turn.INDEX, "ours"),
                 answer(multi_turn.INDEX, "upstream"), vs="upstream", unit="us", limit=0.2)
    beside(g2, answer, 0.2)
    path = {client: later(multi_turn.INDEX, longest, f"{client} async")["path_us"].get("p50")
            for client in ("ours", "upstream")}
    g2["scheduler_path_us"] = {**path, "ratio": ratio_of(path["ours"], path["upstream"])}
    return [g1, g2]


REPORT_BLOCKS: tuple[tuple[str, Callable[[dict[str, Any]], list[str]]], ...] = (
    ("floors", floors_block), ("a", a_block), ("a4", a4_block), ("backends", backends_block), ("b", b_block),
    ("c", c_block), ("d", d_block), ("e", e_block), ("f", f_block), ("g", g_block))


def format_report(r: dict[str, Any]) -> str:
    """The human-readable report: one block per scenario, then the targets."""
    machine = r["machine"]
    start = machine.get("loadavg_at_start", [float("nan")])[0]
    end = machine.get("loadavg_at_end", [float("nan")])[0]
    lines = [f"mooncake-lookout bench ({'quick' if r['quick'] else 'full'}; {machine['cpus']} CPUs, "
             f"Python {machine['python']}, load average {start:.2f} at start, {end:.2f} at end)", ""]
    for key, block in REPORT_BLOCKS:
        if key in r:  # a run that did not measure a scenario (an older record, say) just lacks its block
            lines += block(r) + [""]
    return "\n".join(lines + targets_block(r["targets"]))


__all__ = ["A4_K", "AUTO", "BUDGET_US", "FULL", "QUICK", "REPORT_BLOCKS", "Sizes", "TARGET_IDS", "format_report",
           "machine", "run_bench", "targets"]
