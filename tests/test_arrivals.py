"""Lookups sent from vLLM's input thread as requests arrive (connector/arrivals.py), over our real LookupServer,
a real Mooncake master and real ZMQ: taken over at admission, fenced by a reset, bounded, swept, thread-safe."""

from __future__ import annotations

import contextlib
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import Outcome, OutcomeCounter
from mooncake_lookout.connector.rigs.workload import shared_prefix_workload
from mooncake_lookout.connector.server import LookupServer
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.transport import make_transport

pytestmark = pytest.mark.timed  # waits for real replies, each bounded: runs alone (scripts/test.sh)

BLOCK = 16


def _until(cond: Callable[[], bool], bound_s: float = 5.0) -> None:
    end = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < end, "not within the bound"
        time.sleep(0.0005)


def _on_input_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a thread of its own, as vLLM's input thread would, and return what it returned."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), name="input")
    t.start()
    t.join(5.0)
    assert out, "the input thread did not finish"
    return out[0]


@contextlib.contextmanager
def _clients(address: str) -> Iterator[Callable[..., tuple[LookupClient, OutcomeCounter]]]:
    """A maker of clients (async, pipelined: the socket on its own thread) of the server at ``address``; each
    closed on exit."""
    made: list[LookupClient] = []

    def make(**config: Any) -> tuple[LookupClient, OutcomeCounter]:
        cfg = LookupConfig(**{"lookup_async": True, "lookup_transport": "pipelined", "lookup_timeout_ms": 5000,
                              **config})
        counter = OutcomeCounter()
        made.append(LookupClient(cfg, make_transport(cfg, address), observer=counter))
        return made[-1], counter

    try:
        yield make
    finally:
        for c in made:
            c.close()


@pytest.fixture
def stack(filler: PrefixIndex, index: PrefixIndex) -> Iterator[Callable[..., tuple[LookupClient, OutcomeCounter]]]:
    """A client (async, pipelined: the socket on its own thread) over a real LookupServer; closed after."""
    with LookupServer(index) as server, _clients(server.address) as make:
        yield make


def _stored(filler: PrefixIndex, blocks: int, seed: int) -> Any:
    req = shared_prefix_workload(1, prefix_blocks=0, unique_blocks=blocks, seed=seed)[0]
    filler.store_prefixes([req.block_hashes])
    return req


def test_a_lookup_sent_at_arrival_is_served_at_admission_without_another_round_trip(stack, filler, index) -> None:
    c, counter = stack()
    assert c.arrivals is not None
    r = _stored(filler, 6, seed=11)
    tokens, hashes = 6 * BLOCK + 1, list(r.block_hashes)
    assert _on_input_thread(lambda: c.arrivals.send("r", tokens, hashes))
    _until(lambda: bool(c.transport.news))  # answered while the scheduler's thread did nothing
    calls = index.store_calls
    c.start("r", tokens, hashes, admission=True)
    got = c.lookup("r", tokens, hashes, non_block=True)
    assert got is not None and got.hit_length == 6 * BLOCK  # the first ask: no deferral
    assert counter.deferrals == 0 and counter.outcomes[Outcome.HIT] == 1
    assert index.store_calls == calls  # no second store call
    assert c.pending == 0 and len(c.arrivals) == 0 and c.transport.late_replies == 0


def test_a_reset_after_the_arrival_never_serves_the_answer_from_before_it(stack, filler) -> None:
    c, _ = stack()
    r = _stored(filler, 6, seed=12)
    tokens, hashes = 6 * BLOCK + 1, list(r.block_hashes)
    assert _on_input_thread(lambda: c.arrivals.send("r", tokens, hashes))
    _until(lambda: bool(c.transport.news))  # a hit of 6 blocks, answered before the wipe
    assert c.reset()
    got = c.lookup("r", tokens, hashes)  # asked again, after the wipe
    assert got is not None and got.outcome is Outcome.MISS and got.hit_length == 0


class _ResetInTheWindow:
    """The transport, with the scheduler's thread's ``reset`` landing between an arrival's send and its listing
    (a window a few bytecodes wide; made certain here, not waited for by chance)."""

    def __init__(self, transport: Any, reset: Callable[[], Any]) -> None:
        self._transport, self._reset, self.name = transport, reset, transport.name

    def send(self, lookups: Any, **kw: Any) -> None:
        self._transport.send(lookups, **kw)
        self._reset()

    def forget(self, lk: Any) -> None:
        self._transport.forget(lk)


@pytest.mark.parametrize("whole_reset", [True, False], ids=["client-reset", "fence-alone"])
def test_a_lookup_sent_before_a_reset_was_handed_over_is_never_taken(stack, filler, whole_reset) -> None:
    """Sent before the reset's hand-over, its answer may come from before the wipe: it is never served, whatever
    generation it read (``fence-alone``: the generation unchanged, only the hand-over's time tells)."""
    c, _ = stack()
    r = _stored(filler, 4, seed=13)
    tokens, hashes = 4 * BLOCK + 1, list(r.block_hashes)
    c.arrivals._transport = _ResetInTheWindow(c.transport, c.reset if whole_reset else c.arrivals.reset)
    assert _on_input_thread(lambda: c.arrivals.send("r", tokens, hashes))
    assert len(c.arrivals) == 1  # listed after the reset's sweep
    assert c.arrivals.take("r", tokens, hashes, c.generation) is None
    if whole_reset:
        got = c.lookup("r", tokens, hashes)
        assert got is not None and got.outcome is Outcome.MISS  # wiped: asked again


def test_an_arrival_is_taken_only_for_its_own_prompt(stack, filler) -> None:
    c, _ = stack()
    r = _stored(filler, 4, seed=14)
    tokens, hashes = 4 * BLOCK + 1, list(r.block_hashes)
    assert _on_input_thread(lambda: c.arrivals.send("r", tokens, hashes))
    assert c.arrivals.take("r", tokens + BLOCK, hashes + [b"x" * 32], c.generation) is None  # the prompt grew
    assert len(c.arrivals) == 0
    lk = c.lookup("r", tokens, hashes)  # a lookup of its own
    assert lk is not None and lk.hit_length == 4 * BLOCK


def test_an_arrival_that_never_reaches_the_scheduler_is_dropped_after_its_deadline(stack, filler) -> None:
    c, _ = stack(lookup_timeout_ms=100)
    r = _stored(filler, 4, seed=15)
    assert _on_input_thread(lambda: c.arrivals.send("aborted", 4 * BLOCK + 1, list(r.block_hashes)))
    c.end_step()
    assert len(c.arrivals) == 1  # within its deadline: kept for its admission
    _until(lambda: (c.end_step(), len(c.arrivals) == 0)[1])  # past it: dropped at a step's end
    assert c.pending == 0


def test_arrivals_stop_at_the_pending_bound_and_while_the_breaker_is_open(stack, filler) -> None:
    c, _ = stack(lookup_max_pending=2)
    r = _stored(filler, 2, seed=16)
    tokens, hashes = 2 * BLOCK + 1, list(r.block_hashes)
    sent = _on_input_thread(lambda: [c.arrivals.send(f"r{i}", tokens, hashes) for i in range(3)])
    assert sent == [True, True, False] and len(c.arrivals) == 2
    c2, _ = stack(lookup_breaker_failures=1)
    now = time.perf_counter()
    c2.breaker.failed(now, now, timeout=False)  # one error event: the breaker opens (lookup_breaker_failures=1)
    assert not c2.breaker.closed
    assert not _on_input_thread(lambda: c2.arrivals.send("r", tokens, hashes))
    c2.close()
    assert not c2.arrivals.send("r", tokens, hashes)  # closed: nothing more is sent


def test_arrivals_and_admissions_on_two_threads_serve_every_request_its_own_answer(stack, filler) -> None:
    """An input thread sends at random moments while the scheduler's thread takes requests in and asks for them,
    step after step: every request gets the store's answer for its own prompt, and nothing is left over."""
    c, counter = stack()
    reqs = shared_prefix_workload(120, prefix_blocks=2, unique_blocks=4, seed=17)
    filler.store_prefixes([r.block_hashes if i % 2 else r.block_hashes[:2] for i, r in enumerate(reqs)])
    expected = {r.req_id: (6 if i % 2 else 2) * BLOCK for i, r in enumerate(reqs)}
    arrived: queue.Queue[Any] = queue.Queue()
    rnd = random.Random(5)

    def input_thread() -> None:
        for r in reqs:
            c.arrivals.send(r.req_id, r.num_tokens, list(r.block_hashes))
            arrived.put(r)
            time.sleep(rnd.uniform(0, 0.0005))

    t = threading.Thread(target=input_thread, name="input")
    t.start()
    waiting: list[Any] = []
    answers: dict[str, int] = {}
    end = time.monotonic() + 30
    while len(answers) < len(reqs):
        assert time.monotonic() < end, f"{len(answers)} of {len(reqs)} answered"
        while not arrived.empty():
            r = arrived.get()
            c.start(r.req_id, r.num_tokens, list(r.block_hashes), admission=True)
            waiting.append(r)
        for r in list(waiting):
            got = c.lookup(r.req_id, r.num_tokens, list(r.block_hashes), non_block=True)
            if got is not None:
                answers[r.req_id] = got.hit_length
                c.discard(r.req_id)
                waiting.remove(r)
        c.end_step()
        time.sleep(0.001)  # the model step
    t.join(5.0)
    assert answers == expected
    assert counter.outcomes[Outcome.ERROR] == 0 and counter.outcomes[Outcome.TIMEOUT] == 0
    assert c.pending == 0 and len(c.arrivals) == 0


def test_a_lookup_sent_at_arrival_skips_the_blocks_the_prefix_cache_knows(stack, filler) -> None:
    """Multi-turn: the next turn's lookup, sent from the input thread, asks the store only for the new blocks
    (the cache is read there, never changed), as one started at admission would."""
    c, _ = stack()
    assert c.enable_prefix_cache(BLOCK)
    turn1 = shared_prefix_workload(1, prefix_blocks=0, unique_blocks=12, seed=18)[0]
    filler.store_prefixes([turn1.block_hashes])
    first = c.lookup("t1", 8 * BLOCK + 1, list(turn1.block_hashes[:8]))  # learns 8 blocks
    assert first is not None and first.hit_length == 8 * BLOCK
    c.discard("t1")
    hashes = list(turn1.block_hashes)
    assert _on_input_thread(lambda: c.arrivals.send("t2", 12 * BLOCK + 1, hashes))
    _until(lambda: bool(c.transport.news))
    c.start("t2", 12 * BLOCK + 1, hashes, admission=True)
    got = c.lookup("t2", 12 * BLOCK + 1, hashes, non_block=True)
    assert got is not None and got.hit_length == 12 * BLOCK
    assert got.known_blocks == 8 and got.epoch  # sent with 8 blocks known: the server asked for the last 4 only


@pytest.fixture
def served(index: PrefixIndex) -> Iterator[tuple[Any, Callable[..., tuple[LookupClient, OutcomeCounter]]]]:
    """A real LookupServer (its counts read back) and a maker of clients over it; all closed after."""
    with LookupServer(index) as server, _clients(server.address) as make:
        yield server, make


def _lookups_answered(server: Any, resets: int) -> int:
    return server.stats.answered_by_status["ok"] - resets  # a reset is answered "ok" too


def test_every_lookup_the_server_answered_ends_with_an_outcome_despite_aborts_re_adds_and_a_reset(served,
                                                                                                   filler) -> None:
    """Requests arrive (their lookups leave from the input thread); some are aborted before admission, some are
    admitted with another prompt, some are fenced by a reset; the rest are served. The client reports an outcome
    for every lookup the server answered (the dropped ones as discarded, with why), and no reply is late."""
    server, make = served
    c, counter = make(lookup_timeout_ms=300)
    reqs = shared_prefix_workload(14, prefix_blocks=2, unique_blocks=3, seed=21)
    filler.store_prefixes([r.block_hashes for r in reqs])
    other = shared_prefix_workload(3, prefix_blocks=1, unique_blocks=4, seed=22)
    for r in reqs[:10]:
        assert _on_input_thread(lambda r=r: c.arrivals.send(r.req_id, r.num_tokens, list(r.block_hashes)))
    _until(lambda: _lookups_answered(server, 0) == 10)  # all sent (one dropped before it leaves is never sent)
    re_added, kept = reqs[3:6], reqs[6:10]  # reqs[:3] are aborted before admission: never claimed
    for r, o in zip(re_added, other):  # the same request ids, another prompt: asked again
        got = c.lookup(r.req_id, o.num_tokens, list(o.block_hashes))
        assert got is not None and got.outcome in (Outcome.HIT, Outcome.MISS)
        c.discard(r.req_id)
    for r in kept:
        got = c.lookup(r.req_id, r.num_tokens, list(r.block_hashes))
        assert got is not None and got.hit_length == 5 * BLOCK
        c.discard(r.req_id)
    _until(lambda: (c.end_step(), len(c.arrivals) == 0)[1])  # the aborted ones, once past their deadline
    fenced = reqs[10:]
    for r in fenced:
        assert _on_input_thread(lambda r=r: c.arrivals.send(r.req_id, r.num_tokens, list(r.block_hashes)))
    assert c.reset()
    for r in fenced:  # admitted after the wipe: asked again
        got = c.lookup(r.req_id, r.num_tokens, list(r.block_hashes))
        assert got is not None and got.outcome is Outcome.MISS
        c.discard(r.req_id)
    sent = len(reqs) + len(re_added) + len(fenced)  # 14 at arrival, then 3 re-asked and 4 asked after the wipe
    _until(lambda: _lookups_answered(server, 1) == sent and c.transport.in_flight == 0)
    c.transport.collect()
    assert sum(counter.outcomes.values()) == _lookups_answered(server, 1) == sent
    assert counter.arrivals_dropped == {"unclaimed": 3, "prompt_changed": 3, "reset": 4}
    assert counter.outcomes[Outcome.DISCARDED] == 10 and counter.outcomes[Outcome.HIT] == len(kept)
    assert c.transport.late_replies == 0 and c.pending == 0


class _Slow:
    """The real index behind an INJECTED delay (0.2 s a store call, far within the lookups' 5 s deadline): the
    lookups are dropped while the server holds them, before their replies come. Records what it was asked."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index, self.asked = index, 0

    def lookup_many(self, queries: Any) -> Any:
        self.asked += len(queries)
        time.sleep(0.2)
        return self.index.lookup_many(queries)

    def lookup(self, n: int, h: Any) -> Any:
        return self.lookup_many([(n, h)])[0]

    def reset(self) -> bool:
        return self.index.reset()


def test_a_dropped_arrival_lookups_reply_is_no_late_reply_and_reaches_the_metrics(index, filler) -> None:
    """Dropped while the server holds them (another prompt, or a reset's fence): their replies, in time, are not
    counted as late (the "server slow" signal); the drops reach vLLM's stats record and a Prometheus sink."""
    from prometheus_client import CollectorRegistry

    from mooncake_lookout.metrics import catalogue as cat
    from mooncake_lookout.metrics.prometheus_sink import PrometheusSink
    from mooncake_lookout.metrics.vllm_stats import LookupStatsCollector, step_figures

    slow = _Slow(index)
    with LookupServer(slow) as server:
        cfg = LookupConfig(lookup_async=True, lookup_transport="pipelined", lookup_timeout_ms=5000)
        counter = OutcomeCounter()
        c = LookupClient(cfg, make_transport(cfg, server.address), observer=counter)
        try:
            registry = CollectorRegistry()
            c.observers.add(PrometheusSink(registry=registry))
            stats = LookupStatsCollector(c, every_s=0)
            reqs = shared_prefix_workload(8, prefix_blocks=1, unique_blocks=3, seed=23)
            filler.store_prefixes([r.block_hashes for r in reqs])
            for r in reqs[:4]:
                assert _on_input_thread(lambda r=r: c.arrivals.send(r.req_id, r.num_tokens, list(r.block_hashes)))
            _until(lambda: slow.asked >= 4)  # the server holds them
            for r in reqs[:4]:  # taken with another prompt (a longer one)
                assert c.arrivals.take(r.req_id, r.num_tokens + BLOCK, [*r.block_hashes, b"x" * 32],
                                       c.generation) is None
            for r in reqs[4:]:
                assert _on_input_thread(lambda r=r: c.arrivals.send(r.req_id, r.num_tokens, list(r.block_hashes)))
            _until(lambda: slow.asked >= 8)
            c.arrivals.reset()  # the reset's fence alone: the rest dropped at once
            _until(lambda: server.stats.answered_by_status["ok"] == 8 and c.transport.in_flight == 0)
            c.transport.collect()
            assert c.transport.late_replies == 0
            assert counter.arrivals_dropped == {"prompt_changed": 4, "reset": 4}
            assert counter.outcomes[Outcome.DISCARDED] == 8
            figures = step_figures(stats.take().data["mooncake_lookout"][0])
            assert figures[cat.ARRIVALS_DROPPED.key] == {"prompt_changed": 4, "reset": 4}
            assert figures[cat.REQUESTS.key] == {"discarded": 8} and cat.LATE_REPLIES.key not in figures
            name = cat.ARRIVALS_DROPPED.sample_names[0]
            assert registry.get_sample_value(name, {"reason": "prompt_changed"}) == 4
            assert registry.get_sample_value(name, {"reason": "reset"}) == 4
            assert registry.get_sample_value(cat.PENDING.name) == 0
            assert registry.get_sample_value(cat.REQUESTS.sample_names[0], {"outcome": "discarded"}) == 8
        finally:
            c.close()
