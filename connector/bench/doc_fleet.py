"""The doc blocks of scenarios (f-load) and (h) and of the sizing model, drawn from the committed bench runs.

Why: the fleet's figures (the master's CPU per lookup, engines per master core) are what an operator sizes a
deployment by; they are generated from the committed runs (``docs/bench/run-N.json``) like every other measured
figure, and a test fails when a doc drifts from them. Blocks:

* ``bench-fleet`` (docs/bench-results.md): (f-load) and (h) phase by phase, every figure per run;
* ``bench-sizing`` (docs/operations.md): the sizing model (:mod:`.fleet_model`) of the committed runs, its answer
  for a few settings, and its check against what (h) measured at N = 4;
* ``bench-fleet-helm`` (docs/helm.md): engines per master core, ours and upstream's, at the bench's setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.bench import fleet_model
from mooncake_lookout.connector.bench.doc_tables import runs_note
from mooncake_lookout.connector.bench.records import Run, across, get, num, ordered_union

# Settings the sizing table projects (workload, blocks per prompt, new requests a second per engine): the bench's
# own prompt sizes and longer ones (keys grow with the blocks, as the model assumes).
SIZING_SETTINGS = (("shared-prefix", 8, 50.0), ("shared-prefix", 256, 50.0), ("multi-turn", 2200, 10.0),
                   ("multi-turn", 8000, 10.0))


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def _h_runs(runs: Sequence[Run]) -> list[Run]:
    return [r for r in runs if get(r.results, "h", "phases")]


def _phase(r: dict[str, Any], workload: str, n: int, client: str) -> dict[str, Any] | None:
    return next((p for p in get(r, "h", "phases") or () if p["workload"] == workload and p["n"] == n
                 and p["client"] == client), None)


def _f_load(runs: Sequence[Run]) -> list[str]:
    runs = [r for r in runs if get(r.results, "f_load", "modes")]
    if not runs:
        return []
    rows = []
    for label in ("upstream async", "ours async"):
        def fig(*path: str, scale: float = 1.0, x: str = label) -> Any:
            return lambda r: (get(r, "f_load", "modes", x, *path) or 0) * scale \
                if get(r, "f_load", "modes", x, *path) is not None else None
        rows.append([label, across(runs, fig("mean_deferred_steps"), 2),
                     across(runs, fig("answer_delay_us", "p50", scale=1e-3), 1),
                     across(runs, fig("schedule_us", "mean")), across(runs, fig("call_us", "p50"))])
    arrivals = across(runs, lambda r: get(r, "f_load", "arrivals_per_step"), 0)
    blocks = across(runs, lambda r: get(r, "f_load", "blocks"), 0)
    return [f"**(f-load) (f) under load: {blocks}-block prompts, {arrivals} arrivals a step**", "",
            *_table(["client", "deferred steps / request", "answer p50 (ms)", "schedule() mean (us)",
                     "call p50 (us)"], rows)]


def _fleet_rows(runs: Sequence[Run]) -> list[list[str]]:
    keys = ordered_union([f"{p['workload']}\t{p['n']}\t{p['client']}" for p in get(r.results, "h", "phases")]
                         for r in runs)
    rows = []
    for key in keys:
        workload, n, client = key.split("\t")

        def fig(*path: str, w: str = workload, k: int = int(n), c: str = client) -> Any:
            return lambda r: get(_phase(r, w, k, c), *path)
        rows.append([workload, n, client, across(runs, fig("lookups_per_s"), 0),
                     across(runs, fig("master", "per_1000_ms")), across(runs, fig("master", "keys_per_lookup"), 1),
                     across(runs, fig("master", "calls_per_lookup"), 2), across(runs, fig("delay_ms", "p50"), 2),
                     across(runs, fig("delay_ms", "p99"), 1), across(runs, fig("clients_cpu_per_1000_ms"), 0),
                     across(runs, fig("servers_cpu_per_1000_ms"), 0)])
    return rows


def render_fleet(runs: Sequence[Run]) -> str:
    """Scenarios (f-load) and (h), every figure per run."""
    out = [runs_note(runs), "", *_f_load(runs)]
    h_runs = _h_runs(runs)
    if not h_runs:
        return "\n".join(out + ["", "No committed run measured scenario (h)."]) + "\n"
    clock = get(h_runs[-1].results, "h", "clock")
    out += ["", "**(h) a fleet of N engines on one master**, each engine a lookup server process and an engine process "
            "of its own; the master's CPU from its own `/proc` entry, net of its idle rate (clock: " + clock + "); "
            "keys and store calls per lookup from the master's own counters; arrival to answer over every lookup of "
            "the phase; the engines' and the servers' CPU beside, kept out of the master's", "",
            *_table(["workload", "N", "client", "lookups/s", "master CPU per 1,000 lookups (ms)", "keys/lookup",
                     "calls/lookup", "answer p50 (ms)", "answer p99 (ms)", "engines' CPU per 1,000 (ms)",
                     "servers' CPU per 1,000 (ms)"], _fleet_rows(h_runs)), ""]
    summary_rows = []
    for kind in ordered_union(get(r.results, "h", "summary") or {} for r in h_runs):
        for client in fleet_model.CLIENTS:
            summary_rows.append([kind, client, across(h_runs, lambda r, k=kind, c=client: get(
                r, "h", "summary", k, c, "master_per_1000_ms")),
                across(h_runs, lambda r, k=kind, c=client: get(r, "h", "summary", k, c, "p99_doubles_at") or "none",
                       0)])
    out += _table(["workload", "client", "master CPU per 1,000 lookups, all N (ms)", "N where the p99 doubles"],
                  summary_rows)
    return "\n".join(out) + "\n"


def _model(runs: Sequence[Run]) -> fleet_model.Model | None:
    hs = [r.results["h"] for r in _h_runs(runs)]
    return fleet_model.from_runs(hs) if hs else None


def render_sizing(runs: Sequence[Run]) -> str:
    """docs/operations.md: the model of the committed runs, its answer for a few settings, its check at N = 4."""
    model = _model(runs)
    if model is None:
        return "No committed run measured scenario (h): run `mooncake-lookout bench --only h`.\n"
    h_runs = _h_runs(runs)
    out = [f"The master's CPU for one lookup: **{num(model.per_key_us, 2)} us a key**, plus what a store call costs, "
           "which depends on how the calls come (a lone call wakes the master's threads; one of a burst finds them "
           f"awake). From scenario (h)'s fleets of more than one engine but {fleet_model.CHECK_N}, in "
           f"{len(h_runs)} committed run{'s' * (len(h_runs) > 1)}; keys and calls per lookup as the master counted "
           "them:", ""]
    rows = []
    for workload, setting in model.settings.items():
        for client in fleet_model.CLIENTS:
            shape = model.shapes[workload][client]
            rows.append([workload, client, num(setting["blocks"], 0), num(shape.keys_per_block * setting["blocks"], 1),
                         num(shape.calls_per_lookup, 2), num(shape.per_call_us),
                         num(model.per_lookup_us(workload, client, setting["blocks"]))])
    out += _table(["workload", "client", "blocks per prompt (bench)", "keys per lookup", "store calls per lookup",
                   "master CPU per call (us)", "master CPU per lookup (us)"], rows)
    out += ["", "What one engine's lookups take of the master, and how many engines one master core serves for "
            "lookups alone (`mooncake-lookout size` answers for your own figures):", ""]
    rows = []
    for workload, blocks, rate in SIZING_SETTINGS:
        if workload not in model.shapes:
            continue
        loads = fleet_model.project(model, workload, engines=1, rate=rate, blocks=blocks)
        rows.append([workload, num(blocks, 0), num(rate, 0),
                     *[f"{num(loads[c].master_cores * 1e3, 2)} ms/s; {num(loads[c].engines_per_core(1), 0)}"
                       for c in fleet_model.CLIENTS]])
    out += _table(["workload", "blocks per prompt", "new requests/s per engine",
                   "upstream: master CPU per engine; engines per core",
                   "ours: master CPU per engine; engines per core"],
                  rows)
    out += ["", f"The check: the model's answer for the bench's own setting at N = {fleet_model.CHECK_N} engines (a "
            "fleet size it was not fitted to) beside what the master used there, run by run:", ""]
    rows = []
    for c in fleet_model.check_against(model, h_runs[0].results["h"]):
        def measured(r: dict[str, Any], w: str = c["workload"], k: str = c["client"]) -> float | None:
            cores = fleet_model.measured_cores(r["h"], w, k)
            return None if cores is None else cores * 1e3
        rows.append([c["workload"], c["client"], num(c["projected_cores"] * 1e3, 1), across(h_runs, measured, 1),
                     across(h_runs, lambda r, m=measured, x=c["projected_cores"] * 1e3: x / m(r) if m(r) else None,
                            2)])
    out += _table(["workload", "client", "model (ms of CPU a second)", "measured (ms of CPU a second)",
                   "model / measured"], rows)
    return "\n".join(out + ["", runs_note(h_runs)]) + "\n"


def render_helm_fleet(runs: Sequence[Run]) -> str:
    """docs/helm.md: engines per master core at the bench's setting, ours and upstream's."""
    model = _model(runs)
    if model is None:
        return "No committed run measured scenario (h).\n"
    rows = []
    for workload, setting in model.settings.items():
        loads = fleet_model.project(model, workload, engines=1, rate=setting["rate"], blocks=setting["blocks"])
        rows.append([workload, num(setting["blocks"], 0), num(setting["rate"], 0),
                     num(loads["upstream"].engines_per_core(1), 0), num(loads["ours"].engines_per_core(1), 0)])
    return "\n".join(_table(["workload", "blocks per prompt", "new requests/s per engine",
                             "engines per master core, vLLM's client", "engines per master core, ours"], rows)
                     + ["", runs_note(_h_runs(runs))]) + "\n"


__all__ = ["SIZING_SETTINGS", "render_fleet", "render_helm_fleet", "render_sizing"]
