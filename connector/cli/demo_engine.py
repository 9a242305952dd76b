"""``mooncake-lookout demo --engine``: the lookup path inside real ``vllm serve`` engines on CPU, ours vs upstream's.

What it does: starts a Mooncake master on 127.0.0.1 and makes a tiny model (no download); then one real CPU
engine per mode (the OpenAI server of vLLM's CPU build, in the engine venv that ``scripts/demo.sh --engine``
installs): upstream's ``MooncakeStoreConnector`` blocking (``upstream sync``) and async (``upstream async``), and
this project's connector blocking, async and async with the wait budget ``auto``, each named by its plugin name
and keeping its keys apart (``cache_prefix``). At most three engines live at once (about 3.2 GB each): they
start in parallel in two waves. Each engine is warmed (every shared prefix sent once, so the store holds it),
then serves a shared-prefix workload over HTTP from several concurrent clients (streaming completions, greedy,
fixed seed) for its share of ``--duration``. vLLM's own prefix cache is off, so each shared prefix is served
from the store. The table gives, per connector and mode, what the engine's own ``/metrics`` counted during
the measured load: requests, time to first token, prompt tokens served from the store, lookups by outcome and
deferrals; and where that ``/metrics`` was.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from mooncake_lookout.connector.bench.http_load import (
    LoadResult,
    by_label,
    delta,
    run_load,
    scrape,
    shared_prefix_jobs,
    total,
)
from mooncake_lookout.connector.rigs.engine_specs import BLOCK_SIZE, LOOKOUT, UPSTREAM, EngineSpec, build, make_model

MAX_ALIVE = 3  # engines alive at once: ~3.2 GB each
CLIENTS = 4
PREFIXES = 4
PREFIX_BLOCKS = 4  # 128 tokens of shared prefix
OWN_TOKENS = 40  # then a block and a bit of the request's own
MAX_TOKENS = 8
SEED = 0
MAX_RATE = 200  # requests a second the jobs made for a load suffice for (a tiny model on 2 cores: tens)
HITS = "vllm:external_prefix_cache_hits_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
OURS_LOOKUPS = "vllm:mooncake_lookup_requests_total"
OURS_DEFERRALS = "vllm:mooncake_lookup_deferrals_total"
SUCCESS = "vllm:request_success_total"


def engine_specs(names: list[str], modes: dict[str, tuple[bool, dict[str, Any]]], label: Any) -> list[EngineSpec]:
    """One engine per demo mode name (``upstream-sync`` ... ``auto``), each with a store namespace of its own."""
    specs = []
    for name in names:
        ours, config = modes[name]
        specs.append(EngineSpec(label(name), LOOKOUT if ours else UPSTREAM, dict(config)))
    return specs


def waves(specs: list[EngineSpec], size: int = MAX_ALIVE) -> list[list[EngineSpec]]:
    """The specs in groups of at most ``size``, upstream's beside ours: [up sync, up async, ours sync], [rest]."""
    return [specs[i:i + size] for i in range(0, len(specs), size)]


@dataclass
class ModeRun:
    """One engine's measured load and the deltas of its ``/metrics`` over it."""

    spec: EngineSpec
    metrics_url: str
    ready_s: float
    load: LoadResult
    counts: dict[str, float] = field(default_factory=dict)

    def hits(self) -> float | None:
        """Prompt tokens served from the store (vLLM's own counter)."""
        return total(self.counts, HITS)

    def lookups(self) -> dict[str, float] | None:
        """Lookups by outcome (ours); None for upstream's client, which counts none (its ``mooncake_store_operation``
        families count the worker's saves and loads only)."""
        return by_label(self.counts, OURS_LOOKUPS, "outcome") if self.spec.ours else None

    def deferrals(self) -> float | None:
        """Times the scheduler was told to ask again later (ours counts them; upstream's does not)."""
        return total(self.counts, OURS_DEFERRALS) if self.spec.ours else None


def measure(engine: Any, spec: EngineSpec, seconds: float, *, clients: int = CLIENTS, seed: int = SEED) -> ModeRun:
    """Warm ``engine`` (each prefix once), then load it for ``seconds``; its counters' deltas over the load."""
    warm = shared_prefix_jobs(PREFIXES, prefixes=PREFIXES, prefix_tokens=PREFIX_BLOCKS * BLOCK_SIZE,
                              own_tokens=OWN_TOKENS, seed=seed)
    run_load(engine.url, warm, clients=1, max_tokens=MAX_TOKENS)
    jobs = shared_prefix_jobs(max(64, int(seconds * MAX_RATE)), prefixes=PREFIXES,
                              prefix_tokens=PREFIX_BLOCKS * BLOCK_SIZE, own_tokens=OWN_TOKENS, seed=seed + 1)
    jobs = [[warm[i % PREFIXES][0][:PREFIX_BLOCKS * BLOCK_SIZE] + job[0][PREFIX_BLOCKS * BLOCK_SIZE:]]
            for i, job in enumerate(jobs)]  # the warmed prefixes, each request's tail its own
    before = settled(engine.url, None)
    load = run_load(engine.url, jobs, clients=clients, max_tokens=MAX_TOKENS, seconds=seconds)
    after = settled(engine.url, (before, load.requests))
    return ModeRun(spec, f"{engine.url}/metrics", engine.start_seconds or 0.0, load, delta(after, before))


def settled(url: str, expect: tuple[dict[str, float], int] | None, timeout_s: float = 15.0) -> dict[str, float]:
    """A scrape of ``url`` once vLLM's stats have caught up: every request of the load counted as finished."""
    deadline = time.monotonic() + timeout_s
    while True:
        page = scrape(url)
        if expect is None:
            return page
        before, requests = expect
        done = (total(page, SUCCESS) or 0.0) - (total(before, SUCCESS) or 0.0)
        if done >= requests or time.monotonic() > deadline:
            return page
        time.sleep(0.2)


def run_waves(model: Path, master_address: str, specs: list[EngineSpec], seconds_each: float, say: Any,
              stop: threading.Event) -> list[ModeRun]:
    """Start each wave's engines in parallel, measure them one after another, stop them; every run measured."""
    from mooncake_lookout.connector.rigs.engine import start_all, stop_all

    runs: list[ModeRun] = []
    for wave in waves(specs):
        if stop.is_set():
            break
        engines = [build(spec, model, master_address, f"demo-{spec.slug}") for spec in wave]
        try:
            t0 = time.perf_counter()
            say(f"starting {len(engines)} engines at once ({', '.join(s.label for s in wave)}) ...")
            start_all(engines)
            say(f"  ready in {time.perf_counter() - t0:.0f} s: " + ", ".join(
                f"{s.label} pid {e.pid} {e.url}/metrics" for s, e in zip(wave, engines)))
            for spec, engine in zip(wave, engines):
                if stop.is_set():
                    break
                runs.append(measure(engine, spec, seconds_each))
                say(f"  [{spec.label:15}] {runs[-1].load.requests} requests in {runs[-1].load.seconds:.1f} s")
        finally:
            stop_all(engines, remove=True)
    return runs


def run_engine_demo(args: Any, out: TextIO, stop: threading.Event, checkout: Path) -> int:
    """The ``--engine`` demo (module doc); returns the exit code as ``demo`` does."""
    from mooncake_lookout.connector.cli.demo import DEFAULT_MODES, MODES, mode_label
    from mooncake_lookout.connector.cli.demo_engine_table import format_engine_table
    from mooncake_lookout.connector.rigs.master import MOONCAKE_LEASE_MS, EmbeddedMaster, MasterError

    def say(text: str) -> None:
        out.write(text + "\n")
        out.flush()

    names = list(DEFAULT_MODES) if args.mode == "all" else [args.mode]
    if "budget" in names:
        say("mooncake-lookout demo: --engine runs upstream-sync, upstream-async, sync, async or auto")
        return 2
    from mooncake_lookout.connector.rigs.engine import engine_python

    if args.keep_running:
        say("--keep-running does not apply to --engine: each engine stops once its mode is measured")
    t_start = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="lookout-engine-demo-"))
    try:
        try:
            say(f"engine python: {engine_python(checkout)}; making a tiny model (no download) ...")
            model = make_model(workdir / "model")
            master = EmbeddedMaster(kv_lease_ttl_ms=MOONCAKE_LEASE_MS).start()
        except (RuntimeError, MasterError) as exc:
            say(f"mooncake-lookout demo: {exc}")
            return 2
        try:
            say(f"Mooncake master pid {master.pid} on {master.rpc_address} (its metrics: {master.metrics_url}/metrics)")
            say(f"workload: {PREFIXES} shared prefixes of {PREFIX_BLOCKS} blocks of {BLOCK_SIZE} tokens, each "
                f"request's last {OWN_TOKENS} tokens its own; {CLIENTS} concurrent clients, streaming completions of "
                f"{MAX_TOKENS} tokens, greedy; vLLM's own prefix cache off (each shared prefix comes from the store)")
            specs = engine_specs(names, MODES, lambda name: mode_label(name, 0))
            runs = run_waves(model, master.rpc_address, specs, args.duration / len(specs), say, stop)
        except (RuntimeError, TimeoutError) as exc:
            say(f"mooncake-lookout demo: {exc}")
            return 2
        finally:
            master.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if runs:
        say("")
        say(format_engine_table(runs))
    say(f"the whole demo took {time.perf_counter() - t_start:.0f} s")
    if stop.is_set():
        say("interrupted; every process stopped")
        return 130
    return 0


__all__ = ["CLIENTS", "MAX_ALIVE", "ModeRun", "engine_specs", "measure", "run_engine_demo", "run_waves", "settled",
           "waves"]
