"""Rows of scenarios (a) and (a4) measured in a process of their own: ours with no telemetry, ours with every span.

Why: timed in the bench's process, a client with no telemetry shares the GIL and the cores with the other
clients' telemetry threads (the span exporter, the batch processors), which keep working while it is timed;
and a client recording every span would load the others' timings with its own thread. Each such row runs here,
in a fresh child process (:class:`~.child.JsonChild`) against the same lookup server process and the same
requests, once the main rotation is over: the same code as the main rotation (:func:`.call.run`,
:func:`.per_step.run`) with the row's wiring (:mod:`.wiring`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.bench.rig import ClientMaker
from mooncake_lookout.connector.bench.wiring import ALWAYS_ON, NONE, label
from mooncake_lookout.connector.rigs.workload import shared_prefix_workload
from mooncake_lookout.connector.transport.names import PIPELINED, UPSTREAM

MODULE = "mooncake_lookout.connector.bench.solo"
CLIENT = "ours/pipelined"
WIRINGS = (NONE, ALWAYS_ON)  # the rows measured here, each in a process of its own


class Servers(ClientMaker):
    """The lookup server process's addresses, as a child sees them (ours only: vLLM's client is not built here)."""

    def __init__(self, addresses: dict[str, str]) -> None:
        self._addresses = addresses

    @property
    def addresses(self) -> dict[str, str]:
        return dict(self._addresses)


def requests_of(spec: dict[str, Any]) -> list[Any]:
    """The scenario's requests, made again from their arguments (the same bytes as the parent's)."""
    return shared_prefix_workload(spec["n"], num_prefixes=spec["num_prefixes"], seed=spec["seed"])


def run_rows(rig: Any, request_spec: dict[str, Any], *, a_step_s: float = 0.001, a_block: int = 25,
             ks: Sequence[int], a4_rounds: int, timeout_s: float = 900.0) -> dict[str, dict[str, Any]]:
    """For each wiring of :data:`WIRINGS`, a fresh child runs (a) and (a4) for :data:`CLIENT`; returns
    ``{"a": {row: figures}, "a4": {row: figures}}``."""
    from mooncake_lookout.connector.bench.child import JsonChild

    addresses = {t: rig.addresses[t] for t in (PIPELINED, UPSTREAM) if t in rig.addresses}
    args = [f"--{t}={a}" for t, a in addresses.items()]
    out: dict[str, dict[str, Any]] = {"a": {}, "a4": {}}
    for wiring in WIRINGS:
        with JsonChild(MODULE, args, name=f"solo ({wiring})") as child:
            a = child.ask({"scenario": "a", "wiring": wiring, "requests": request_spec, "step_s": a_step_s,
                           "block": a_block}, timeout_s)
            a4 = child.ask({"scenario": "a4", "wiring": wiring, "requests": request_spec, "ks": list(ks),
                            "rounds": a4_rounds}, timeout_s)
        row = label(CLIENT, wiring)
        out["a"][row] = a[row]
        out["a4"][row] = a4["clients"][row]
    return out


def _handle(servers: Servers, command: dict[str, Any]) -> dict[str, Any]:
    from mooncake_lookout.connector.bench import call, per_step

    requests = requests_of(command["requests"])
    if command["scenario"] == "a":
        a = call.run(servers, requests, None, step_s=command["step_s"], block=command["block"], names=(CLIENT,),
                     wiring=command["wiring"])
        a.pop("raw")
        return a
    if command["scenario"] == "a4":
        return per_step.run(servers, requests, ks=command["ks"], rounds=command["rounds"], names=(CLIENT,),
                            wiring=command["wiring"])
    raise ValueError(f"unknown scenario {command['scenario']!r}: a or a4")


def main(argv: Sequence[str] | None = None) -> int:
    """The child: serve (a) and (a4) commands for our client against the servers named on the command line."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    p.add_argument(f"--{PIPELINED}", required=True, help="our lookup server's address")
    p.add_argument(f"--{UPSTREAM}", default=None, help="the upstream-wire server's address")
    args = p.parse_args(argv)
    from mooncake_lookout.connector.bench.child import serve

    addresses = {PIPELINED: getattr(args, PIPELINED)}
    if getattr(args, UPSTREAM):
        addresses[UPSTREAM] = getattr(args, UPSTREAM)
    servers = Servers(addresses)
    return serve(lambda command: _handle(servers, command))


__all__ = ["CLIENT", "MODULE", "Servers", "WIRINGS", "main", "requests_of", "run_rows"]

if __name__ == "__main__":
    sys.exit(main())
