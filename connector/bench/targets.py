"""The bench's targets: each a figure of ours against a reference (upstream's client in the same run, a deadline),
the ratio, the bound and whether it was met.

Why: the targets are what the lookup path is held to, written once, here; the report, the docs and the tests
read them from a run's ``targets`` list. :data:`TARGET_IDS` is the order; a target whose figures a run did not
measure (``bench --only``, ``bench --server`` with no upstream) is left out. The floors (round trip, touch,
split) are reported beside the scenarios, not targeted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mooncake_lookout.connector.bench import multi_turn
from mooncake_lookout.connector.bench.report import ratio as ratio_of

AUTO = "ours budget auto"
A4_K = 16  # the k of target a4
F_SIZES = (8, 64, 512, 4096)
TARGET_IDS = ("f8", "f64", "f512", "f4096", "f-delay", "a", "a4", "a2", "b", "c1", "c2", "d", "e", "e-async", "g1",
              "g2", "f-load", "j1", "j2", "j3", "j4", "j5", "j6", "j7", "j8", "h1", "h2", "i1", "i2", "i3", "i4")
PRODUCTION_TELEMETRY = "production telemetry: vLLM's stats collector inline, spans sampled as the Helm chart samples"


def target(id_: str, what: str, ours: float | None, ref: float | None, *, vs: str, unit: str, limit: float,
           ratio: float | None = None, judged: float | None = None, bound: str | None = None) -> dict[str, Any]:
    """One target: ``ours`` against ``ref`` (upstream's figure or a floor's, per ``vs``); met when the judged
    figure (the ratio, unless ``judged`` is given) is at most ``limit``."""
    ratio = ratio_of(ours, ref) if ratio is None else ratio
    figure = ratio if judged is None else judged
    entry: dict[str, Any] = {"id": id_, "what": what, "ours": ours, "vs": vs, "unit": unit}
    entry["floor" if "floor" in vs else "upstream"] = ref
    entry.update(ratio=ratio, bound=bound or f"<= {limit:g}", met=figure is not None and figure <= limit)
    return entry


def has(r: Any, *path: str) -> bool:
    """True when ``r[p0][p1]...`` exists."""
    for key in path:
        if not isinstance(r, dict) or key not in r:
            return False
        r = r[key]
    return True


def _mode(modes: list[dict[str, Any]], label: str) -> dict[str, Any]:
    return next(m for m in modes if m["label"] == label)


def _f_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """f8 .. f4096 (mean ``schedule()`` per step at each size) and f-delay (answer p50, every size)."""
    lengths = {length["blocks"]: length for length in r["f"]["lengths"]}
    out = []
    delays = []
    for blocks in F_SIZES:
        if blocks not in lengths:
            continue
        modes = lengths[blocks]["modes"]
        ours, up = modes["ours async"], modes["upstream async"]
        out.append(target(f"f{blocks}", f"{blocks}-block prompts through vLLM's scheduler, both async: mean "
                                        "schedule() time per step, ours / upstream",
                          ours["schedule_us"]["mean"], up["schedule_us"]["mean"], vs="upstream", unit="us",
                          limit=1.0))
        delays.append((blocks, ours["answer_delay_us"].get("p50"), up["answer_delay_us"].get("p50")))
    if delays:
        sizes = [{"blocks": b, "ours_ms": o / 1e3 if o is not None else None,
                  "upstream_ms": u / 1e3 if u is not None else None, "ratio": ratio_of(o, u)} for b, o, u in delays]
        ratios = [s["ratio"] for s in sizes]
        worst = max(sizes, key=lambda s: s["ratio"] if s["ratio"] is not None else float("inf"))
        entry = target("f-delay", f"(f), every prompt size ({', '.join(str(b) for b, _, _ in delays)} blocks): "
                                  f"answer delay p50, ours / upstream, at the worst size ({worst['blocks']} blocks)",
                       worst["ours_ms"], worst["upstream_ms"], vs="upstream", unit="ms", limit=1.0,
                       ratio=None if None in ratios else max(r for r in ratios if r is not None),
                       bound="<= 1 at each size")
        entry["sizes"] = sizes
        out.append(entry)
    return out


def _a_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    a_ours = r["a"]["ours/pipelined"]
    a_up = r["a"].get("upstream")
    if a_up is not None:
        out.append(target("a", f"async scheduler-path cost per lookup, median, ours ({PRODUCTION_TELEMETRY}) / "
                               "upstream", a_ours["async_per_lookup_us"]["p50"], a_up["async_per_lookup_us"]["p50"],
                          vs="upstream", unit="us", limit=1.5))
    if has(r, "a4", "clients", "upstream", str(A4_K)) and has(r, "a4", "clients", "ours/pipelined", str(A4_K)):
        a4 = r["a4"]["clients"]
        out.append(target("a4", f"{A4_K} lookups arriving in one step: cost per lookup, median, ours (production "
                                "telemetry) / upstream", a4["ours/pipelined"][str(A4_K)]["per_lookup_us"]["p50"],
                          a4["upstream"][str(A4_K)]["per_lookup_us"]["p50"], vs="upstream", unit="us", limit=0.7))
    if a_up is not None:
        out.append(target("a2", "blocking lookup p50, ours / upstream", a_ours["sync_call_us"]["p50"],
                          a_up["sync_call_us"]["p50"], vs="upstream", unit="us", limit=1.05))
    return out


def _c_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """c1; and c2 when the run measured the round-trip floor (within scenario a)."""
    modes = r["c"]["modes"]
    auto, up_async = _mode(modes, AUTO), _mode(modes, "upstream async")
    out = [target("c1", "lookup_wait_us auto: mean deferred steps per request (upstream async beside it)",
                  auto["mean_deferred_steps"], up_async["mean_deferred_steps"], vs="upstream", unit="steps",
                  limit=0.2, judged=auto["mean_deferred_steps"], bound="ours <= 0.2 steps")]
    if has(r, "floors", "round_trip_us"):
        out.append(target("c2", "lookup_wait_us auto: p99 of one scheduler call / the round-trip floor's p99",
                          auto["call_us"]["p99"], r["floors"]["round_trip_us"]["p99"], vs="round-trip floor",
                          unit="us", limit=1.5))
    return out


def _d_target(r: dict[str, Any]) -> dict[str, Any]:
    d = r["d"]
    return target("d", f"telemetry as deployed (vLLM's stats collector, spans sampled as the chart samples): added "
                       f"to the mean schedule() time per step of (f) at {d['blocks']} blocks, ours async, each "
                       "variant in processes of its own (reference: no telemetry)",
                  d["deployed_schedule_us"]["mean"], d["off_schedule_us"]["mean"], vs="telemetry off", unit="us",
                  limit=0.05, ratio=1.0 + d["added"], judged=d["added"], bound="<= 5% added")


def _e_target(r: dict[str, Any]) -> dict[str, Any]:
    e = r["e"]["stopped"]
    ours_block = max(e[n]["blocked_s"] or float("inf") for n in ("ours/pipelined", "ours/upstream-wire"))
    up = e["upstream"]
    up_block = up["blocked_s"] if up.get("blocked_s") is not None else up["still_blocked_after_s"]
    deadline_s = e["ours/pipelined"]["deadline_ms"] / 1e3
    entry = target("e", f"store stopped: longest blocking call / the deadline ({deadline_s * 1e3:g} ms); upstream "
                        "blocks beside it", ours_block * 1e3, up_block * 1e3,
                   vs="upstream blocked; ratio to the deadline", unit="ms", limit=1.05,
                   ratio=ours_block / deadline_s, bound="ours <= deadline + 5%, upstream blocks")
    entry["met"] = entry["met"] and (up.get("blocked_s") is None or up["blocked_s"] > deadline_s)
    entry["deadline_ms"] = deadline_s * 1e3
    return entry


def _g_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """The prefix cache's two targets, judged on the prefix index's runs; vLLM's key layout's figures beside."""
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

    g1 = target("g1", f"multi-turn ({first['context_blocks']}-block context, {first['turns']} turns of "
                      f"{first['blocks_per_turn']} blocks): store keys sent per lookup from the second turn on, "
                      "ours / upstream (counted at the store client)", keys(multi_turn.INDEX, "ours"),
                keys(multi_turn.INDEX, "upstream"), vs="upstream", unit="keys", limit=0.1)
    beside(g1, keys, 0.1)
    g2 = target("g2", f"multi-turn, {long_shape['context_blocks']}-block context: time to answer (sync lookup path, "
                      "p50, from the second turn on), ours / upstream", answer(multi_turn.INDEX, "ours"),
                answer(multi_turn.INDEX, "upstream"), vs="upstream", unit="us", limit=0.2)
    beside(g2, answer, 0.2)
    path = {client: later(multi_turn.INDEX, longest, f"{client} async")["path_us"].get("p50")
            for client in ("ours", "upstream")}
    g2["scheduler_path_us"] = {**path, "ratio": ratio_of(path["ours"], path["upstream"])}
    return [g1, g2]


def _f_load_target(r: dict[str, Any]) -> dict[str, Any]:
    load = r["f_load"]
    ours, up = load["modes"]["ours async"], load["modes"]["upstream async"]
    entry = target("f-load", f"(f) under load, {load['blocks']}-block prompts, {load['arrivals_per_step']} arrivals "
                             "a step (upstream's one executor thread falls behind): answer delay in steps (mean), "
                             "ours / upstream; schedule() beside", ours["mean_deferred_steps"],
                   up["mean_deferred_steps"], vs="upstream", unit="steps", limit=0.5)
    entry["schedule_us"] = {"ours": ours["schedule_us"].get("mean"), "upstream": up["schedule_us"].get("mean"),
                            "ratio": ratio_of(ours["schedule_us"].get("mean"), up["schedule_us"].get("mean"))}
    entry["answer_ms"] = {"ours": (ours["answer_delay_us"].get("p50") or 0) / 1e3,
                          "upstream": (up["answer_delay_us"].get("p50") or 0) / 1e3}
    return entry


E_ASYNC_MS = 10.0  # an async poll with the store stopped: a socket check, never a wait (a loaded host's hiccup allowed)
J_NO_ANSWER = 0.005  # share of lookups that may end without the store's answer under contention alone
J_HIT_TOKENS = 0.99  # hit tokens kept, against the same run with no deadline


def _j_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Per contention and mode: lookups without the store's answer <= 0.5%; hit tokens >= 0.99x no deadline."""
    out = []
    n = 1
    for cond in ("cpu hogs", "gil loop"):
        variants = {v["label"]: v for v in r["j"]["conditions"].get(cond, {}).get("variants", [])}
        for mode in ("async", "sync"):
            ours, ref, up = (variants.get(f"ours {mode}"), variants.get(f"ours {mode}, no deadline"),
                             variants.get(f"upstream {mode}"))
            if ours is None or ref is None:
                n += 2
                continue
            deadline = f"lookup_timeout_ms auto ({ours['timeout_ms']:g} ms), the breaker's defaults"
            pct = None if ours["failed_share"] is None else 100 * ours["failed_share"]
            entry = target(f"j{n}", f"{cond}, {mode}, {deadline}: lookups ended without the store's answer "
                                    "(timeout + breaker_open + error), % of lookups", pct, None,
                           vs="a bound", unit="%", limit=100 * J_NO_ANSWER, judged=pct, ratio=ours["failed_share"],
                           bound=f"<= {J_NO_ANSWER:.1%}")
            entry["failed"], entry["lookups"], entry["breaker_opened"] = (ours["failed"], ours["lookups"],
                                                                          ours["breaker_opened"])
            hits = ratio_of(ours["hit_tokens"], ref["hit_tokens"])
            hit_entry = target(f"j{n + 1}", f"{cond}, {mode}: hit tokens, ours at its defaults / the same run with "
                                            "no deadline (60 s, breaker off); upstream's client beside",
                               ours["hit_tokens"], ref["hit_tokens"], vs="no deadline", unit="tokens",
                               limit=-J_HIT_TOKENS,
                               ratio=hits, judged=None if hits is None else -hits, bound=f">= {J_HIT_TOKENS:g}")
            hit_entry["upstream_hit_tokens"] = None if up is None else up["hit_tokens"]
            out += [entry, hit_entry]
            n += 2
    return out


def _h_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    from mooncake_lookout.connector.bench.fleet_workloads import MULTI_TURN, SHARED_PREFIX

    summary = r["h"]["summary"]
    out = []
    for id_, kind, limit in (("h1", MULTI_TURN, 0.2), ("h2", SHARED_PREFIX, 1.0)):
        if kind not in summary:
            continue
        s = summary[kind]
        out.append(target(id_, f"a fleet on one master ({kind}, N = {', '.join(str(n) for n in r['h']['ns'])} "
                               "engines, all phases together): the master's CPU per 1,000 lookups, net of its idle "
                               "rate, ours / upstream", s["ours"]["master_per_1000_ms"],
                          s["upstream"]["master_per_1000_ms"], vs="upstream", unit="ms", limit=limit))
    return out


def _i_targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """i1-i4: real engines, each of ours / the upstream engine of its wave; each judged at its worst pair."""
    pairs = {f"{o['label']} / {w['upstream']['label']}": {"ours": o, "upstream": w["upstream"]}
             for w in r["i"]["waves"] for o in w["ours"]}
    where = "real vllm serve engines on CPU, both workloads over HTTP, in turns"
    out = []
    for id_, what, figure, unit, at_least in (
            ("i1", "prompt tokens served from the store", lambda e: e["hit_tokens"], "tokens", 0.99),
            ("i2", "time to first token p50", lambda e: e["ttft_ms"]["p50"], "ms", None),
            ("i3", "time to first token p99", lambda e: e["ttft_ms"]["p99"], "ms", None),
            ("i4", "time inside lookup calls on vLLM's engine-core thread per step", lambda e: e["lookup_us_per_step"],
             "us", None)):
        each = [{"pair": name, "ours": figure(p["ours"]), "upstream": figure(p["upstream"]),
                 "ratio": ratio_of(figure(p["ours"]), figure(p["upstream"]))} for name, p in pairs.items()]
        ratios = [e["ratio"] for e in each]
        known = [x for x in ratios if x is not None]
        worst_ratio = None if None in ratios else (min(known) if at_least else max(known))
        worst = next(e for e in each if e["ratio"] == worst_ratio) if worst_ratio is not None else each[0]
        entry = target(id_, f"{where}: {what}, ours / upstream, at the worst pair ({worst['pair']})", worst["ours"],
                       worst["upstream"], vs="upstream", unit=unit, limit=1.0, ratio=worst_ratio,
                       bound=f">= {at_least:g} in each pair" if at_least else "<= 1 in each pair")
        if at_least:
            entry["met"] = worst_ratio is not None and worst_ratio >= at_least
        entry["pairs"] = each
        twins = r["i"].get("twins")
        if twins:  # identical engines of one run: how far apart nothing but chance puts them
            figures = [figure(e) for e in twins]
            spread = ratio_of(max(figures), min(figures)) if None not in figures else None
            entry["same_engines"] = {"engines": [e["label"] for e in twins], "figures": figures, "spread": spread}
        if id_ == "i4":  # the same time per request served: steps differ between engines (how vLLM loops)
            entry["per_request"] = [{"pair": name, "ours": p["ours"].get("lookup_us_per_request"),
                                     "upstream": p["upstream"].get("lookup_us_per_request"),
                                     "ratio": ratio_of(p["ours"].get("lookup_us_per_request"),
                                                       p["upstream"].get("lookup_us_per_request"))}
                                    for name, p in pairs.items()]
        out.append(entry)
    return out


def targets(r: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of :data:`TARGET_IDS` the run measured, in that order: figures, ratio, bound, met."""
    found: list[dict[str, Any]] = []
    if has(r, "f", "lengths"):
        found += _f_targets(r)
    if has(r, "a", "ours/pipelined"):
        found += _a_targets(r)
    if has(r, "b", "upstream") and has(r, "b", "ours/pipelined"):
        b = r["b"]
        found.append(target("b", f"burst of {b['n']}: time to all answers, ours pipelined / upstream",
                            b["ours/pipelined"]["seconds"] * 1e3, b["upstream"]["seconds"] * 1e3, vs="upstream",
                            unit="ms", limit=0.2))
    if has(r, "c", "modes"):
        found += _c_targets(r)
    if has(r, "d", "added"):
        found.append(_d_target(r))
    if has(r, "e", "stopped"):
        found.append(_e_target(r))
    if has(r, "e", "stopped_async"):
        a = r["e"]["stopped_async"]
        found.append(target("e-async", f"store stopped, ours async at its default deadline ({a['deadline_ms']:g} ms): "
                                       "the longest poll of the scheduler's (async never blocks)", a["longest_call_ms"],
                            None, vs="a bound", unit="ms", limit=E_ASYNC_MS, ratio=None, judged=a["longest_call_ms"],
                            bound=f"<= {E_ASYNC_MS:g} ms"))
    if has(r, "g", "backends", multi_turn.INDEX):
        found += _g_targets(r)
    if has(r, "f_load", "modes"):
        found.append(_f_load_target(r))
    if has(r, "j", "conditions"):
        found += _j_targets(r)
    if has(r, "h", "summary"):
        found += _h_targets(r)
    if has(r, "i", "waves"):
        found += _i_targets(r)
    order = {id_: i for i, id_ in enumerate(TARGET_IDS)}
    return sorted(found, key=lambda t: order[t["id"]])


__all__ = ["A4_K", "AUTO", "F_SIZES", "PRODUCTION_TELEMETRY", "TARGET_IDS", "has", "target", "targets"]
