"""Scenario (i): ours and upstream's connector inside real ``vllm serve`` engines on CPU, taking turns over HTTP.

Why: every other scenario drives vLLM's scheduler or the lookup path by hand. This one runs where users run
it: two engines (API server, engine core, worker) of vLLM's CPU build on one Mooncake master, one with upstream's
``MooncakeStoreConnector`` and one with ours, each with its own keys (``cache_prefix``), alive together. The same
requests go to each in turns (:func:`seats`: ABBA for two, a Williams design for three; the machine's speed
drifts over seconds and an engine's turn carries what the one before it left running, so neither connector gets
the quiet spells): first a shared-prefix workload (the prefixes warmed into the store,
then chunks of requests from several concurrent clients), then a multi-turn one (conversations whose every turn
extends the previous turn's prompt, one round of turns at a time). vLLM's own prefix cache is off, so every
reusable prefix is the store's to serve.

Per engine: the time to first token of every request (streamed completions), the prompt tokens served from the
store (vLLM's ``vllm:external_prefix_cache_hits_total``), ours' lookups by outcome, and the time vLLM's
engine-core thread spent inside the connector's lookup calls per scheduler step, measured the same way for both
by :mod:`~..rigs.engine_timing` (a ``sitecustomize`` on the engines' ``PYTHONPATH``, for this run only: it
times ``get_num_new_matched_tokens`` and ``on_new_request`` and counts ``schedule`` calls, changing nothing);
ours' own ``scheduler_blocked_seconds`` is kept beside it as a check. Waves (engines alive together, at most
three): both blocking (the defaults), then upstream's async beside ours async and ours with the wait budget
``auto``; each of ours is compared with the upstream engine of its wave. At full size a last wave runs three
identical engines (upstream's async, ``twins``): how far apart engines with nothing between them land in one run
is printed beside each ratio, the noise floor it is read against.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_lookout.connector.bench.http_load import (
    LoadResult,
    by_label,
    delta,
    multi_turn_jobs,
    run_load,
    scrape,
    shared_prefix_jobs,
    total,
)
from mooncake_lookout.connector.rigs import engine_timing
from mooncake_lookout.connector.rigs.engine_specs import BLOCK_SIZE, LOOKOUT, UPSTREAM, EngineSpec, build, make_model
from mooncake_lookout.metrics.catalogue import LATE_REPLIES, REQUESTS, RPC_SECONDS, SCHEDULER_BLOCKED_SECONDS

ENGINES: dict[str, EngineSpec] = {s.label: s for s in (
    EngineSpec("upstream sync", UPSTREAM, {"lookup_async": False}),
    EngineSpec("ours sync", LOOKOUT, {"lookup_async": False}),
    EngineSpec("upstream async", UPSTREAM, {"lookup_async": True}),
    EngineSpec("ours async", LOOKOUT, {"lookup_async": True}),
    EngineSpec("ours auto", LOOKOUT, {"lookup_async": True, "lookup_wait_us": "auto"}))}
HITS = "vllm:external_prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
SUCCESS = "vllm:request_success_total"
BLOCKED_SUM = SCHEDULER_BLOCKED_SECONDS.name + "_sum"
OURS_LOOKUPS = REQUESTS.sample_names[0]
RPC_BUCKET = RPC_SECONDS.sample_names[0]
LATE_REPLY_COUNT = LATE_REPLIES.sample_names[0]
SEED = 7


@dataclass(frozen=True)
class EngineSizes:
    """How much scenario (i) does: the waves of engines (upstream's first, the reference of ours in its wave; at
    most three alive), clients, and each workload's size."""

    waves: tuple[tuple[str, ...], ...]
    clients: int
    prefixes: int
    prefix_blocks: int
    own_tokens: int
    requests: int  # shared-prefix requests each engine serves (after the warm-up)
    chunk: int  # of them, sent in one turn
    conversations: int
    turns: int
    context_blocks: int
    turn_tokens: int
    max_tokens: int = 8
    # Identical engines (a label, how many) in a wave of their own, after the others: how far apart engines with
    # nothing between them land in one run, the noise floor the ratios are read against. None: no such wave.
    twins: tuple[str, int] | None = None


QUICK = EngineSizes((("upstream async", "ours auto"),), clients=3, prefixes=3, prefix_blocks=4, own_tokens=40,
                    requests=24, chunk=8, conversations=3, turns=3, context_blocks=4, turn_tokens=64)
FULL = EngineSizes((("upstream sync", "ours sync"), ("upstream async", "ours async", "ours auto")), clients=4,
                   prefixes=4, prefix_blocks=6, own_tokens=40, requests=192, chunk=16, conversations=6, turns=6,
                   context_blocks=4, turn_tokens=64, twins=("upstream async", 3))


class _Side:
    """One engine of a wave and what it measured, workload by workload."""

    def __init__(self, spec: EngineSpec, engine: Any, timing_dir: Path) -> None:
        self.spec, self.engine, self.timing_dir = spec, engine, timing_dir
        self.loads: dict[str, LoadResult] = {}
        self.counts: dict[str, dict[str, float]] = {}
        self.timing: dict[str, dict[str, float]] = {}
        self._page: dict[str, float] = {}
        self._times: dict[str, float] = {}
        self._requests = 0

    def mark(self) -> None:
        """Scrape now: the start of a workload's deltas."""
        self._page, self._times, self._requests = scrape(self.engine.url), engine_timing.read_totals(self.timing_dir), 0

    def add(self, name: str, load: LoadResult) -> None:
        """Count one turn's load into workload ``name``."""
        self.loads.setdefault(name, LoadResult()).merge(load)
        self._requests += load.requests

    def close(self, name: str, timeout_s: float = 15.0) -> None:
        """Scrape once vLLM's stats count every request of workload ``name``; keep the deltas."""
        deadline = time.monotonic() + timeout_s
        while True:
            page = scrape(self.engine.url)
            done = (total(page, SUCCESS) or 0.0) - (total(self._page, SUCCESS) or 0.0)
            if done >= self._requests or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        time.sleep(0.5)  # the timing hook writes every 0.2 s
        self.counts[name] = delta(page, self._page)
        after = engine_timing.read_totals(self.timing_dir)
        self.timing[name] = {k: v - self._times.get(k, 0.0) for k, v in after.items()}

    def result(self) -> dict[str, Any]:
        """This engine's figures, per workload and over both."""
        spec = self.spec
        out: dict[str, Any] = {"label": spec.label, "ours": spec.ours, "ready_s": self.engine.start_seconds,
                               "workloads": {}}
        every = LoadResult()
        sums = {"hit_tokens": 0.0, "prompt_tokens": 0.0, "lookup_s": 0.0, "steps": 0.0, "off_thread_s": 0.0,
                "exported_blocked_s": 0.0}
        for name, load in self.loads.items():
            counts, timing = self.counts[name], self.timing[name]
            w = {"requests": load.requests, "failures": load.failures[:3], "failed": len(load.failures),
                 "ttft_ms": {"p50": load.percentile_ms(50), "p99": load.percentile_ms(99)},
                 "hit_tokens": total(counts, HITS) or 0.0, "prompt_tokens": total(counts, PROMPT_TOKENS) or 0.0,
                 "lookup_s": timing.get("lookup_s", 0.0), "steps": timing.get("steps", 0.0),
                 "off_thread_s": timing.get("off_thread_s", 0.0),
                 "exported_blocked_s": total(counts, BLOCKED_SUM) or 0.0}
            if spec.ours:
                w["lookups"] = by_label(counts, OURS_LOOKUPS, "outcome")
            out["workloads"][name] = w
            every.merge(load)
            for k in sums:
                sums[k] += w[k]
        steps = sums["steps"] or None
        if spec.ours:
            out["round_trip"] = round_trips(list(self.counts.values()))
        out.update(requests=every.requests, failed=len(every.failures),
                   ttft_ms={"p50": every.percentile_ms(50), "p99": every.percentile_ms(99)},
                   hit_tokens=sums["hit_tokens"], prompt_tokens=sums["prompt_tokens"], steps=sums["steps"],
                   lookup_us_per_step=None if steps is None else 1e6 * sums["lookup_s"] / steps,
                   lookup_us_per_request=1e6 * sums["lookup_s"] / every.requests if every.requests else None,
                   off_thread_s=sums["off_thread_s"],
                   exported_blocked_us_per_step=(1e6 * sums["exported_blocked_s"] / steps
                                                 if spec.ours and steps else None))
        return out


def round_trips(pages: list[dict[str, float]]) -> dict[str, Any]:
    """Ours' lookup round trips (send to answer, or to the deadline) over ``pages`` (scrape deltas): the bucket
    bounds holding the median, the 99th percentile and the longest, in ms, and the late replies. What
    ``lookup_timeout_ms: auto`` is chosen from: a deadline below the longest answered round trip turns that
    hit into a recompute."""
    buckets: dict[float, float] = {}
    late = 0.0
    for page in pages:
        for le, count in by_label(page, RPC_BUCKET, "le").items():
            buckets[float(le)] = buckets.get(float(le), 0.0) + count
        late += total(page, LATE_REPLY_COUNT) or 0.0
    bounds = sorted(buckets)
    n = buckets.get(float("inf"), 0.0)

    def bound(share: float) -> float | None:
        want = share * n
        return next((1e3 * le for le in bounds if buckets[le] >= want), None) if n else None

    return {"lookups": n, "p50_le_ms": bound(0.5), "p99_le_ms": bound(0.99), "max_le_ms": bound(1.0),
            "late_replies": late}


def williams_rows(n: int) -> list[list[int]]:
    """A Williams design for ``n`` engines: orders in which every engine takes every seat, and follows every other
    engine, equally often (ABBA for two). Why: an engine's turn carries what the one before it left running (its
    saves, its freed memory); "forwards, then backwards" leaves the middle one of three always after another
    engine and never after itself (measured: its TTFT p50 1.2-1.5 times the others' where alone it matched)."""
    base, low, high = [0], 1, n - 1
    while len(base) < n:
        base.append(low)
        low += 1
        if len(base) < n:
            base.append(high)
            high -= 1
    rows = [[(seat + r) % n for seat in base] for r in range(n)]
    return rows + [row[::-1] for row in rows] if n % 2 else rows


def seats(n: int, k: int) -> list[int]:
    """The order the ``n`` engines of a wave take round ``k``: the rows of :func:`williams_rows` in turn (for two,
    A B, B A, A B, ...)."""
    rows = williams_rows(n)
    return rows[k % len(rows)]


def _turns(sides: list[_Side], name: str, rounds: list[list[list[list[int]]]], sizes: EngineSizes) -> None:
    """Each round of jobs to every engine of the wave, in turn (:func:`seats`)."""
    for side in sides:
        side.mark()
    for k, jobs in enumerate(rounds):
        for seat in seats(len(sides), k):
            sides[seat].add(name, run_load(sides[seat].engine.url, jobs, clients=sizes.clients,
                                           max_tokens=sizes.max_tokens))
    for side in sides:
        side.close(name)


def timing_env(folder: Path) -> dict[str, str]:
    """The environment that turns the lookup-timing hook on in an engine, writing to ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    return {"PYTHONPATH": str(engine_timing.FOLDER), engine_timing.ENV: str(folder)}


def measure_wave(engines: list[tuple[EngineSpec, Any, Path]], sizes: EngineSizes) -> dict[str, Any]:
    """Both workloads in turns on engines already serving (upstream's first), each started with
    :func:`timing_env` of its folder: each engine's figures. Keys apart per engine (``cache_prefix``) and vLLM's
    own prefix cache off make every reusable prefix the store's to serve (:func:`run_wave` starts them so)."""
    sides = [_Side(spec, engine, folder) for spec, engine, folder in engines]
    prefix_tokens = sizes.prefix_blocks * BLOCK_SIZE
    warm = shared_prefix_jobs(sizes.prefixes, prefixes=sizes.prefixes, prefix_tokens=prefix_tokens,
                              own_tokens=sizes.own_tokens, seed=SEED)
    for side in sides:
        run_load(side.engine.url, warm, clients=1, max_tokens=sizes.max_tokens)
    jobs = shared_prefix_jobs(sizes.requests, prefixes=sizes.prefixes, prefix_tokens=prefix_tokens,
                              own_tokens=sizes.own_tokens, seed=SEED + 1)
    jobs = [[warm[i % sizes.prefixes][0][:prefix_tokens] + job[0][prefix_tokens:]] for i, job in enumerate(jobs)]
    _turns(sides, "shared_prefix", [jobs[i:i + sizes.chunk] for i in range(0, len(jobs), sizes.chunk)], sizes)
    conversations = multi_turn_jobs(sizes.conversations, turns=sizes.turns,
                                    context_tokens=sizes.context_blocks * BLOCK_SIZE,
                                    turn_tokens=sizes.turn_tokens, seed=SEED + 2)
    rounds = [[[conv[k]] for conv in conversations] for k in range(sizes.turns)]
    _turns(sides, "multi_turn", rounds, sizes)
    upstream, *ours = (side.result() for side in sides)
    return {"upstream": upstream, "ours": ours}


def run_wave(specs: list[EngineSpec], sizes: EngineSizes, model: Path, master_address: str, workdir: Path,
             log: Callable[[str], None]) -> dict[str, Any]:
    """One wave (upstream's engine, then ours) started together, both workloads in turns; each engine's figures."""
    from mooncake_lookout.connector.rigs.engine import start_all, stop_all

    engines = []
    for spec in specs:
        folder = workdir / spec.slug
        engines.append((spec, build(spec, model, master_address, f"bench-{spec.slug}", env=timing_env(folder)),
                        folder))
    try:
        t0 = time.perf_counter()
        start_all([engine for _, engine, _ in engines])
        log(f"  (i) {', '.join(spec.label for spec in specs)}: ready in {time.perf_counter() - t0:.0f} s")
        return measure_wave(engines, sizes)
    finally:
        stop_all([engine for _, engine, _ in engines], remove=True)


def twin_specs(label: str, n: int) -> list[EngineSpec]:
    """``n`` engines of the same connector and settings as ``label``'s, told apart by a letter (keys apart too)."""
    spec = ENGINES[label]
    return [EngineSpec(f"{label} {chr(ord('A') + k)}", spec.connector, spec.extra) for k in range(n)]


def run(sizes: EngineSizes, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Scenario (i): a master, a tiny model, then each wave of ``sizes`` (engines of :data:`ENGINES`) and the
    twins' wave; the results."""
    from mooncake_lookout.connector.rigs.master import MOONCAKE_LEASE_MS, EmbeddedMaster

    workdir = Path(tempfile.mkdtemp(prefix="lookout-bench-i-"))
    try:
        model = make_model(workdir / "model")
        with EmbeddedMaster(kv_lease_ttl_ms=MOONCAKE_LEASE_MS) as master:
            master.start()
            waves = [run_wave([ENGINES[label] for label in labels], sizes, model, master.rpc_address,
                              workdir / f"wave-{n}", log) for n, labels in enumerate(sizes.waves)]
            twins = None
            if sizes.twins is not None:
                wave = run_wave(twin_specs(*sizes.twins), sizes, model, master.rpc_address, workdir / "twins", log)
                twins = [wave["upstream"], *wave["ours"]]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return summary(sizes, waves, twins)


def summary(sizes: EngineSizes, waves: list[dict[str, Any]],
            twins: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Scenario (i)'s results (what ``bench.json`` keeps under ``i``): the sizes, each wave's figures and the
    identical engines' (``twins``, when run)."""
    return {"clients": sizes.clients, "block_size": BLOCK_SIZE,
            "shared_prefix": {"prefixes": sizes.prefixes, "prefix_blocks": sizes.prefix_blocks,
                              "own_tokens": sizes.own_tokens, "requests": sizes.requests, "chunk": sizes.chunk},
            "multi_turn": {"conversations": sizes.conversations, "turns": sizes.turns,
                           "context_blocks": sizes.context_blocks, "turn_tokens": sizes.turn_tokens},
            "max_tokens": sizes.max_tokens, "waves": waves, **({"twins": twins} if twins else {})}


__all__ = ["ENGINES", "FULL", "QUICK", "EngineSizes", "measure_wave", "round_trips", "run", "run_wave", "seats",
           "summary", "timing_env", "twin_specs", "williams_rows"]
