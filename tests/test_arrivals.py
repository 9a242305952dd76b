"""Lookups sent from vLLM's input thread as requests arrive (connector/arrivals.py), over our real LookupServer,
a real Mooncake master and real ZMQ: taken over at admission, fenced by a reset, bounded, swept, thread-safe."""

from __future__ import annotations

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


@pytest.fixture
def stack(filler: PrefixIndex, index: PrefixIndex) -> Iterator[Callable[..., tuple[LookupClient, OutcomeCounter]]]:
    """A client (async, pipelined: the socket on its own thread) over a real LookupServer; closed after."""
    made: list[LookupClient] = []
    with LookupServer(index) as server:
        def make(**config: Any) -> tuple[LookupClient, OutcomeCounter]:
            cfg = LookupConfig(**{"lookup_async": True, "lookup_transport": "pipelined", "lookup_timeout_ms": 5000,
                                  **config})
            counter = OutcomeCounter()
            made.append(LookupClient(cfg, make_transport(cfg, server.address), observer=counter))
            return made[-1], counter

        yield make
        for c in made:
            c.close()


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
    c2.breaker.record(False)
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
