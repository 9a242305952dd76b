"""The bench's text report, block by block: one function per scenario, shared by ``bench`` and ``bench --master``."""

from __future__ import annotations

import math
from typing import Any


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing, NaN or ``b`` is zero."""
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def fmt(v: Any, digits: int = 1) -> str:
    """A figure for the table: ``-`` for missing or NaN, ``digits`` decimals for floats."""
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.{digits}f}"
    return str(v)


def vs_step_floor(r: dict[str, Any], m: dict[str, Any] | None) -> float | None:
    """Mode ``m``'s one-call p99 over the step round-trip floor's p99 (reported beside c2), or None if either is
    missing."""
    call = ((m or {}).get("call_us") or {}).get("p99")
    floor = (r.get("floors") or {}).get("step_round_trip_us", {}).get("p99")
    return call / floor if call is not None and floor else None


# Each floor's line in the report, in order: its label (padded so the figures line up) and its key in ``floors``;
# a floor a run did not measure (one added later, or not measured by that bench) has no line.
_FLOOR_LINES = (("round-trip floor (DEALER -> ROUTER child, one batch_is_exist)  ", "round_trip_us"),
                ("kernel-socket floor (the same over a Unix socket, no ZMQ)   ", "socket_round_trip_us"),
                ("touch floor (one send + one drain of an arrived reply)       ", "touch_us"),
                ("split floor (a send, one step, then one recv)               ", "split_us"),
                ("step round-trip floor ((c)'s step: its keys, one call, cold) ", "step_round_trip_us"))


def floors_block(r: dict[str, Any]) -> list[str]:
    """The floors, p50 and p99."""
    fl = r["floors"]
    return ["floors (no client library; measured within (a); reported, not targeted), us",
            *(f"  {label}p50 {fmt(fl[key]['p50'])}  p99 {fmt(fl[key]['p99'])}" for label, key in _FLOOR_LINES
              if key in fl)]


def a_block(r: dict[str, Any]) -> list[str]:
    """Scenario (a): one lookup call per client, sync and async."""
    lines = ["(a) scheduler-path cost of one lookup call, us (ours with production telemetry unless named, the named "
             "rows each in a process of its own; one lookup per step)",
             f"  {'client':34} {'sync p50':>9} {'sync p99':>9} {'async 1st p50':>14} {'async/lookup p50':>17} "
             f"{'x upstream':>10} {'x split floor':>13}"]
    base = r["a"]["upstream"]["async_per_lookup_us"]["p50"] if "upstream" in r["a"] else None
    split = r.get("floors", {}).get("split_us", {}).get("p50")
    for name, v in r["a"].items():
        per_lookup = v["async_per_lookup_us"]["p50"]
        lines.append(f"  {name:34} {fmt(v['sync_call_us']['p50']):>9} {fmt(v['sync_call_us']['p99']):>9} "
                     f"{fmt(v['async_first_call_us']['p50']):>14} {fmt(per_lookup):>17} "
                     f"{fmt(ratio(per_lookup, base), 2):>10} {fmt(ratio(per_lookup, split), 2):>13}")
    return lines


def a4_block(r: dict[str, Any]) -> list[str]:
    """Scenario (a4): cost per lookup for each k, per client, and ours / upstream."""
    a4 = r["a4"]
    ks = a4["ks"]
    lines = [f"(a4) k lookups arriving in one step, polled once per step ({a4['step_ms']:g} ms) until answered: "
             "cost per lookup on the scheduler's thread, p50 us (mean steps to answer)",
             f"  {'client':34} " + " ".join(f"{'k=' + str(k):>16}" for k in ks)]
    for name, per_k in a4["clients"].items():
        lines.append(f"  {name:34} " + " ".join(
            f"{fmt(per_k[str(k)]['per_lookup_us']['p50']):>9} ({per_k[str(k)]['mean_steps']:4.1f})" for k in ks))
    up, ours = a4["clients"].get("upstream"), a4["clients"].get("ours/pipelined")
    if up is None or ours is None:
        return lines
    lines.append(f"  {'ours / upstream':34} " + " ".join(
        f"{fmt(ratio(ours[str(k)]['per_lookup_us']['p50'], up[str(k)]['per_lookup_us']['p50']), 2):>16}" for k in ks))
    return lines


def c_block(r: dict[str, Any]) -> list[str]:
    """Scenario (c): vLLM's scheduler, one line per lookup mode."""
    c = r["c"]
    lines = [f"(c) vLLM's scheduler, {c['steps']} steps, {c['arrivals_per_step']} arrivals/step, "
             f"model step {c['model_step_ms']} ms"
             + (", each arriving at a random moment of the model step before it" if c.get("arrive_in_step") else ""),
             f"  {'mode':34} {'call p50':>8} {'call p99':>8} {'call max':>8} {'blocked/step':>12} "
             f"{'deferred/req':>12} {'% deferred':>10} {'answer p50 ms':>13} {'reuse':>6}"]
    for m in c["modes"]:
        lines.append(f"  {m['label']:34} {fmt(m['call_us'].get('p50')):>8} {fmt(m['call_us'].get('p99')):>8} "
                     f"{fmt(m['call_us'].get('max')):>8} {fmt(m['blocked_per_step_us'].get('mean')):>12} "
                     f"{m['mean_deferred_steps']:12.2f} {100 * m['requests_deferred']:10.0f} "
                     f"{fmt(m['answer_delay_us'].get('p50', 0) / 1e3, 2):>13} {m['reuse_ratio']:6.2f}")
    for m in c["modes"]:
        budget, collected, state = m.get("wait_budget_us", {}), m.get("sent_to_collected_us", {}), m.get("budget_state")
        if "budget" in m["label"] and budget.get("n"):
            lines.append(f"  {m['label']}: wait budget in force p50 {fmt(budget['p50'])} us, "
                         f"mean {fmt(budget['mean'])} us, {100 * (m['steps_without_wait'] or 0):.0f}% of steps "
                         f"without a wait; sent -> answer collected p50 {fmt(collected.get('p50'))} "
                         f"p90 {fmt(collected.get('p90'))} us")
        if "auto" in m["label"] and state:
            lines.append(f"    at the end: measured round trip p90 {fmt(state['rtt_p90_us'])} us, step interval "
                         f"{fmt(state['step_interval_us'])} us, cap {fmt(state['cap_us'])} us")
            if (ratio := vs_step_floor(r, m)) is not None:
                lines.append(f"    one call p99 / the step round-trip floor's p99 (reported; c2 divides by the "
                             f"one-lookup floor): {ratio:.2f}")
    return lines


def _d_method(d: dict[str, Any]) -> str:
    """How (d)'s processes were run: pairs taking turns (bench/turns.py), or, in older records, one after another."""
    if "turn_steps" in d:
        return f"pairs of processes, one per variant, taking turns of {d['turn_steps']} steps"
    return "processes per variant, ABBA"


def d_block(r: dict[str, Any]) -> list[str]:
    """Scenario (d): telemetry as deployed vs none, in (f)'s ``schedule()`` time, each variant in its own processes."""
    d = r["d"]
    if "added" not in d:  # a record from before (d) measured schedule(): a blocking lookup, telemetry on and off
        return ["(d) instrumentation: blocking lookup end to end, us",
                f"  on  p50 {fmt(d['on_us']['p50'])}  off p50 {fmt(d['off_us']['p50'])}  added by both: median "
                f"{100 * d['median_overhead']:+.1f}%"]
    lines = [f"(d) telemetry as deployed vs none: (f) at {d['blocks']} blocks, ours async, mean schedule() per step, "
             f"us ({d['rounds']} {_d_method(d)})",
             f"  deployed  mean {fmt(d['deployed_schedule_us']['mean'])}  p50 {fmt(d['deployed_schedule_us']['p50'])}",
             f"  off       mean {fmt(d['off_schedule_us']['mean'])}  p50 {fmt(d['off_schedule_us']['p50'])}",
             f"  added by telemetry as deployed: {100 * d['added']:+.1f}% (span exports received: {d['span_posts']})"]
    lines += [f"    process {i + 1}: {p['variant']:8} mean {fmt(p['schedule_us']['mean'])} us over "
              f"{p['schedule_us']['n']} steps" for i, p in enumerate(d["processes"])]
    return lines


def e_block(r: dict[str, Any]) -> list[str]:
    """Scenario (e): the store slowed, then stopped."""
    e = r["e"]
    lines = ["(e) store slowed (master frozen 20 ms of every 40 ms): us"]
    for name, v in e["slowed"].items():
        lines.append(f"  {name:22} sync call p50 {fmt(v['sync_call_us']['p50'])} p99 {fmt(v['sync_call_us']['p99'])} "
                     f"max {fmt(v['sync_call_us']['max'])}; hits {v['sync_hits']}/{v['sync_answers']}; "
                     f"async per lookup p99 {fmt(v['async_per_lookup_us']['p99'])}")
    lines.append(f"    store stopped (master frozen), one blocking call, bounded wait {e['stopped']['wait_s']} s:")
    for name, v in e["stopped"].items():
        if not isinstance(v, dict):
            continue
        if v.get("blocked_s") is None:
            lines.append(f"  {name:22} blocked > {v['still_blocked_after_s']} s (still blocked); returned "
                         f"{fmt(v.get('returned_after_resume_s'), 2)} s after the master was thawed")
        else:
            lines.append(f"  {name:22} blocked {v['blocked_s'] * 1e3:.1f} ms, answered {v['hit_tokens']} hit tokens")
    if "stopped_async" in e:  # runs before issue 49 did not measure it
        a = e["stopped_async"]
        lines.append(f"    store stopped, ours async at its default deadline ({fmt(a['deadline_ms'], 0)} ms): "
                     f"{a['polls']} polls, longest {fmt(a['longest_call_ms'], 2)} ms (p99 "
                     f"{fmt(a['call_us'].get('p99'))} us); ended as {a['outcome']} after "
                     f"{fmt(a['ended_after_s'], 2)} s")
    return lines


def _f_rows(length: dict[str, Any]) -> list[str]:
    up = length["modes"]["upstream async"]["schedule_us"]["mean"]
    return [f"  {length['blocks']:>6} {m['requests']:>8} {label:16} {fmt(m['call_us'].get('p50')):>9} "
            f"{fmt(m['call_us'].get('mean')):>9} {fmt(m['call_us'].get('p99')):>9} "
            f"{fmt(m['schedule_us'].get('mean')):>10} {fmt(m['answer_delay_us'].get('p50', 0) / 1e3, 2):>9} "
            f"{m['mean_deferred_steps']:8.2f} {fmt(ratio(m['schedule_us'].get('mean'), up), 2):>10}"
            for label, m in length["modes"].items()]


_F_HEAD = (f"  {'blocks':>6} {'requests':>8} {'client':16} {'call p50':>9} {'call mean':>9} {'call p99':>9} "
           f"{'schedule()':>10} {'answer ms':>9} {'deferred':>8} {'x upstream':>10}")


def f_block(r: dict[str, Any]) -> list[str]:
    """Scenario (f): the whole prompt-length curve of both clients."""
    lines = ["(f) prompt length through vLLM's scheduler, both async (model step 1.5 ms; rounds of each client "
             "pooled): per-call cost us, mean schedule() us per step, answer p50 ms", _F_HEAD]
    for length in r["f"]["lengths"]:
        lines += _f_rows(length)
    return lines


def f_load_block(r: dict[str, Any]) -> list[str]:
    """Target f-load: (f) at 64 blocks with more arrivals a step than upstream's one thread answers."""
    load = r["f_load"]
    return [f"(f-load) {load['blocks']}-block prompts, {load['arrivals_per_step']} arrivals a step, both async "
            f"({load['rounds']} rounds each, pooled)", _F_HEAD, *_f_rows(load)]


def b_block(r: dict[str, Any]) -> list[str]:
    """Scenario (b): time until every answer of a burst is ready, per client."""
    b = r["b"]
    base = b["upstream"]["seconds"] if "upstream" in b else None
    lines = [f"(b) burst of {b['n']} new requests: time until every answer is ready"]
    for name, v in b.items():
        if isinstance(v, dict):
            lines.append(f"  {name:26} {v['seconds'] * 1e3:8.1f} ms  {v['steps']:5.0f} steps  "
                         f"hit tokens {v['hit_tokens']}  x upstream {fmt(ratio(v['seconds'], base), 2)}")
    return lines


def backends_block(r: dict[str, Any]) -> list[str]:
    """The server's side: one lookup per backend, in-process, and our in-vLLM backend / upstream's."""
    lines = ["server side: one lookup of a cold prompt, in-process, p50 us (keys no store holds)",
             f"  {'blocks':>6} {'keys':>5} {'batch_is_exist':>14} {'PrefixIndex':>11} {'upstream worker':>15} "
             f"{'WorkerBackend':>13} {'ours / upstream (in vLLM)':>25}"]
    for n, v in r["backends"].items():
        lines.append(f"  {n:>6} {v['keys']:>5} {fmt(v['batch_is_exist']['p50']):>14} "
                     f"{fmt(v['prefix_index']['p50']):>11} {fmt(v['upstream_worker']['p50']):>15} "
                     f"{fmt(v['worker_backend']['p50']):>13} "
                     f"{fmt(ratio(v['worker_backend']['p50'], v['upstream_worker']['p50']), 2):>25}")
    return lines


def g_block(r: dict[str, Any]) -> list[str]:
    """Scenario (g): multi-turn conversations, per backend and shape; then keys per lookup turn by turn."""
    g = r["g"]
    lines = [f"(g) multi-turn conversations through vLLM's scheduler (model step {g['model_step_ms']:g} ms; master "
             f"lease {g['lease_ms']} ms, lookup_answer_ttl_ms {g['answer_ttl_ms']:g}), from the second turn on: store "
             "keys and calls per lookup (counted at the store client, marker included), lookup path per request "
             "(sync: time to answer; async: scheduler-path cost) us, arrival to answer ms, ours' known share"]
    for backend, shapes in g["backends"].items():
        for entry in shapes:
            s = entry["shape"]
            lines.append(f"  {backend}: {s['conversations']} conversations, {s['context_blocks']}-block context, "
                         f"{s['turns']} turns of {s['blocks_per_turn']} blocks")
            lines.append(f"    {'mode':15} {'keys/lookup':>11} {'calls':>5} {'path p50':>9} {'p90':>9} "
                         f"{'answer ms':>9} {'known':>6} {'no-RTT':>6} {'x upstream keys':>15}")
            for label, run in entry["runs"].items():
                f = run["from_turn_2"]
                up = entry["runs"][label.replace("ours", "upstream")]["from_turn_2"]["keys_per_lookup"]
                lines.append(f"    {label:15} {fmt(f['keys_per_lookup']):>11} {fmt(f['calls_per_lookup'], 2):>5} "
                             f"{fmt(f['path_us'].get('p50')):>9} {fmt(f['path_us'].get('p90')):>9} "
                             f"{fmt(f['answer_us'].get('p50', float('nan')) / 1e3, 2):>9} "
                             f"{fmt(f['known_share'], 3):>6} {f['cache_answers']:>6} "
                             f"{fmt(ratio(f['keys_per_lookup'], up), 3):>15}")
            for label in ("upstream sync", "ours sync"):
                per_turn = " ".join(f"{t['keys_per_lookup']:.0f}" for t in entry["runs"][label]["turns"])
                lines.append(f"    keys per lookup by turn, {label}: {per_turn}")
    return lines


def h_block(r: dict[str, Any]) -> list[str]:
    """Scenario (h), phase by phase: the master's CPU, keys and calls per lookup, latency, the others' CPU."""
    h = r["h"]
    cal = h["calibration"]
    lines = [f"(h) a fleet on one master: N engines (a lookup server and an engine process each), {h['seconds']:g} s "
             f"a phase; the master's CPU net of its idle rate (clock: {h['clock']})",
             "  the master's CPU per store call, calls back to back on the same keys: "
             + ", ".join(f"{p['keys']} keys {fmt(p['per_call_us'])} us" for p in cal["points"]),
             f"  {'workload':13} {'N':>2} {'client':8} {'lookups/s':>9} {'master ms/1k':>12} {'keys/lookup':>11} "
             f"{'calls/lookup':>12} {'p50 ms':>7} {'p99 ms':>7} {'clients ms/1k':>13} {'servers ms/1k':>13} "
             f"{'idle ms/s':>9} {'hit tokens/lookup':>17}"]
    for p in h["phases"]:
        m = p["master"]
        lines.append(f"  {p['workload']:13} {p['n']:>2} {p['client']:8} {fmt(p['lookups_per_s']):>9} "
                     f"{fmt(m['per_1000_ms']):>12} {fmt(m['keys_per_lookup']):>11} {fmt(m['calls_per_lookup'], 2):>12} "
                     f"{fmt(p['delay_ms']['p50'], 2):>7} {fmt(p['delay_ms']['p99'], 2):>7} "
                     f"{fmt(p['clients_cpu_per_1000_ms']):>13} {fmt(p['servers_cpu_per_1000_ms']):>13} "
                     f"{fmt(m['idle_ms_per_s'], 2):>9} {fmt(p.get('hit_tokens_per_lookup')):>17}")
    for kind, s in h["summary"].items():
        for client in ("upstream", "ours"):
            c = s[client]
            doubled = c["p99_doubles_at"]
            lines.append(f"  {kind}, {client}: master {fmt(c['master_per_1000_ms'])} ms per 1,000 lookups; p99 "
                         + ", ".join(f"N={n} {fmt(v, 2)} ms" for n, v in c["p99_ms_by_n"].items())
                         + f"; doubles at N = {doubled if doubled is not None else 'none measured'}")
        lines.append(f"  {kind}: ours / upstream {fmt(s['ratio'], 3)}")
    return lines


def _ms(us: float | None) -> str:
    return fmt(None if us is None else us / 1e3, 1)


def j_block(r: dict[str, Any]) -> list[str]:
    """Scenario (j): contention, no fault; each client's lookups that ended without the store's answer."""
    j = r["j"]
    lines = [f"(j) contention, no fault: {j['steps']} steps of {j['arrivals_per_step']} arrivals, model step "
             f"{fmt(j['model_step_ms'])} ms, {j['cores']} cores",
             f"  {'condition':9} {'client':24} {'deadline':>8} {'lookups':>7} {'no answer':>9} {'share':>7} "
             f"{'breaker':>7} {'late':>5} {'hit tokens':>10} {'call p99 us':>11} {'call max us':>11} "
             f"{'rtt p99 ms':>10} {'p99.9 ms':>8} {'max ms':>7}"]
    for cond, c in j["conditions"].items():
        for v in c["variants"]:
            ours = v["client"] != "upstream"
            share = v.get("failed_share")
            lines.append(f"  {cond:9} {v['label']:24} {fmt(v.get('timeout_ms'), 0) if ours else 'none':>8} "
                         f"{v['lookups']:>7} {fmt(v.get('failed')) if ours else '-':>9} "
                         f"{fmt(share * 100, 2) + '%' if share is not None else '-':>7} "
                         f"{('opened' if v.get('breaker_opened') else 'closed') if ours else '-':>7} "
                         f"{fmt(v.get('late_replies')):>5} {v['hit_tokens']:>10} {fmt(v['call_us'].get('p99')):>11} "
                         f"{fmt(v['call_us'].get('max')):>11} {_ms(v.get('answered_rpc_us', {}).get('p99')):>10} "
                         f"{_ms(v.get('answered_rpc_p999_us')):>8} {_ms(v.get('answered_rpc_us', {}).get('max')):>7}")
    return lines


def i_block(r: dict[str, Any]) -> list[str]:
    """Scenario (i): real engines, one line per engine of each wave (upstream's first)."""
    i = r["i"]
    sp, mt = i["shared_prefix"], i["multi_turn"]
    lines = [f"(i) real vllm serve engines on CPU, ours and upstream's taking turns, {i['clients']} concurrent "
             f"clients: shared-prefix ({sp['requests']} requests, {sp['prefixes']} prefixes of {sp['prefix_blocks']} "
             f"blocks) then multi-turn ({mt['conversations']} conversations x {mt['turns']} turns)",
             f"  {'engine':15} {'requests':>8} {'TTFT p50':>8} {'p99 ms':>8} {'store hits':>10} {'of prompt':>9} "
             f"{'lookup/step us':>14} {'(own metric)':>12} {'steps':>6} {'lookup/req us':>13} {'ready s':>7}  lookups"]
    engines = [e for wave in i["waves"] for e in (wave["upstream"], *wave["ours"])] + i.get("twins", [])
    for e in engines:
        lookups = {}
        for w in e["workloads"].values():
            for k, v in (w.get("lookups") or {}).items():
                lookups[k] = lookups.get(k, 0) + v
        seen = " ".join(f"{k} {v:.0f}" for k, v in sorted(lookups.items()) if v) if e["ours"] else "-"
        lines.append(f"  {e['label']:15} {e['requests']:8d} {fmt(e['ttft_ms']['p50']):>8} "
                     f"{fmt(e['ttft_ms']['p99']):>8} {e['hit_tokens']:10.0f} {e['prompt_tokens']:9.0f} "
                     f"{fmt(e['lookup_us_per_step']):>14} {fmt(e['exported_blocked_us_per_step']):>12} "
                     f"{e['steps']:6.0f} {fmt(e.get('lookup_us_per_request')):>13} {fmt(e['ready_s'], 0):>7}"
                     f"  {seen}"
                     + (f"  ({e['failed']} failed)" if e["failed"] else ""))
    trips = [(e["label"], e["round_trip"]) for e in engines if e.get("round_trip")]  # ours only
    if trips:
        lines.append("  ours' lookup round trips (send to answer, or to the deadline), bucket bounds: " + "; ".join(
            f"{label} p50 <= {fmt(t['p50_le_ms'])} ms, p99 <= {fmt(t['p99_le_ms'])}, longest <= "
            f"{fmt(t['max_le_ms'])}, {t['late_replies']:.0f} late" for label, t in trips))
    return lines


def targets_block(entries: list[dict[str, Any]]) -> list[str]:
    """The targets, one line each (with the figures measured beside a target under it)."""
    lines = ["targets (ratio = ours / reference; met when within the bound):"]
    for t in entries:
        ref = t.get("upstream", t.get("floor"))
        lines.append(f"  ({t['id']}) {t['what']}: ours {fmt(t['ours'], 2)} vs {fmt(ref, 2)} {t['unit']} "
                     f"({t['vs']}), ratio {fmt(t['ratio'], 2)} [{t['bound']}] -> {'met' if t['met'] else 'MISSED'}")
        if "scheduler_path_us" in t:
            p = t["scheduler_path_us"]
            lines.append(f"       beside it, the scheduler-path cost per lookup (async, p50): ours {fmt(p['ours'])} vs "
                         f"{fmt(p['upstream'])} us, ratio {fmt(p['ratio'], 2)}")
        if "schedule_us" in t:
            sch = t["schedule_us"]
            lines.append(f"       beside it, mean schedule() per step: ours {fmt(sch['ours'])} vs "
                         f"{fmt(sch['upstream'])} us, "
                         f"ratio {fmt(sch['ratio'], 2)}")
        if "same_engines" in t:
            same = t["same_engines"]
            lines.append(f"       beside it, {len(same['engines'])} identical engines of the same run "
                         f"({', '.join(same['engines'])}): " + ", ".join(fmt(f, 2) for f in same["figures"])
                         + f" {t['unit']}, largest / smallest {fmt(same['spread'], 2)}")
        for key, what in (("pairs", "each pair"), ("per_request", "beside it, per request served, us")):
            if key in t:
                lines.append(f"       {what}: " + "; ".join(f"{p['pair']} {fmt(p['ours'], 2)} vs "
                                                         f"{fmt(p['upstream'], 2)} ({fmt(p['ratio'], 2)})"
                                                         for p in t[key]))
        if "sizes" in t:
            lines.append("       each size: " + "; ".join(f"{s['blocks']} blocks {fmt(s['ours_ms'], 2)} vs "
                                                          f"{fmt(s['upstream_ms'], 2)} ms ({fmt(s['ratio'], 2)})"
                                                          for s in t["sizes"]))
        if "vllm_layout" in t:
            v = t["vllm_layout"]
            lines.append(f"       through vLLM's key layout (upstream's worker): ours {fmt(v['ours'], 2)} vs "
                         f"{fmt(v['upstream'], 2)} {t['unit']}, ratio {fmt(v['ratio'], 3)} -> "
                         f"{'met' if v['met'] else 'MISSED'}")
    return lines



__all__ = ["a4_block", "a_block", "b_block", "backends_block", "c_block", "d_block", "e_block", "f_block",
           "f_load_block", "floors_block", "fmt", "g_block", "h_block", "i_block", "ratio", "targets_block",
           "vs_step_floor"]
