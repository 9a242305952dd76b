"""Bench scenario (a4): k lookups arriving in one scheduling step, cost per lookup on the scheduler's thread.

Why: scenario (a) has one lookup per step, so every lookup pays a whole send and a whole drain. In a
real step several requests arrive together, and our client sends a step's lookups in one frame and
drains replies once per step; upstream's submits each one to its executor and answers one at a time.
This shows what a lookup costs the scheduler's thread when k = 1, 4, 16 or 64 arrive in one step.

One round, as vLLM drives each client:

* ours: ``start(admission=True)`` for each of the k requests (``on_new_request``), then each is asked
  (``lookup(non_block=True)``) in that step, then ``end_step`` (``build_connector_meta``); on later
  steps the pending ones are asked again once per step, each step ending with ``end_step``; an answered
  request is discarded (allocated);
* upstream: ``lookup(non_block=True)`` for each of the k requests (the first call submits), then the
  pending ones are polled once per step.

Every call is timed; a lookup's cost is the round's total over k. Steps are ``step_s`` apart (the
model's step). The clients take turns round by round (order rotating); ours is wired as in production, like
scenario (a) (:mod:`.wiring`); its rows with every span and with no telemetry are measured in processes of
their own (:mod:`.solo`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mooncake_lookout.connector.bench.call import OTHER_SOCKET, OTHER_SOCKET_OF, make_client
from mooncake_lookout.connector.bench.rig import ClientMaker, summary_us
from mooncake_lookout.connector.bench.wiring import PRODUCTION, label
from mooncake_lookout.connector.rigs.workload import WorkloadRequest

KS = (1, 4, 16, 64)
CLIENTS = ("upstream", "ours/pipelined")


def ask_once(client: Any, ours: bool, pending: dict[str, tuple[int, list[bytes]]]) -> dict[str, Any]:
    """One step's asks, as vLLM's scheduler makes them: each pending lookup asked once (``non_block``), the answered
    ones taken out of ``pending`` (ours: discarded, as an allocated request is), then ours' ``end_step``; returns
    the answers by request id."""
    answered = {}
    for req_id, (n, hashes) in list(pending.items()):
        result = client.lookup(req_id, n, hashes, non_block=True)
        if result is not None:
            answered[req_id] = result
            del pending[req_id]
            if ours:
                client.discard(req_id)
    if ours:
        client.end_step()
    return answered


def one_round(client: Any, batch: Sequence[WorkloadRequest], tag: str, step_s: float, *,
              timeout_s: float = 30.0) -> tuple[float, int, int]:
    """One step's arrivals until all are answered: seconds on the caller's thread, steps taken, hit tokens."""
    ours = hasattr(client, "end_step")
    asks = [(f"{tag}-{r.req_id}", r.num_tokens, list(r.block_hashes)) for r in batch]
    pending = {req_id: (n, hashes) for req_id, n, hashes in asks}
    spent = 0.0
    steps = 0
    hit_tokens = 0
    end = time.perf_counter() + timeout_s
    t0 = time.perf_counter()
    if ours:
        for req_id, n, hashes in asks:
            client.start(req_id, n, hashes, admission=True)
    while True:
        hit_tokens += sum(result.hit_length for result in ask_once(client, ours, pending).values())
        spent += time.perf_counter() - t0
        steps += 1
        if not pending:
            return spent, steps, hit_tokens
        if time.perf_counter() > end:
            raise TimeoutError(f"{len(pending)} of {len(batch)} lookups unanswered after {timeout_s} s")
        time.sleep(step_s)  # the model's step
        t0 = time.perf_counter()


def run(rig: ClientMaker, requests: Sequence[WorkloadRequest], *, ks: Sequence[int] = KS, rounds: int = 20,
        step_s: float = 0.001, names: Sequence[str] = CLIENTS, wiring: str = PRODUCTION) -> dict[str, Any]:
    """Scenario (a4): ``rounds`` rounds per k and client of ``names`` (ours wired as ``wiring``, its rows named by
    :func:`.wiring.label`); per-lookup cost in microseconds."""
    pending = max(1024, 2 * max(ks))
    clients = {label(name, wiring): make_client(rig, name, wiring, max_pending=pending, lookup_async=True)
               if name != "upstream" else make_client(rig, name) for name in names}
    if OTHER_SOCKET_OF in names and wiring == PRODUCTION:  # async on the caller's socket: a diagnosis
        clients[f"{OTHER_SOCKET_OF}, {OTHER_SOCKET}"] = make_client(rig, OTHER_SOCKET_OF, wiring, max_pending=pending,
                                                                     lookup_async=True, socket="caller")
    per_lookup: dict[str, dict[int, list[float]]] = {name: {k: [] for k in ks} for name in clients}
    steps: dict[str, dict[int, list[int]]] = {name: {k: [] for k in ks} for name in clients}
    hits: dict[str, dict[int, int]] = {name: {k: 0 for k in ks} for name in clients}
    names = list(clients)
    at = 0
    try:
        for name, (client, _) in clients.items():
            one_round(client, requests[:4], f"warm-{name}", step_s)
        for k in ks:
            for i in range(rounds):
                batch = [requests[(at + j) % len(requests)] for j in range(k)]
                at += k
                for j in range(len(names)):
                    name = names[(i + j) % len(names)]
                    spent, n, hit = one_round(clients[name][0], batch, f"k{k}r{i}", step_s)
                    per_lookup[name][k].append(spent / k)
                    steps[name][k].append(n)
                    hits[name][k] += hit
    finally:
        for _, close in clients.values():
            close()
    out: dict[str, Any] = {"ks": list(ks), "rounds": rounds, "step_ms": step_s * 1e3, "clients": {}}
    for name in clients:
        out["clients"][name] = {
            str(k): {"per_lookup_us": summary_us(per_lookup[name][k]),
                     "mean_steps": sum(steps[name][k]) / len(steps[name][k]), "hit_tokens": hits[name][k]}
            for k in ks}
    return out


__all__ = ["CLIENTS", "KS", "ask_once", "one_round", "run"]
