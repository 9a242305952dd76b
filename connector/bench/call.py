"""Bench scenario (a): what one lookup call costs the scheduler's thread, upstream's client vs ours vs the floors.

Why: the scheduler calls the lookup path for every waiting request on every step; what that call
costs is paid by every request in the batch. Sync: the whole blocking round trip. Async: the first
call (submit) and the per-lookup total over the polls a scheduler makes once per model step until the
answer is there (ours: with the ``end_step`` the scheduler adapter calls once per step, timed too).
Our client runs wired as in production (:mod:`.wiring`: vLLM's stats collector inline, asked once per step,
and spans sampled as the Helm chart samples them); upstream's has no telemetry. Ours with every span recorded,
and ours with no telemetry, are rows of their own, each measured in a process of its own (:mod:`.solo`), so no
other client's telemetry thread runs while they are timed.

The floors (:mod:`.floors`) are measured in the same rotation: the round-trip floors (one lookup, over ZMQ and
over a kernel socket, in one turn; and one step of scenario (c): its arrivals' keys in one store call, after its
model step's pause) beside the blocking calls, the touch and split floors beside the async ones. Every client and
floor takes its turn on a small block of requests, in a rotating order, so drift on a shared machine hits all alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_lookout.connector.bench.floors import FloorServer, joined_frame
from mooncake_lookout.connector.bench.rig import ClientMaker, close_upstream_client, summary_us
from mooncake_lookout.connector.bench.sched import ARRIVALS_PER_STEP, MODEL_STEP_S
from mooncake_lookout.connector.bench.wiring import NONE, PRODUCTION, Wired, label
from mooncake_lookout.connector.rigs.workload import WorkloadRequest

CLIENTS = ("upstream", "ours/upstream-wire", "ours/pipelined")
OTHER_SOCKET_OF = "ours/pipelined"
OTHER_SOCKET = "the other socket"  # blocking on the I/O thread's socket, async on the caller's: a diagnosis
ROUND_TRIP_FLOOR = "round-trip floor"
SOCKET_FLOOR = "kernel-socket floor"  # measured in the round-trip floor's turn, on the same requests
TOUCH_FLOOR = "touch floor"
SPLIT_FLOOR = "split floor"
STEP_FLOOR = "step round-trip floor"


def make_client(rig: ClientMaker, name: str, wiring: str = PRODUCTION, *, socket: str | None = None,
                **config: Any) -> tuple[Any, Callable[[], None]]:
    """One of :data:`CLIENTS` and the function that closes it; ours with the telemetry of ``wiring``
    (:mod:`.wiring`), its transport as vLLM builds it for ``config`` (``lookup_async`` decides where the
    ``pipelined`` socket lives) unless ``socket`` says; upstream's with none (it has none)."""
    if name == "upstream":
        client = rig.upstream_client()
        return client, lambda: close_upstream_client(client)
    ours = rig.our_client(name.split("/")[1].replace("-wire", ""), (), socket=socket, **config)
    if wiring == NONE:
        return ours, ours.close
    wired = Wired(ours, wiring)
    return wired, wired.close


def _forget(client: Any, req_id: str) -> None:
    """What the scheduler does once an answer is used: ours keeps answers until discarded."""
    discard = getattr(client, "discard", None)
    if discard is not None and hasattr(client, "pending"):
        discard(req_id)


def time_sync(client: Any, requests: Sequence[WorkloadRequest], tag: str,
              hit_tokens: list[int] | None = None) -> list[float]:
    """Seconds of each blocking ``lookup`` call (and each answer's hit tokens into ``hit_tokens``)."""
    out = []
    for r in requests:
        req_id = f"{tag}-{r.req_id}"
        hashes = list(r.block_hashes)
        t0 = time.perf_counter()
        result = client.lookup(req_id, r.num_tokens, hashes, non_block=False)
        out.append(time.perf_counter() - t0)
        if hit_tokens is not None:
            hit_tokens.append(result.hit_length if result is not None else -1)
        _forget(client, req_id)
    return out


def time_async(client: Any, requests: Sequence[WorkloadRequest], tag: str, step_s: float,
               max_polls: int = 10_000) -> tuple[list[float], list[float], list[int]]:
    """Per lookup: the first call's seconds, all calls' seconds added up, and the polls it took.

    A client with ``end_step`` (ours) gets it after each poll, as the scheduler adapter calls it once
    per step; it is timed with the poll.
    """
    first, total, polls = [], [], []
    end_step = getattr(client, "end_step", None)
    for r in requests:
        req_id = f"{tag}-{r.req_id}"
        hashes = list(r.block_hashes)
        spent = 0.0
        for n in range(max_polls):
            t0 = time.perf_counter()
            result = client.lookup(req_id, r.num_tokens, hashes, non_block=True)
            if end_step is not None:
                end_step()
            dt = time.perf_counter() - t0
            if n == 0:
                first.append(dt)
            spent += dt
            if result is not None:
                break
            time.sleep(step_s)  # the model's step between two scheduler calls
        total.append(spent)
        polls.append(n)
        _forget(client, req_id)
    return first, total, polls


def step_frames(frames: Sequence[bytes], per_step: int = ARRIVALS_PER_STEP) -> list[bytes]:
    """The step round-trip floor's requests: ``frames`` taken ``per_step`` at a time (a short rest is left out), each
    group's keys in one frame."""
    return [joined_frame(frames[i:i + per_step]) for i in range(0, len(frames) - per_step + 1, per_step)]


def blocks(requests: Sequence[WorkloadRequest], size: int) -> list[Sequence[WorkloadRequest]]:
    """``requests`` cut into consecutive blocks of ``size`` (the last one may be shorter)."""
    return [requests[i:i + size] for i in range(0, len(requests), size)]


def run(rig: ClientMaker, requests: Sequence[WorkloadRequest], floor: FloorServer | None = None, *,
        step_s: float = 0.001, block: int = 25, names: Sequence[str] = CLIENTS,
        wiring: str = PRODUCTION) -> dict[str, Any]:
    """Scenario (a) for the clients ``names`` (ours wired as ``wiring``; rows named by :func:`.wiring.label`),
    and each floor with ``floor``; microseconds, raw seconds under ``raw``.

    The clients and floors take turns on blocks of ``block`` requests in a rotating order: all blocking
    calls first, then all asynchronous lookups.
    """
    out: dict[str, Any] = {"raw": {}}
    # As vLLM builds ours: for blocking lookups (lookup_async off) and for async ones (lookup_async on), each with
    # its own transport; OTHER_SOCKET rows swap where the pipelined socket lives (a diagnosis, not a target).
    clients = {label(name, wiring) if name != "upstream" else name: make_client(rig, name, wiring)
               for name in names}
    async_clients = {row: make_client(rig, name, wiring, lookup_async=True) if name != "upstream" else clients[row]
                     for row, name in zip(clients, names)}
    if OTHER_SOCKET_OF in names and wiring == PRODUCTION:
        row = f"{OTHER_SOCKET_OF}, {OTHER_SOCKET}"
        clients[row] = make_client(rig, OTHER_SOCKET_OF, wiring, socket="io")
        async_clients[row] = make_client(rig, OTHER_SOCKET_OF, wiring, lookup_async=True, socket="caller")
    frames = [rig.floor_frame(r) for r in requests] if floor is not None else []
    sync: dict[str, list[float]] = {name: [] for name in clients}
    first: dict[str, list[float]] = {name: [] for name in clients}
    total: dict[str, list[float]] = {name: [] for name in clients}
    polls: dict[str, list[int]] = {name: [] for name in clients}
    floors: dict[str, list[float]] = {ROUND_TRIP_FLOOR: [], SOCKET_FLOOR: [], STEP_FLOOR: [], TOUCH_FLOOR: [],
                                      SPLIT_FLOOR: []}
    try:
        for name, (client, _) in clients.items():
            time_sync(client, requests[:20], f"warm-{name}")
        if floor is not None:
            floor.round_trips(frames[:20])
            floor.socket_round_trips(frames[:20])
        rotation = [*clients, *([ROUND_TRIP_FLOOR, STEP_FLOOR] if floor is not None else [])]
        for i, chunk in enumerate(blocks(requests, block)):
            part = frames[i * block:i * block + len(chunk)]
            for k in range(len(rotation)):
                name = rotation[(i + k) % len(rotation)]
                if name == ROUND_TRIP_FLOOR:  # and the kernel-socket floor beside it, each first every other block
                    assert floor is not None
                    pair = ((ROUND_TRIP_FLOOR, floor.round_trips), (SOCKET_FLOOR, floor.socket_round_trips))
                    for which, measure in pair if i % 2 == 0 else pair[::-1]:
                        floors[which] += measure(part)
                elif name == STEP_FLOOR:
                    assert floor is not None
                    floors[name] += floor.round_trips(step_frames(part), pause_s=MODEL_STEP_S)
                else:
                    sync[name] += time_sync(clients[name][0], chunk, f"sync{i}")
        rotation = [*clients, *([TOUCH_FLOOR, SPLIT_FLOOR] if floor is not None else [])]
        for i, chunk in enumerate(blocks(requests, block)):
            for k in range(len(rotation)):
                name = rotation[(i + k) % len(rotation)]
                if name in (TOUCH_FLOOR, SPLIT_FLOOR):
                    assert floor is not None
                    measure = floor.touches if name == TOUCH_FLOOR else floor.splits
                    floors[name] += measure(frames[i * block:i * block + len(chunk)], step_s)
                else:
                    f, t, p = time_async(async_clients[name][0], chunk, f"async{i}", step_s)
                    first[name] += f
                    total[name] += t
                    polls[name] += p
    finally:
        for _, close in {id(c): (c, close) for c, close in [*clients.values(), *async_clients.values()]}.values():
            close()
    for name in clients:
        out[name] = {"sync_call_us": summary_us(sync[name]), "async_first_call_us": summary_us(first[name]),
                     "async_per_lookup_us": summary_us(total[name]),
                     "async_mean_polls": sum(polls[name]) / max(1, len(polls[name]))}
        out["raw"][name] = {"sync": sync[name], "async_first": first[name]}
    if floor is not None:
        out["floors"] = {"round_trip_us": summary_us(floors[ROUND_TRIP_FLOOR]),
                         "socket_round_trip_us": summary_us(floors[SOCKET_FLOOR]),
                         "step_round_trip_us": summary_us(floors[STEP_FLOOR]),
                         "touch_us": summary_us(floors[TOUCH_FLOOR]), "split_us": summary_us(floors[SPLIT_FLOOR])}
        out["raw"][ROUND_TRIP_FLOOR] = {"sync": floors[ROUND_TRIP_FLOOR]}
        out["raw"][TOUCH_FLOOR] = {"async_first": floors[TOUCH_FLOOR]}
    return out


__all__ = ["CLIENTS", "OTHER_SOCKET", "OTHER_SOCKET_OF", "ROUND_TRIP_FLOOR", "SOCKET_FLOOR", "SPLIT_FLOOR",
           "STEP_FLOOR", "TOUCH_FLOOR", "blocks", "make_client", "run", "step_frames", "time_async", "time_sync"]
