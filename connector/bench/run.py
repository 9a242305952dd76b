"""``mooncake-lookout bench``: upstream's lookup path vs ours vs the machine's floors, in one run, on real masters.

Scenarios (one module each in this package): the floors (:mod:`.floors`, measured within (a)); (a)
:mod:`.call` scheduler-path cost of one call; (a4) :mod:`.per_step` k lookups arriving in one step (their rows
with no telemetry and with every span in processes of their own, :mod:`.solo`); the server side per backend
(:mod:`.backends`, in-process, read-only); (b) :mod:`.burst` a burst of new requests; (c) :mod:`.sched`
vLLM's real scheduler per lookup mode; (d) :mod:`.overhead` telemetry as deployed vs none, added to (f)'s
``schedule()`` time, in processes of their own; (e) :mod:`.fault` the store slowed or stopped; (f)
:mod:`.long_prompts` prompts of 8 to 4,096 blocks through vLLM's scheduler, and f-load, the same loaded; (g)
:mod:`.multi_turn` multi-turn conversations through vLLM's scheduler, the store keys each turn's lookup sends;
(j) :mod:`.contention` CPU hogs on every core and a GIL loop beside the lookup server, no fault; (h) :mod:`.fleet` a
fleet of engines' lookup paths on one master, the master's own CPU; (i) :mod:`.real_engine` real ``vllm serve``
engines on CPU (the engine venv), ours and upstream's taking turns over HTTP.
(a)-(j) share one rig (:class:`~.rig.Rig`: a master, a lookup server process); (h) starts its own master and
fleet once the rig is stopped, and (i) its own master and engines after that. Writes ``bench.json``
(machines), ``bench.txt`` (the table printed) and PNG
figures to ``--out``. The targets are judged in :mod:`.targets`.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mooncake_lookout.connector.bench import fleet, long_prompts, multi_turn, overhead, real_engine
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
    f_load_block,
    floors_block,
    g_block,
    h_block,
    i_block,
    j_block,
    targets_block,
)
from mooncake_lookout.connector.bench.targets import A4_K, AUTO, TARGET_IDS, targets
from mooncake_lookout.connector.rigs.machine import cpu_stolen_s, machine
from mooncake_lookout.connector.rigs.workload import shared_prefix_workload
from mooncake_lookout.connector.transport.names import UPSTREAM

BUDGET_US = 200
SCENARIOS = ("a", "a4", "backends", "b", "c", "d", "e", "f", "f-load", "g", "j", "h", "i")  # what --only may name
ENGINE_SCENARIOS = ("i",)  # what a quick run of every scenario leaves out
CALL_SEED = 1  # the requests of (a), (a4), (d)'s old rotation and the solo rows: shared_prefix_workload(seed=1)


@dataclass(frozen=True)
class Sizes:
    """How much each scenario does: ``quick`` (a test, a few minutes) or full (under half an hour on 2 cores)."""

    call_requests: int
    burst_n: int
    burst_repeats: int
    sched_steps: int
    fault_requests: int
    fault_wait_s: float
    budgets_us: tuple[int, ...]
    per_step_rounds: int
    lengths: tuple[long_prompts.Length, ...]
    f_rounds: int  # ABBA rounds of each (f) length
    f_load: long_prompts.Length
    d_rounds: int  # pairs of (d)'s processes, one per telemetry variant, taking turns
    d_steps: int  # steps of each (d) process
    backend_rounds: int
    conversations: tuple[Shape, ...]  # scenario (g): the example first, the 4,096-block context last
    vllm_layout: bool  # scenario (g) also through vLLM's key layout (a server process more: ~20 s to start)
    fleet: fleet.FleetSizes
    contention_steps: int  # scenario (j): steps of each client under each contention
    engine: real_engine.EngineSizes  # scenario (i): real engines


QUICK = Sizes(100, 256, 1, 100, 20, 2.0, (BUDGET_US,), 6, long_prompts.QUICK, long_prompts.QUICK_ROUNDS,
              long_prompts.QUICK_LOAD, 1, 200, 5, multi_turn.QUICK, False, fleet.QUICK, 50, real_engine.QUICK)
FULL = Sizes(1000, 256, 5, 600, 100, 5.0, (BUDGET_US, 500, 1000), 100, long_prompts.FULL, long_prompts.FULL_ROUNDS,
             long_prompts.FULL_LOAD, 4, overhead.STEPS, 30, multi_turn.FULL, True, fleet.FULL, 1500, real_engine.FULL)


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


def selected(only: Sequence[str] | None) -> tuple[str, ...]:
    """The scenarios to run: every one of :data:`SCENARIOS`, or those ``only`` names (ValueError for others)."""
    if not only:
        return SCENARIOS
    unknown = [s for s in only if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario {', '.join(map(repr, unknown))}: choose among {', '.join(SCENARIOS)}")
    return tuple(s for s in SCENARIOS if s in only)


def run_bench(out_dir: str, *, quick: bool = False, only: Sequence[str] | None = None,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the scenarios (all, or ``only`` those), write the outputs, return the results (as in ``bench.json``)."""
    from mooncake_lookout.connector.bench.plots import write_all

    chosen = selected(only)
    if quick and not only:  # (i) starts real engines (minutes): a quick run leaves it to tests/test_engine_modes.py
        chosen = tuple(s for s in chosen if s not in ENGINE_SCENARIOS)
    sizes = QUICK if quick else FULL
    t_start = time.perf_counter()
    results: dict[str, Any] = {"quick": quick, "machine": machine()}
    if len(chosen) < len(SCENARIOS):
        results["only"] = list(chosen)
    raw_latency: dict[str, Any] = {}
    if set(chosen) - {"h", "i"}:
        raw_latency = _on_the_rig(results, sizes, chosen, t_start, log)
    if "h" in chosen:
        step = _Timer(results, log)
        step("h", f"(h) a fleet of {', '.join(map(str, sizes.fleet.ns))} engines' lookup paths on one master ...")
        results["h"] = fleet.run(sizes.fleet, log=log)
        step.stop()
    if "i" in chosen:
        step = _Timer(results, log)
        waves = " | ".join(", ".join(w) for w in sizes.engine.waves)
        step("i", f"(i) real vllm serve engines in turns, waves {waves} ...")
        results["i"] = real_engine.run(sizes.engine, log=log)
        step.stop()
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


class _Timer:
    """Logs each scenario's start and keeps how long each took (``results["scenario_seconds"]``) and, where the
    kernel says, the CPU the host took from the machine meanwhile (``results["scenario_stolen_s"]``)."""

    def __init__(self, results: dict[str, Any], log: Callable[[str], None]) -> None:
        self.seconds: dict[str, float] = results.setdefault("scenario_seconds", {})
        self.stolen: dict[str, float] = results.setdefault("scenario_stolen_s", {})
        self.log = log
        self.name: str | None = None
        self.t0 = 0.0
        self.stolen0: float | None = None

    def __call__(self, name: str, message: str) -> None:
        """Scenario ``name`` starts now (the one before ends)."""
        self.stop()
        self.name, self.t0, self.stolen0 = name, time.perf_counter(), cpu_stolen_s()
        self.log(message)

    def stop(self) -> None:
        """The running scenario ends now."""
        if self.name is not None:
            self.seconds[self.name] = time.perf_counter() - self.t0
            if self.stolen0 is not None and (now := cpu_stolen_s()) is not None:
                self.stolen[self.name] = now - self.stolen0
            self.name = None


def _on_the_rig(results: dict[str, Any], sizes: Sizes, chosen: Sequence[str], t_start: float,
                log: Callable[[str], None]) -> dict[str, Any]:
    """Scenarios (a)-(g) on one rig, in order; returns (a)'s raw latencies for the plots."""
    from mooncake_lookout.connector.bench import burst, call, contention, fault, per_step, sched, solo
    from mooncake_lookout.connector.bench.rig import Rig
    from mooncake_lookout.connector.rigs.scheduler_driver import freeze_startup_heap

    call_spec = {"n": sizes.call_requests, "num_prefixes": 4, "seed": CALL_SEED}
    call_reqs = shared_prefix_workload(sizes.call_requests, num_prefixes=4, seed=CALL_SEED)
    burst_reqs = shared_prefix_workload(sizes.burst_n, num_prefixes=4, seed=2)
    raw_latency: dict[str, Any] = {}
    step = _Timer(results, log)
    step("rig", "starting a Mooncake master, the lookup server process and the floor's process ...")
    with Rig(namespace="bench", floor="a" in chosen) as rig:
        rig.index.store_prefixes([r.block_hashes[:4] if i % 2 else r.block_hashes
                                  for i, r in enumerate(call_reqs + burst_reqs)])
        results["rig_start_s"] = time.perf_counter() - t_start
        freeze_startup_heap()  # as vLLM's engine does once started: no full collection lands in a timed call
        if "a" in chosen:
            step("a", "(a) scheduler-path cost of one call, with the round-trip, touch and split floors ...")
            a = call.run(rig, call_reqs, rig.floor)
            raw_latency = a.pop("raw")
            results["floors"] = a.pop("floors")
            results["a"] = a
        if "a4" in chosen:
            step("a4", "(a4) k lookups arriving in one step ...")
            results["a4"] = per_step.run(rig, call_reqs, rounds=sizes.per_step_rounds)
        if "a" in chosen or "a4" in chosen:
            step("a-solo", "(a), (a4): ours with no telemetry, and with every span, each in a process of its own ...")
            rows = solo.run_rows(rig, call_spec, ks=per_step.KS, a4_rounds=sizes.per_step_rounds)
            if "a" in chosen:
                results["a"].update(rows["a"])
            if "a4" in chosen:
                results["a4"]["clients"].update(rows["a4"])
        if "backends" in chosen:
            step("backends", "server side: one lookup per backend ...")
            results["backends"] = _backends(rig, sizes.backend_rounds)
        if "b" in chosen:
            step("b", f"(b) burst of {sizes.burst_n} ...")
            results["b"] = burst.run(rig, burst_reqs, repeats=sizes.burst_repeats)
        if "c" in chosen:
            step("c", "(c) vLLM's scheduler per lookup mode ...")
            workload = sched.Workload()
            results["c"] = {"steps": sizes.sched_steps, "arrivals_per_step": sched.ARRIVALS_PER_STEP,
                            "model_step_ms": sched.MODEL_STEP_S * 1e3, "arrive_in_step": True,
                            "modes": [sched.run_mode(rig, workload, m, steps=sizes.sched_steps,
                                                     arrive_in_step=True).as_dict() for m in _modes(sizes)]}
        if "e" in chosen:
            step("e", "(e) store slowed, then stopped ...")
            results["e"] = fault.run(rig, call_reqs[:sizes.fault_requests], wait_s=sizes.fault_wait_s)
        if "f" in chosen:
            step("f", "(f) prompts of 8 to 4,096 blocks through vLLM's scheduler ...")
            results["f"] = long_prompts.run(rig, sizes.lengths, rounds=sizes.f_rounds)
        if "f-load" in chosen:
            step("f-load", f"(f-load) 64-block prompts, {sizes.f_load.arrivals_per_step} arrivals a step ...")
            results["f_load"] = long_prompts.run_load(rig, sizes.f_load)
        if "d" in chosen:
            step("d", "(d) telemetry as deployed vs none, (f) at 64 blocks, each in processes of its own ...")
            results["d"] = overhead.run(rig, rounds=sizes.d_rounds,
                                        length=replace(overhead.LENGTH, steps=sizes.d_steps))
        if "g" in chosen:
            step("g", "(g) multi-turn conversations through vLLM's scheduler"
                + (", also in vLLM's key layout ..." if sizes.vllm_layout else " ..."))
            results["g"] = multi_turn.run(rig, sizes.conversations, layout=sizes.vllm_layout)
        if "j" in chosen:
            step("j", "(j) contention: CPU hogs on every core, then a GIL loop in the lookup server's process ...")
            results["j"] = contention.run(rig, call_reqs, steps=sizes.contention_steps, log=log)
        step("rig-stop", "stopping the rig ...")
    step.stop()
    return raw_latency


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


REPORT_BLOCKS: tuple[tuple[str, Callable[[dict[str, Any]], list[str]]], ...] = (
    ("floors", floors_block), ("a", a_block), ("a4", a4_block), ("backends", backends_block), ("b", b_block),
    ("c", c_block), ("d", d_block), ("e", e_block), ("f", f_block), ("f_load", f_load_block), ("g", g_block),
    ("j", j_block), ("h", h_block), ("i", i_block))


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
    if r.get("scenario_seconds"):
        lines += ["time taken, s: " + ", ".join(f"{k} {v:.0f}" for k, v in r["scenario_seconds"].items())
                  + (f"; the whole run {r['seconds']:.0f}" if "seconds" in r else ""), ""]
    if r.get("scenario_stolen_s"):  # older runs did not record it
        lines += ["CPU the host took from this machine meanwhile (steal, all CPUs), s: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in r["scenario_stolen_s"].items())
                  + " (a scenario that lost much is the host's reading, not the code's)", ""]
    return "\n".join(lines + targets_block(r["targets"]))


__all__ = ["A4_K", "AUTO", "BUDGET_US", "ENGINE_SCENARIOS", "FULL", "QUICK", "REPORT_BLOCKS", "SCENARIOS", "Sizes",
           "TARGET_IDS", "format_report", "machine", "run_bench", "selected", "targets"]
