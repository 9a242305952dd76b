"""Bench scenario (d): what telemetry, as deployed, adds to vLLM's ``schedule()`` time per step.

Why: telemetry that slows the path it watches gets turned off, and what it costs is paid in the scheduler's
step, not in one lookup. This runs scenario (f)'s 64-block run (:mod:`.long_prompts`: vLLM's real scheduler,
our connector async) twice over, each variant in a process of its own, so neither's threads run while the
other is timed:

* **deployed**: our connector as vLLM builds it, with the ``OTEL_*`` variables the Helm chart sets when tracing
  is on (its sampler, :data:`.wiring.CHART_SAMPLER`), spans exported over OTLP/HTTP to a local endpoint
  (:mod:`.otlp_sink`), vLLM's stats collector inline (vLLM takes its record every step);
* **off**: the same connector with no telemetry at all (switched off before the first request: no step log, no
  sampler, no spans; checked: vLLM got no stats record from it).

Each round starts one process of each variant, and the two take turns of :data:`~.turns.TURN_STEPS` steps
(:mod:`.turns`: ABBA order, who goes first alternating by round), so both are timed in the same spells of this
machine's drifting speed; each variant's steps are pooled over the rounds, and the figure is the mean
``schedule()`` time per step, deployed over off. A turn's mean still moves 10-30% from the other's (its
requests, the machine), so a process runs :data:`STEPS` steps (32 turns), 4x (f)'s: two pairs' ratios then
read 0.98-1.08 where 200-step processes one after another read up to 1.20. The parent fills the store for
the run's prompts before the first child starts (with vLLM's own block hashes).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.bench.long_prompts import Length
from mooncake_lookout.connector.bench.rig import summary_us
from mooncake_lookout.connector.bench.turns import TURN_STEPS, Turns, take_turns

MODULE = "mooncake_lookout.connector.bench.overhead"
VARIANTS = ("off", "deployed")
STEPS = 800  # (f)'s 64-block run has 200; 32 turns a process (see the module docstring)
LENGTH = Length(64, STEPS, 2)  # scenario (f)'s 64-block prompts and arrivals


def run(rig: Any, *, length: Length = LENGTH, rounds: int = 2, model_step_s: float = 0.0015,
        turn_steps: int = TURN_STEPS, timeout_s: float = 600.0) -> dict[str, Any]:
    """Scenario (d): ``rounds`` pairs of processes, one of each variant, taking turns against ``rig``'s server."""
    from mooncake_lookout.connector.bench.child import JsonChild
    from mooncake_lookout.connector.bench.otlp_sink import shared
    from mooncake_lookout.connector.bench.wiring import PRODUCTION, tracing_env
    from mooncake_lookout.connector.rigs.scheduler_driver import prompt_block_hashes
    from mooncake_lookout.connector.transport.names import PIPELINED

    length.workload().fill_store(rig, prompt_block_hashes)
    args = ["--server", rig.addresses[PIPELINED], "--rpc-port", str(rig.lookup_rpc_port)]
    command = {"blocks": length.blocks, "steps": length.steps, "arrivals_per_step": length.arrivals_per_step,
               "model_step_s": model_step_s, "turn_steps": turn_steps}
    sink = shared()
    per_process: list[dict[str, Any]] = []
    pooled: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        children = [JsonChild(MODULE, [*args, "--variant", v], name=f"telemetry {v}", wait=False,
                              env=tracing_env(PRODUCTION, sink.endpoint) if v == "deployed" else {}) for v in order]
        try:
            for child in children:
                child.wait_ready()
            results = take_turns(children, [command] * len(children), timeout_s)
        finally:
            for child in children:
                child.close()
        for result in results:
            pooled[result["variant"]] += result.pop("schedule_s")
            per_process.append(result)
    mean = {v: sum(pooled[v]) / len(pooled[v]) for v in VARIANTS}
    return {"blocks": length.blocks, "steps": length.steps, "arrivals_per_step": length.arrivals_per_step,
            "rounds": rounds, "turn_steps": turn_steps, "model_step_ms": model_step_s * 1e3,
            "processes": per_process, "deployed_schedule_us": summary_us(pooled["deployed"]),
            "off_schedule_us": summary_us(pooled["off"]), "added": mean["deployed"] / mean["off"] - 1.0,
            "span_posts": sink.posts}


class _Servers:
    """What :func:`~.sched.run_mode` needs of a rig, in a child: the scheduler's settings for our server."""

    def __init__(self, address: str, rpc_port: int) -> None:
        self.address = address
        self.rpc_port = rpc_port

    def scheduler_extra(self, ours: bool, transport: str, **config: Any) -> dict[str, Any]:
        return {"lookup_rpc_port": self.rpc_port, "load_async": False, "lookup_transport": transport,
                "lookup_server_address": self.address, **config}


class _Filled:
    """A length's prompts, the store already filled by the parent."""

    def __init__(self, length: Length) -> None:
        self.workload = length.workload()

    def fill_store(self, rig: Any, hash_of: Any) -> int:
        return 0

    def request(self, k: int) -> tuple[str, list[int]]:
        return self.workload.request(k)


class _Off:
    """No telemetry: vLLM's stats hook gets nothing, and the client keeps no step log."""

    tracer = None

    def take(self, flush: bool = False) -> None:
        return None

    def close(self) -> None:
        pass


def _switch_off(driver: Any) -> None:
    """No telemetry on our connector's client (checked after the run: vLLM got no stats record)."""
    adapter = driver.connector.connector_scheduler
    adapter.telemetry.close()
    adapter.telemetry = _Off()
    adapter.client.log = adapter.client.sampler = None


def _handle(servers: _Servers, variant: str, command: dict[str, Any]) -> dict[str, Any]:
    from mooncake_lookout.connector.bench import sched

    length = Length(command["blocks"], command["steps"], command["arrivals_per_step"])
    turns = Turns(command["turn_steps"])
    drivers: list[Any] = []

    def prepare(driver: Any) -> None:
        if variant == "off":
            _switch_off(driver)
        drivers.append(driver)
        turns.begin()

    run = sched.run_mode(servers, _Filled(length), sched.mode("ours async", True, lookup_async=True),  # type: ignore[arg-type]
                         arrivals_per_step=length.arrivals_per_step, steps=length.steps,
                         model_step_s=command["model_step_s"], num_blocks=length.num_blocks(),
                         max_model_len=length.max_model_len, drain_s=10.0, tally=False, prepare=prepare,
                         pace=turns.after_step, arrive_in_step=True)  # as (f) runs
    driver = drivers[0]
    adapter = driver.connector.connector_scheduler
    stats_records = len(driver.kv_connector_stats)
    if variant == "off" and stats_records:
        raise RuntimeError(f"telemetry off: vLLM still got {stats_records} stats records from our connector")
    if variant == "deployed" and (not stats_records or adapter.telemetry.tracer is None):
        raise RuntimeError("telemetry as deployed: no stats record reached vLLM, or tracing did not start")
    return {"variant": variant, "schedule_s": run.schedule_seconds, "schedule_us": summary_us(run.schedule_seconds),
            "requests": run.requests, "finished": run.finished, "stats_records": stats_records,
            "tracing": adapter.telemetry.tracer is not None, "turns": turns.turns}


def main(argv: Sequence[str] | None = None) -> int:
    """The child: run (f)'s 64-block run with our connector, telemetry as ``--variant`` says."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True, help="our lookup server's address")
    p.add_argument("--rpc-port", type=int, required=True, help="vLLM's lookup_rpc_port of the rig")
    p.add_argument("--variant", choices=VARIANTS, required=True)
    args = p.parse_args(argv)
    from mooncake_lookout.connector.bench.child import serve

    servers = _Servers(args.server, args.rpc_port)
    return serve(lambda command: _handle(servers, args.variant, command))


__all__ = ["LENGTH", "MODULE", "STEPS", "VARIANTS", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
