"""Bench scenario (g): multi-turn conversations through vLLM's real scheduler: what each turn asks the store.

Why: every turn of a conversation re-sends a prompt whose first thousands of blocks were found a moment
ago. Upstream's lookup asks the store for every block, every turn; ours remembers blocks found present
within the master's key lease (the prefix cache, ``connector/prefix_cache.py``) and asks only for the
rest. This runs :mod:`.conversations` through vLLM's V1 ``Scheduler`` (:class:`SchedulerDriver`, a 1.5 ms
made-up model step) with upstream's connector and ours, each blocking (sync) and async, and reports per
turn:

* **store keys per lookup**: counted in the lookup server's process around its store client
  (:class:`~mooncake_lookout.connector.rigs.counting_store.CountingStore`), read between turns: what
  really left for the master, our epoch marker key included;
* **time to answer**: sync mode's time inside the lookup path per request (admission and the blocking
  call: the scheduler waits for the answer);
* **scheduler-path cost per lookup**: async mode's time inside the lookup path per request (admission and
  every non-blocking call until the answer);
* arrival to answer in async mode, and ours' **known share** (blocks the cache knew of those that could
  count) and answers given with no round trip.

A turn of each conversation arrives one per step; the next turn comes once all are answered and their
prompts saved (:mod:`.conversations`), with no pause between turns: a conversation takes about a second,
well within ``lookup_answer_ttl_ms`` (a turn re-sent after that asks the store for every block again).
Every run has conversations of its own. Our server keeps the store's epoch (so the cache is on, as inside
vLLM) and the master's lease covers ``lookup_answer_ttl_ms``: both are checked, and a run of ours whose
cache knew nothing from the second turn on is an error, not a figure. With ``layout``, the same runs go
through vLLM's own key layout: both servers answer from upstream's ``MooncakeStoreWorker`` (ours through
``WorkerBackend``, as inside vLLM's worker).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from mooncake_lookout.connector.bench.conversations import (
    IndexSaver,
    LayoutSaver,
    Saver,
    Shape,
    conversation_tokens,
    turn_prompt,
)
from mooncake_lookout.connector.bench.rig import BLOCK_SIZE, Rig, close_upstream_client, next_lookup_port, summary_us
from mooncake_lookout.connector.bench.sched import Mode, mode
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import OutcomeCounter
from mooncake_lookout.connector.transport.names import PIPELINED, UPSTREAM

MODES = (mode("upstream sync", False, lookup_async=False), mode("ours sync", True, lookup_async=False),
         mode("upstream async", False, lookup_async=True), mode("ours async", True, lookup_async=True))
# The example (a 32k-token context, 20 turns of 256 tokens), then a 4,096-block context (64k tokens).
FULL = (Shape(2048, 20, 16, 4), Shape(4096, 8, 16, 2))
QUICK = (Shape(2048, 4, 16, 2), Shape(4096, 3, 16, 1))
INDEX, LAYOUT = "prefix index", "vLLM layout"
LAYOUT_MODEL = "bench-multi-turn"  # the model name vLLM's keys embed in the layout runs
ROUND_TIMEOUT_S = 60.0  # a turn of every conversation answered within this, or the run fails


@dataclass
class Endpoint:
    """One backend's servers: where each connector connects, whose store counts to read, how blocks are saved."""

    name: str
    upstream_rpc_port: int  # vLLM's lookup_rpc_port: upstream's client finds vLLM's server by it
    ours_address: str
    upstream_servers: Any  # the ServerProcess serving upstream's wire (its store counts)
    ours_servers: Any  # the ServerProcess serving ours
    saver: Saver

    def extra(self, m: Mode) -> dict[str, Any]:
        """``kv_connector_extra_config`` for a scheduler of mode ``m`` on this endpoint."""
        extra: dict[str, Any] = {"lookup_rpc_port": self.upstream_rpc_port, "load_async": False}
        if m.ours:
            extra.update(lookup_transport=PIPELINED, lookup_server_address=self.ours_address)
        extra.update(m.extra)
        return extra

    def counts(self, m: Mode) -> tuple[int, int]:
        """``(store calls, keys)`` the server answering mode ``m`` has sent to the store so far."""
        return (self.ours_servers if m.ours else self.upstream_servers).store_counts()


class PathProbe:
    """Times, per request, the scheduler's calls into a connector's lookup path: ``on_new_request`` (ours starts
    its lookup there) and every ``get_num_new_matched_tokens`` call (measuring wrappers around the real methods)."""

    def __init__(self, connector: Any) -> None:
        self.path_s: dict[str, float] = defaultdict(float)
        self.answered_at: dict[str, float] = {}
        new_request, matched = connector.on_new_request, connector.get_num_new_matched_tokens

        def on_new_request(request: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return new_request(request)
            finally:
                self.path_s[request.request_id] += time.perf_counter() - t0

        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
            t0 = time.perf_counter()
            result = matched(request, num_computed_tokens)
            t1 = time.perf_counter()
            self.path_s[request.request_id] += t1 - t0
            if result[0] is not None:
                self.answered_at.setdefault(request.request_id, t1)
            return result

        connector.on_new_request = on_new_request
        connector.get_num_new_matched_tokens = get_num_new_matched_tokens


def check_lease(rig: Rig) -> None:
    """The rule the prefix cache relies on: the master's lease at least twice ``lookup_answer_ttl_ms``."""
    ttl_ms = LookupConfig().lookup_answer_ttl_ms
    if rig.kv_lease_ttl_ms < 2 * ttl_ms:
        raise RuntimeError(f"scenario g: the rig's master leases keys for {rig.kv_lease_ttl_ms} ms, less than twice "
                           f"lookup_answer_ttl_ms ({ttl_ms:g} ms): a cached block could outlive its lease")


@contextmanager
def endpoints(rig: Rig, layout: bool) -> Iterator[list[Endpoint]]:
    """The prefix index's servers (the rig's for upstream; ours keeping the store's epoch) and, with ``layout``,
    a server process answering from upstream's worker in vLLM's key layout; stopped on exit."""
    from mooncake_lookout.connector.rigs.server_process import ServerProcess
    from mooncake_lookout.connector.rigs.vllm_layout import Layout, layout_worker

    with ExitStack() as stack:
        ours = rig.servers if rig.keep_epoch else stack.enter_context(ServerProcess(
            PIPELINED, rig.master.rpc_address, namespace=rig.namespace, block_size=BLOCK_SIZE, keep_epoch=True,
            store_rpc_timeout_ms=rig.rpc_timeout_ms, standby=False))
        out = [Endpoint(INDEX, rig.lookup_rpc_port, ours.addresses[PIPELINED], rig.servers, ours,
                        IndexSaver(rig.index))]
        if layout:
            shape = Layout(LAYOUT_MODEL, block_size=BLOCK_SIZE)
            port = next_lookup_port()
            servers = stack.enter_context(ServerProcess(
                (UPSTREAM, PIPELINED), rig.master.rpc_address, namespace=rig.namespace, block_size=BLOCK_SIZE,
                rpc_port=port, rpc_base_path=rig.rpc_base_path, store_rpc_timeout_ms=rig.rpc_timeout_ms,
                start_timeout_s=120.0, standby=False, layout=shape, keep_epoch=True))
            out.append(Endpoint(LAYOUT, port, servers.addresses[PIPELINED], servers, servers,
                                LayoutSaver(layout_worker(rig.writer, shape), rig.writer)))
        yield out


def run(rig: Rig, shapes: Sequence[Shape] = FULL, *, layout: bool = True,
        model_step_s: float = 0.0015) -> dict[str, Any]:
    """Scenario (g): per backend and shape, the four :data:`MODES` (their order alternating by shape)."""
    check_lease(rig)
    out: dict[str, Any] = {"model_step_ms": model_step_s * 1e3, "lease_ms": rig.kv_lease_ttl_ms,
                           "answer_ttl_ms": LookupConfig().lookup_answer_ttl_ms, "backends": {}}
    seed = 0
    with endpoints(rig, layout) as eps:
        for endpoint in eps:
            runs_by_shape = []
            for i, shape in enumerate(shapes):
                modes = MODES if i % 2 == 0 else MODES[::-1]
                runs = {}
                for m in modes:
                    seed += 1
                    runs[m.label] = run_conversations(endpoint, shape, m, seed=seed, model_step_s=model_step_s)
                runs_by_shape.append({"shape": shape.as_dict(), "runs": {m.label: runs[m.label] for m in MODES}})
            out["backends"][endpoint.name] = runs_by_shape
    return out


def run_conversations(endpoint: Endpoint, shape: Shape, m: Mode, *, seed: int,
                      model_step_s: float = 0.0015) -> dict[str, Any]:
    """One mode's run: ``shape.conversations`` conversations of fresh tokens, turn by turn, through the scheduler."""
    from mooncake_lookout.connector.rigs.scheduler_driver import SchedulerDriver, make_vllm_config

    extra = endpoint.extra(m)
    if m.ours:
        config = make_vllm_config(extra, max_model_len=shape.max_model_len)
    else:
        config = make_vllm_config(extra, connector="MooncakeStoreConnector", module_path=None,
                                  max_model_len=shape.max_model_len)
    driver = SchedulerDriver(config, num_blocks=shape.num_blocks(shape.conversations), model_step_s=model_step_s)
    records = OutcomeCounter(keep=1_000_000)
    turns: list[dict[str, Any]] = []
    times: list[tuple[list[float], list[float]]] = []  # per turn: path and arrival-to-answer seconds
    try:
        # Every request built (and hashed by vLLM) before the first turn, so turns follow each other at once.
        streams = [conversation_tokens(shape, c, seed) for c in range(shape.conversations)]
        tag = f"{m.label.replace(' ', '-')}-s{seed}"
        requests = [[driver.make_request(f"{tag}-c{c}-t{t}", turn_prompt(tokens, shape, t)) for t in range(shape.turns)]
                    for c, tokens in enumerate(streams)]
        hashes = [[bytes(h) for h in conversation[-1].block_hashes] for conversation in requests]
        for chain in hashes:  # the context is in the store before the first turn
            endpoint.saver.save(chain, 0, shape.context_blocks)
        if m.ours:
            driver.connector.lookup_client.observers.add(records)
        probe = PathProbe(driver.connector)
        before = endpoint.counts(m)
        t_first = time.perf_counter()
        for t in range(shape.turns):
            arrived = _one_turn(driver, [conversation[t] for conversation in requests])
            after = endpoint.counts(m)
            path = [probe.path_s[r] for r in arrived]
            answer = [probe.answered_at[r] - a for r, a in arrived.items() if r in probe.answered_at]
            times.append((path, answer))
            turns.append(_turn_figures(t, shape, arrived, records, before, after, t_first, path, answer))
            before = after
            if t + 1 < shape.turns:  # this turn is answered: its prompt is saved before the next one comes
                for chain in hashes:
                    endpoint.saver.save(chain, shape.blocks(t - 1) if t else shape.context_blocks, shape.blocks(t))
    finally:
        if not m.ours:  # upstream's connector never closes its lookup client on the scheduler side
            close_upstream_client(driver.connector.connector_scheduler.client)
        driver.close()
    result = {"label": m.label, "turns": turns, "from_turn_2": _from_turn_2(turns, times[1:]),
              "schedule_us": summary_us(driver.stats.step_seconds),
              "outcomes": {o.value: n for o, n in records.outcomes.items() if n}}
    if m.ours and shape.turns > 1 and not result["from_turn_2"]["known_share"]:
        raise RuntimeError(f"scenario g ({endpoint.name}, {m.label}): our prefix cache knew no block from the "
                           "second turn on; is the server keeping the store's epoch?")
    return result


def _one_turn(driver: Any, requests: list[Any]) -> dict[str, float]:
    """One turn of every conversation, one arrival per step, stepped until all are finished; arrival times."""
    arrived: dict[str, float] = {}
    pending = list(requests)
    deadline = time.perf_counter() + ROUND_TIMEOUT_S
    while pending or driver.scheduler.get_num_unfinished_requests():
        if pending:
            request = pending.pop(0)
            arrived[request.request_id] = time.perf_counter()
            driver.add(request)
        driver.step()
        if time.perf_counter() > deadline:
            driver.abort(list(arrived))
            raise RuntimeError(f"scenario g: a turn was not answered within {ROUND_TIMEOUT_S:g} s")
    return arrived


def _turn_figures(t: int, shape: Shape, arrived: dict[str, float], records: OutcomeCounter, before: tuple[int, int],
                  after: tuple[int, int], t_first: float, path: list[float], answer: list[float]) -> dict[str, Any]:
    lookups = len(arrived)
    ours = {r.req_id: r for r in records.records if r.req_id in arrived}  # the last record of each request
    return {
        "turn": t + 1, "blocks": shape.blocks(t), "lookups": lookups,
        "store_calls": after[0] - before[0], "store_keys": after[1] - before[1],
        "keys_per_lookup": (after[1] - before[1]) / lookups,
        "path_us": summary_us(path), "answer_us": summary_us(answer),
        "hit_blocks": [r.hit_tokens // BLOCK_SIZE for r in ours.values()],
        "known_blocks": sum(r.known_blocks for r in ours.values()),
        "countable_blocks": sum(r.countable_blocks for r in ours.values()),
        "cache_answers": sum(1 for r in ours.values() if r.from_cache),
        "since_first_turn_s": min(arrived.values()) - t_first,
    }


def _from_turn_2(turns: list[dict[str, Any]], times: list[tuple[list[float], list[float]]]) -> dict[str, Any]:
    """The figures the issue's targets read: every turn from the second on, together."""
    later = turns[1:]
    lookups = sum(t["lookups"] for t in later)
    countable = sum(t["countable_blocks"] for t in later)
    return {
        "lookups": lookups,
        "keys_per_lookup": sum(t["store_keys"] for t in later) / lookups if lookups else None,
        "calls_per_lookup": sum(t["store_calls"] for t in later) / lookups if lookups else None,
        "path_us": summary_us([s for path, _ in times for s in path]),
        "answer_us": summary_us([s for _, answer in times for s in answer]),
        "known_share": sum(t["known_blocks"] for t in later) / countable if countable else None,
        "cache_answers": sum(t["cache_answers"] for t in later),
    }


__all__ = ["Endpoint", "FULL", "INDEX", "LAYOUT", "MODES", "PathProbe", "QUICK", "check_lease", "endpoints", "run",
           "run_conversations"]
