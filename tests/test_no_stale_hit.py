"""No stale hit, ever: a stateful property test of the whole lookup path against a real Mooncake master.

The promise under test (docs/reliability.md, "No stale hit"): every block counted in a hit served to the
scheduler was found present by a store check made at most ``lookup_answer_ttl_ms`` before the serve, so
the master's lease (granted by that check) still has ``lease - lookup_answer_ttl_ms`` to run for the load;
and a served hit is never longer than the prefix the store really holds, except for a wipe by someone else
that no reply has told the client of yet. Overload is not a wipe: a ``busy`` reply clears nothing.

Real parts: a private ``mooncake_master`` with a short lease, our lookup server over a prefix index, our
client and its prefix cache, DEALER/ROUTER over IPC. The server's store client is wrapped by a recording
proxy that forwards every call and notes, per key, when a ``batch_is_exist`` that found it present began
(the lease it granted began no earlier). Faults are real: a plain (lease-respecting) remove standing for
eviction, this instance's reset, another instance's reset of the shared namespace, the master paused (so
lookups time out) or restarted (every key gone), and ``busy`` replies from the server's per-peer bound.

Hypothesis draws interleavings of these with turns of conversations (their lookups started at their first ask,
at admission, or sent from an input thread as they arrive), scheduler steps, waits and asks about
pending and held requests. CI runs the derandomized profile (tests/conftest.py); the cases it found are
replayed as plain tests at the end of this file.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import LookupRecord, NullObserver, Outcome
from mooncake_lookout.connector.rigs.master import EmbeddedMaster
from mooncake_lookout.connector.rigs.workload import chain_hashes
from mooncake_lookout.connector.server import LookupServer
from mooncake_lookout.connector.server.lease import check_lease
from mooncake_lookout.connector.server.limits import Limits
from mooncake_lookout.connector.server.prefix_index import PrefixIndex, StoreError
from mooncake_lookout.connector.server.store import open_writer_store
from mooncake_lookout.connector.transport import make_transport
from mooncake_lookout.connector.transport.pipelined import PipelinedTransport

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

BLOCK = 16
LEASE_MS = 600  # the master's --default_kv_lease_ttl
TTL_MS = 250  # lookup_answer_ttl_ms: the load keeps at least LEASE_MS - TTL_MS
TIMEOUT_MS = 100  # lookup_timeout_ms
MAX_PEER_LOOKUPS = 3  # the server's per-peer bound: past it, a frame is turned away (busy, or bad_request alone)
WAITS_MS = (0, 40, 100, 170)  # in steps of the trust window (TTL_MS), so that turns straddle it
SPLITS = ("heard", "reset_elsewhere", "restart", "reset_here")  # what splits an arrival's cache read and epoch stamp
# Examples run x this (HYPOTHESIS_EXAMPLES_SCALE=3: three times CI's); the profile (tests/conftest.py) is CI's
# derandomized one unless HYPOTHESIS_PROFILE says otherwise.
SCALE = float(os.environ.get("HYPOTHESIS_EXAMPLES_SCALE", "1"))


class RecordingStore:
    """Our lookup server's real store client; notes when each key was last found present (forwards every call)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.found_at: dict[str, float] = {}
        self.calls = 0
        self.delay_s = 0.0  # an INJECTED slow store, for a test that needs the server busy for sure
        self._lock = threading.Lock()  # the server's loop thread writes, the test's thread reads

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        if self.delay_s:
            time.sleep(self.delay_s)
        began = time.perf_counter()  # the master leased what it found no earlier than this
        codes = self.store.batch_is_exist(keys)
        with self._lock:
            self.calls += 1
            for key, code in zip(keys, codes):
                if code == 1:
                    self.found_at[key] = began
        return codes

    def last_found(self, key: str) -> float | None:
        with self._lock:
            return self.found_at.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


@dataclass
class World:
    """What the examples share: the master and two store clients (a client closes in ~1 s: made once)."""

    master: EmbeddedMaster
    writer: Any  # the test's own client: fills the store (prefill saves), evicts, wipes as another instance
    server_store: Any  # our lookup server's client (it puts the epoch marker, so a writer too)

    def wait_writable(self, bound_s: float = 30.0) -> None:
        """Return once both clients can write: after a master restart (the example before may have ended with
        one) they reconnect within a second or two, and a path started earlier would find its seed refused."""
        end = time.monotonic() + bound_s
        for client in (self.writer, self.server_store):
            probe = PrefixIndex(client, BLOCK, f"ready-{uuid.uuid4().hex[:10]}")
            while True:
                try:
                    probe.store_prefixes([[bytes(32)]])
                    probe.remove_all(force=True)
                    break
                except StoreError:
                    assert time.monotonic() < end, f"the store took no write within {bound_s:g} s"
                    time.sleep(0.1)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    master = EmbeddedMaster(kv_lease_ttl_ms=LEASE_MS).start()
    writer = server_store = None
    try:
        writer = open_writer_store(master.rpc_address, rpc_timeout_ms=2000)
        server_store = open_writer_store(master.rpc_address, rpc_timeout_ms=2000)
        # The settings under test are ones the lease probe accepts (server/lease.py).
        check_lease(writer, "probe/", TTL_MS / 1000)
        yield World(master, writer, server_store)
    finally:
        for client in (writer, server_store):
            if client is not None:
                client.close()
        master.kill()


@dataclass
class Request:
    req_id: str
    num_tokens: int
    hashes: tuple[bytes, ...]
    answered: int | None = None  # the hit last served for it


@dataclass
class Truth:
    """What the store holds, as the test changed it: present keys, and when and how each was last removed."""

    present: set[str] = field(default_factory=set)
    unknown: set[str] = field(default_factory=set)  # a put or wipe that failed: the test cannot tell
    # key -> (when the removal began, when it ended, "evict" or "wipe"); a check may overlap a removal: the test
    # cannot tell which the master saw first
    removed: dict[str, tuple[float, float, str]] = field(default_factory=dict)
    wipes: list[float] = field(default_factory=list)  # when wipes by someone else than this client began

    def put(self, keys: list[str], ok: bool) -> None:
        for key in keys:
            (self.present.add if ok else self.unknown.add)(key)
            if ok:
                self.unknown.discard(key)

    def wipe_all(self, at: float, ok: bool, by_others: bool) -> None:
        done = time.perf_counter()
        for key in list(self.present) + list(self.unknown):
            if ok:
                self.removed[key] = (at, done, "wipe")
            else:
                self.unknown.add(key)
        if ok:
            self.present.clear()
            self.unknown.clear()
            if by_others:
                self.wipes.append(at)


class Witness(NullObserver):
    """Counts what the client did and what it was told, through the public observer events only."""

    def __init__(self) -> None:
        self.clears: dict[str, int] = {}
        self.drops: dict[str, int] = {}
        self.failures = 0  # lookups that really failed: timed out, or the store answered an error
        self.store_answers: list[float] = []  # send times of lookups the store answered (hit, miss or error)
        self.refusals: list[LookupRecord] = []  # lookups the server turned away (busy, bad_request)

    def cache_cleared(self, reason: str, blocks: int) -> None:
        self.clears[reason] = self.clears.get(reason, 0) + 1

    def answer_dropped(self, rec: LookupRecord, reason: str) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1

    def consumed(self, rec: LookupRecord) -> None:
        refused = rec.error is not None and rec.error.startswith(("busy", "bad_request", "not sent", "rejected",
                                                                  "breaker_open", "transport closed"))
        if rec.outcome is Outcome.ERROR and refused:
            self.refusals.append(rec)
        if rec.outcome is Outcome.TIMEOUT or (rec.outcome is Outcome.ERROR and not refused):
            self.failures += 1
        if rec.t_start is not None and (rec.outcome in (Outcome.HIT, Outcome.MISS)
                                        or (rec.outcome is Outcome.ERROR and not refused)):
            self.store_answers.append(rec.t_start)


class LookupPath(RuleBasedStateMachine):
    """One vLLM instance's lookup path, driven the way vLLM's scheduler drives it, with faults in between."""

    world: World
    restarts_allowed = False  # at most one restart an example: a store client takes a second or two to reconnect
    ttl_ms = TTL_MS
    timeout_ms = TIMEOUT_MS
    caller_thread = False
    probe_lease = False  # the server probes the lease for the window (as in vLLM's worker and serve), or trusts it
    wait_us = 0  # lookup_wait_us: 0, the async default; a budget makes the step's asks wait for answers

    def __init__(self) -> None:
        super().__init__()
        self.world.wait_writable()
        self.namespace = f"p-{uuid.uuid4().hex[:10]}"
        self.store = RecordingStore(self.world.server_store)
        self.index = PrefixIndex(self.store, BLOCK, self.namespace)
        self.filler = PrefixIndex(self.world.writer, BLOCK, self.namespace)  # also "another instance"
        self.server = LookupServer(self.index, limits=Limits(max_peer_lookups=MAX_PEER_LOOKUPS),
                                   lease_window_s=self.ttl_ms / 1000 if self.probe_lease else None).start()
        self.config = LookupConfig(lookup_async=True, lookup_transport="pipelined", lookup_timeout_ms=self.timeout_ms,
                                   lookup_answer_ttl_ms=self.ttl_ms, lookup_breaker_failures=1000,
                                   lookup_wait_us=self.wait_us)
        self.witness = Witness()
        # Production wiring: the transport make_transport builds for this mode (async: the socket on a thread of
        # its own), or, with ``caller_thread``, the one blocking mode uses.
        transport = (PipelinedTransport(self.server.address, timeout_s=self.timeout_ms / 1000) if self.caller_thread
                     else make_transport(self.config, self.server.address))
        self.client = LookupClient(self.config, transport, observer=self.witness)
        assert self.client.enable_prefix_cache(BLOCK)
        self.truth = Truth()
        self.conversations: list[list[bytes]] = [[], [], []]
        self.waiting: list[Request] = []
        self.arrived: list[Request] = []  # their lookups sent from the input thread, admitted at the next step
        self.faults = 0  # own resets, other wipes, pauses, restarts: what may justify a clear or a drop
        self.served = 0
        self.hits_served: dict[int, Any] = {}  # id -> each result served as a hit (kept: ids stay unique)
        self.restarted = False
        self._ids = 0

    # -- the scheduler's side ------------------------------------------------------------------------------
    def _new_request(self, conversation: int, new_blocks: int) -> Request:
        chain = self.conversations[conversation]
        parent = chain[-1] if chain else bytes([conversation + 1]) * 32
        chain += chain_hashes((f"{self.namespace}/{conversation}/{len(chain) + i}".encode()
                               for i in range(new_blocks)), parent)
        self._ids += 1
        req = Request(f"r{self._ids}", len(chain) * BLOCK + 1, tuple(chain))
        self.waiting.append(req)
        return req

    @initialize(blocks=st.sampled_from((4, 10)))
    def seed_store(self, blocks: int) -> None:
        """Conversation 0's context was saved before (a document everyone asks about)."""
        req = self._new_request(0, blocks)
        self._save(req)
        self.waiting.remove(req)

    @rule(ms=st.sampled_from(WAITS_MS), arrivals=st.lists(st.tuples(st.sampled_from((0, 0, 1, 2)), st.integers(1, 6)),
                                                     max_size=3),
          start=st.sampled_from(("ask", "admission", "arrival")), allocations=st.integers(0, 2),
          aborts=st.integers(0, 1))
    def step(self, ms: int, arrivals: list[tuple[int, int]], start: str, allocations: int, aborts: int) -> None:
        """A scheduling step, ``ms`` after the last, as vLLM's async scheduler runs it: the requests that arrived
        during the last model step are admitted (their lookups left from the input thread then); new turns of
        conversations arrive (their lookups start at admission, at their first ask, or, sent from an input
        thread after this step, at arrival: they are admitted at the next step, faults may come between), every
        waiting request is asked about (pending, answered now, or held since an earlier step), some with an
        answer are allocated (the client forgets them, their prefill is saved), some are aborted; the step ends."""
        time.sleep(ms / 1000)
        for req in self.arrived:
            self.client.start(req.req_id, req.num_tokens, req.hashes, admission=True)
            self.waiting.append(req)
        self.arrived = []
        for conversation, new_blocks in arrivals:
            req = self._new_request(conversation, new_blocks)
            if start == "arrival" and self.client.arrivals is not None:
                self.waiting.remove(req)
                self.arrived.append(req)
            elif start != "ask":
                self.client.start(req.req_id, req.num_tokens, req.hashes, admission=True)
        for req in list(self.waiting):
            self._ask(req, non_block=True)
        for req in [r for r in self.waiting if r.answered is not None][:allocations]:
            self.client.discard(req.req_id)
            self.waiting.remove(req)
            self._save(req)
        for req in self.waiting[:aborts]:
            self.client.discard(req.req_id)
            self.waiting.remove(req)
        self.client.end_step()
        if self.arrived:  # vLLM's input thread builds them while the model runs
            arrivals = self.client.arrivals
            thread = threading.Thread(target=lambda: [arrivals.send(r.req_id, r.num_tokens, r.hashes)
                                                      for r in self.arrived], name="input")
            thread.start()
            thread.join(5.0)

    @rule(kind=st.sampled_from(SPLITS), conversation=st.sampled_from((0, 0, 1)), new_blocks=st.integers(1, 3),
          pick=st.integers(0, 63))
    def split_arrival(self, kind: str, conversation: int, new_blocks: int, pick: int) -> None:
        """A turn arrives and vLLM's input thread plans its lookup (reads the prefix cache), and between that read
        and the epoch stamp the scheduler's thread runs: it takes in a reply naming a new epoch (issue 49, item 1).
        ``heard``: another instance wiped the store just before the arrival and the reply tells of it during the
        split; ``reset_elsewhere``: another instance's wipe happens during the split, then a reply tells of it;
        ``restart``: the master restarted just before the arrival (restarted from this thread: the master dies with
        the thread that started it), the reply after it comes during the split; ``reset_here``: this instance's
        reset on the scheduler's thread. Forced: a hook on the cache read runs the scheduler's thread to its end
        (real threads). The request is admitted at the next step, as the step rule's arrivals are; ``_check_hit``
        judges whatever is served."""
        arrivals, cache = self.client.arrivals, self.client.cache
        if arrivals is None or cache is None:
            return
        if kind == "restart" and (not self.restarts_allowed or self.restarted):
            kind = "reset_elsewhere"
        turn = self._new_request(conversation, 1)  # the conversation's last turn: its answer teaches the cache
        self.waiting.remove(turn)
        self._ask(turn, non_block=False)
        self.client.discard(turn.req_id)
        if kind == "heard":
            self._reset_elsewhere(pick)
        elif kind == "restart":
            self._restart(pick)
        req = self._new_request(conversation, new_blocks)
        self.waiting.remove(req)
        read, split = cache.known, []

        def scheduler_thread() -> None:
            if kind == "reset_elsewhere":
                self._reset_elsewhere(pick)
            elif kind == "restart":
                self.world.wait_writable()  # the store clients reconnect: the next reply names a new epoch
            elif kind == "reset_here":
                self._reset_here(pick)
            self._ask(self._new_request(2, 1), non_block=False)  # a reply, naming the store's epoch, is taken in

        def hooked(*args: Any, **kwargs: Any) -> Any:
            out = read(*args, **kwargs)
            if threading.current_thread().name == "input" and not split:
                split.append(True)
                other = threading.Thread(target=scheduler_thread, name="scheduler")
                other.start()
                other.join(60.0)
            return out

        cache.known = hooked  # type: ignore[method-assign]
        try:
            thread = threading.Thread(target=lambda: arrivals.send(req.req_id, req.num_tokens, req.hashes),
                                      name="input")
            thread.start()
            thread.join(60.0)
        finally:
            del cache.known  # the instance's hook: the class's method again
        if not split:  # nothing known to read (a new conversation, or nothing cached): the split did not happen
            scheduler_thread()
        self.arrived.append(req)

    @rule(pick=st.integers(0, 63))
    def ask_blocking(self, pick: int) -> None:
        """vLLM with ``lookup_async`` off asks about one request and waits for its answer (nothing, when no request
        waits). No precondition: which requests wait depends on when answers came, and a rule enabled by timing
        makes Hypothesis draw differently for the same example (it failed CI with FlakyStrategyDefinition)."""
        if self.waiting:
            self._ask(self.waiting[pick % len(self.waiting)], non_block=False)

    @rule(kind=st.sampled_from(("evict", "evict", "burst", "burst", "reset_here", "reset_elsewhere", "pause",
                                "restart")), pick=st.integers(0, 63))
    def fault(self, kind: str, pick: int) -> None:
        """Something goes wrong, or looks as if it might."""
        if kind == "restart" and (not self.restarts_allowed or self.restarted):
            kind = "evict"
        getattr(self, f"_{kind}")(pick)

    def _burst(self, pick: int) -> None:
        """More arrivals in one step than the server takes from one peer: their frame is turned away."""
        reqs = [self._new_request(i % 3, 1) for i in range(MAX_PEER_LOOKUPS + 1 + pick % 3)]
        for req in reqs:
            self._ask(req, non_block=True)
        self.client.end_step()

    def _evict(self, pick: int) -> None:
        """The master evicts a block if it can: a plain remove, which it refuses while the key is leased."""
        chain = self.conversations[pick % 3]
        if not chain:
            return
        key = self.filler.key(chain[pick % len(chain)])
        at = time.perf_counter()
        code = self.world.writer.remove(key, False)
        if code == 0:
            self.truth.present.discard(key)
            self.truth.unknown.discard(key)
            self.truth.removed[key] = (at, time.perf_counter(), "evict")

    def _reset_here(self, pick: int) -> None:
        """This instance's ``reset_prefix_cache``: nothing answered before it may be served after it."""
        self.faults += 1
        at = time.perf_counter()
        ok = self.client.reset()
        self.truth.wipe_all(at, ok, by_others=False)
        for req in self.waiting:
            req.answered = None

    def _reset_elsewhere(self, pick: int) -> None:
        """Another vLLM instance sharing the master wipes the namespace (what its lookup server's reset does)."""
        self.faults += 1
        at = time.perf_counter()
        self.truth.wipe_all(at, self.filler.reset(), by_others=True)

    def _pause(self, pick: int) -> None:
        """The master stalls: a lookup asked meanwhile times out (a real deadline, a real failure)."""
        self.faults += 1
        req = self._new_request(pick % 3, 1)
        self.world.master.pause()
        try:
            self._ask(req, non_block=False)
        finally:
            self.world.master.resume()

    def _restart(self, pick: int) -> None:
        """The master restarts: every key is gone, the epoch marker too."""
        self.faults += 1
        self.restarted = True
        at = time.perf_counter()
        self.world.master.kill()
        self.world.master.start()
        self.truth.wipe_all(at, True, by_others=True)

    # -- the checks ----------------------------------------------------------------------------------------
    def _save(self, req: Request) -> None:
        keys = [self.filler.key(h) for h in req.hashes]
        try:
            self.filler.store_prefixes([req.hashes])
            self.truth.put(keys, True)
        except StoreError:
            self.truth.put(keys, False)

    def _ask(self, req: Request, non_block: bool) -> None:
        asked = time.perf_counter()  # the client judged its answer no earlier than this
        result = self.client.lookup(req.req_id, req.num_tokens, req.hashes, non_block)
        if result is None:
            return
        req.answered = result.hit_length
        if result.hit_length:
            if self.probe_lease:  # the lease unproven: a hit is served once, to the call that takes it in
                assert self.hits_served.get(id(result)) is not result, (
                    f"{req.req_id}'s hit served again from hold, the master's lease unproven")
                self.hits_served[id(result)] = result
            self.served += 1
            self._check_hit(req, result.hit_length, asked)

    def _check_hit(self, req: Request, hit: int, asked: float) -> None:
        assert hit % BLOCK == 0 and hit < req.num_tokens, (req, hit)
        ttl = self.config.answer_ttl_s
        for i in range(hit // BLOCK):
            key = self.filler.key(req.hashes[i])
            found = self.store.last_found(key)
            assert found is not None, f"block {i} of {req.req_id} served as a hit but never found by the store"
            assert asked - found <= ttl, (
                f"block {i} of {req.req_id} served {asked - found:.3f} s after the check that found it: the "
                f"lease it granted leaves the load {(LEASE_MS / 1000) - (asked - found):.3f} s, not "
                f"{LEASE_MS / 1000 - ttl:.3f} s")
            if key in self.truth.present or key in self.truth.unknown:
                continue
            removed = self.truth.removed.get(key)
            assert removed is not None, f"block {i} of {req.req_id} was never put, yet served as a hit"
            began, ended, how = removed
            # Without a store epoch (the lease unproven) no reply can tell of a wipe: as with upstream's client.
            told = [sent for sent in self.witness.store_answers if sent > ended] if not self.probe_lease else []
            # Allowed only for a wipe by someone else that may have come after the check, before any reply to a
            # request sent after it reached the client: nothing could have told the client yet.
            assert how == "wipe" and began in self.truth.wipes and found < ended and not told, (
                f"block {i} of {req.req_id} was gone when served: {how} by "
                f"{'another instance' if began in self.truth.wipes else 'this one'} {asked - began:.3f} s before, "
                f"{began - found:.3f} s after the check that found it; "
                f"{len(told)} lookups sent since were answered by the store")

    @invariant()
    def an_unproven_lease_caches_nothing(self) -> None:
        """With a window the lease cannot cover, the server's probe refuses it: no epoch is ever named, so the
        client caches no block (and holds no hit: ``_ask``)."""
        if self.probe_lease:
            assert not self.client.store_view.epoch and len(self.client.cache or ()) == 0

    @invariant()
    def overload_is_not_a_wipe(self) -> None:
        """Without a wipe, a reset, a pause or a restart, nothing known is forgotten, whatever came busy: only
        a real failure (a timeout, a store error) may clear the cache, once per failure."""
        w = self.witness
        assert w.clears.get("failure", 0) <= w.failures, (w.clears, w.failures)
        if not self.faults:
            assert w.clears.get("epoch", 0) == 0, w.clears
            assert w.drops.get("wiped", 0) <= w.failures, (w.drops, w.failures)

    def teardown(self) -> None:
        self.client.close()
        self.server.close()
        try:
            self.filler.remove_all(force=True)
        except StoreError:
            pass


def _machine(world: World, *, restarts: bool, caller_thread: bool = False, wait_us: int = 0,
             ttl_ms: int = TTL_MS, probe_lease: bool = False) -> type[LookupPath]:
    return type("Path", (LookupPath,), {"world": world, "restarts_allowed": restarts, "caller_thread": caller_thread,
                                        "wait_us": wait_us, "ttl_ms": ttl_ms, "probe_lease": probe_lease})


# No shrinking: the store's leases run on real time, so a shorter replay of a failure is not the same case.
_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), report_multiple_bugs=False,
                 phases=(Phase.explicit, Phase.reuse, Phase.generate))


def _examples(n: int) -> int:
    return max(1, round(n * SCALE))


def test_no_hit_outlives_its_check_or_the_store_and_busy_clears_nothing(world: World) -> None:
    run_state_machine_as_test(_machine(world, restarts=False),
                              settings=settings(max_examples=_examples(60), stateful_step_count=30, **_SETTINGS))


def test_no_stale_hit_across_master_restarts_with_the_socket_on_the_callers_thread(world: World) -> None:
    run_state_machine_as_test(_machine(world, restarts=True, caller_thread=True),
                              settings=settings(max_examples=_examples(6), stateful_step_count=30, **_SETTINGS))


def test_no_stale_hit_with_a_wait_budget_and_lookups_sent_on_arrival(world: World) -> None:
    """A wait budget's lookups leave from the input thread too (their socket on the I/O thread): the step's asks
    wait for answers, and the same promise holds."""
    run_state_machine_as_test(_machine(world, restarts=False, wait_us=2000),
                              settings=settings(max_examples=_examples(12), stateful_step_count=30, **_SETTINGS))


def test_a_window_above_the_lease_is_refused_and_no_hit_outlives_what_is_proven(world: World) -> None:
    """lookup_answer_ttl_ms 700 ms over the master's 600 ms lease, the server probing it as vLLM's worker does: the
    probe refuses it (no store epoch), and the client caches nothing and serves each hit once, never from hold
    (the old client held hits for the whole 700 ms: served from hold past the lease, after their blocks could be
    evicted)."""
    run_state_machine_as_test(_machine(world, restarts=False, ttl_ms=LEASE_MS + 100, probe_lease=True),
                              settings=settings(max_examples=_examples(12), stateful_step_count=30, **_SETTINGS))


def test_no_stale_hit_when_an_arrivals_cache_read_and_epoch_stamp_are_split_by_a_restart(world: World) -> None:
    """Lookups sent on arrival (the socket on the I/O thread) with master restarts allowed, so ``split_arrival``
    draws every kind, the restart included: the old client served the old epoch's blocks as a hit after the
    wipe (the rule's cases; the plain test of tests/test_prefix_cache.py forces the same split once)."""
    run_state_machine_as_test(_machine(world, restarts=True),
                              settings=settings(max_examples=_examples(10), stateful_step_count=30, **_SETTINGS))



# -- the cases the machine found, replayed step by step ------------------------------------------------------
# Each failed before the fix it names (the old client on the left of each comment); the times are chosen with a
# margin of at least 50 ms against the trust window, so a slow step of a loaded machine does not change the case.

@pytest.fixture
def path(world: World) -> Iterator[LookupPath]:
    machine = _machine(world, restarts=False)()
    machine.seed_store(10)  # conversation 0's context: blocks 0-9 are in the store
    yield machine
    machine.teardown()


def test_a_held_answer_is_not_served_past_the_trust_of_blocks_it_did_not_check(path: LookupPath) -> None:
    """Turn 2 skips turn 1's blocks (the cache knows them) and is held: it was served until its own send plus the
    trust window, up to twice the window after turn 1's check of blocks 0-9 (the old client served it 282 ms
    after that check, with a 250 ms window)."""
    turn1 = path._new_request(0, 2)
    path._ask(turn1, non_block=False)  # blocks 0-9 found
    assert turn1.answered == 10 * BLOCK
    time.sleep(0.1)
    turn2 = path._new_request(0, 2)
    while turn2.answered is None:  # asked each step until answered: the server checks blocks 10-13 only
        path._ask(turn2, non_block=True)
        path.client.end_step()
        time.sleep(0.005)
    for _ in range(40):  # held, and asked every 5 ms until well past turn 1's trust: _check_hit judges each serve
        path._ask(turn2, non_block=True)
        time.sleep(0.005)
    assert path.served >= 2


def test_blocks_that_expire_between_planning_and_sending_are_asked_again(path: LookupPath) -> None:
    """Turn 2's lookup is planned at admission while the cache still trusts blocks 0-9, and sent after that trust
    ended: the old client still told the server to skip them, and served the hit 300 ms after their check."""
    turn1 = path._new_request(0, 2)
    path._ask(turn1, non_block=False)
    assert turn1.answered == 10 * BLOCK
    time.sleep(0.15)
    turn2 = path._new_request(0, 2)
    path.client.start(turn2.req_id, turn2.num_tokens, turn2.hashes, admission=True)  # planned now
    time.sleep(0.15)  # past turn 1's trust (250 ms)
    path._ask(turn2, non_block=False)  # sent now; _check_hit judges the serve
    assert turn2.answered == 10 * BLOCK


def test_after_a_busy_reply_a_held_answer_is_served_without_a_store_call(world: World) -> None:
    """The old client read ``busy`` (which names no epoch) as a store wipe: it dropped every held answer and
    cleared its cache, so overload made it ask for more. Here the server is made busy for sure: its store is
    slowed (INJECTED: 0.1 s a call) while three steps send two lookups each; the third frame finds this peer's
    bound (3 lookups waiting) full. The trust window is 450 ms here (the master's lease 600 ms), so the held
    answer outlives the wait for the busy reply, and the deadline 2 s, so the slow store times nothing out."""
    path = type("Path", (LookupPath,), {"world": world, "ttl_ms": 450, "timeout_ms": 2000})()
    path.seed_store(10)
    try:
        _busy_then_held(path)
    finally:
        path.teardown()


def _busy_then_held(path: LookupPath) -> None:
    held = path._new_request(0, 2)
    path._ask(held, non_block=False)
    assert held.answered == 10 * BLOCK
    path.client.end_step()
    path.store.delay_s = 0.1
    burst = []
    for _ in range(3):  # a frame a step, each within the bound: the second waits, the third is turned away
        for conversation in (1, 2):
            req = path._new_request(conversation, 1)
            path.client.start(req.req_id, req.num_tokens, req.hashes, admission=True)
            burst.append(req)
        path.client.end_step()
    deadline = time.monotonic() + 10
    while not any(r.error and r.error.startswith("busy") for r in path.witness.refusals):
        assert time.monotonic() < deadline, "the server never answered busy"
        for req in burst:
            path._ask(req, non_block=True)
        path.client.end_step()
        time.sleep(0.01)
    path.store.delay_s = 0.0
    calls = path.store.calls
    result = path.client.lookup(held.req_id, held.num_tokens, held.hashes, True)  # no wait allowed: from hold only
    assert result is not None and result.hit_length == 10 * BLOCK
    assert path.store.calls == calls
    assert path.witness.clears == {} and "wiped" not in path.witness.drops


def test_held_and_known_block_hits_keep_the_loads_margin() -> None:
    """The documented ratio (lease 1 s, trust window 0.5 s), turn 2 sent just before the cache's trust in turn 1's
    blocks ends, then asked every 10 ms for two leases while the master tries to evict block 0 every 10 ms: every
    served hit leaves each block it counts at least 0.4 s of lease (the old client left 0.05-0.10 s), and none
    is served once a plain remove of block 0 has succeeded."""
    lease_s, ttl_s = 1.0, 0.5
    master = EmbeddedMaster(kv_lease_ttl_ms=int(lease_s * 1000)).start()
    writer = server_store = client = server = None
    try:
        writer = open_writer_store(master.rpc_address, rpc_timeout_ms=2000)
        server_store = open_writer_store(master.rpc_address, rpc_timeout_ms=2000)
        store = RecordingStore(server_store)
        filler = PrefixIndex(writer, BLOCK, "margin")
        server = LookupServer(PrefixIndex(store, BLOCK, "margin")).start()
        config = LookupConfig(lookup_async=True, lookup_transport="pipelined", lookup_timeout_ms=TIMEOUT_MS,
                              lookup_answer_ttl_ms=ttl_s * 1000)
        client = LookupClient(config, PipelinedTransport(server.address, timeout_s=TIMEOUT_MS / 1000))
        assert client.enable_prefix_cache(BLOCK)
        chain = chain_hashes(f"margin/{i}".encode() for i in range(20))
        filler.store_prefixes([chain])
        assert client.lookup("turn1", 10 * BLOCK + 1, chain[:10]).hit_length == 10 * BLOCK
        client.discard("turn1")
        time.sleep(ttl_s - 0.05)
        block0 = filler.key(chain[0])
        margins: list[float] = []
        evicted_at: float | None = None
        end = time.perf_counter() + 2 * lease_s
        while time.perf_counter() < end:
            asked = time.perf_counter()
            result = client.lookup("turn2", 20 * BLOCK + 1, chain, True)
            client.end_step()
            if result is not None and result.hit_length:
                assert evicted_at is None, f"a hit served {asked - evicted_at:.3f} s after block 0's lease ended"
                found = [store.last_found(filler.key(h)) for h in chain[:result.hit_length // BLOCK]]
                assert None not in found
                margins.append(min(f + lease_s for f in found if f is not None) - asked)
            if evicted_at is None and writer.remove(block0, False) == 0:
                evicted_at = time.perf_counter()
            time.sleep(0.01)
        assert len(margins) >= 50, margins  # turn 2 was served, again and again, from its held answer
        assert min(margins) >= 0.4, f"smallest margin {min(margins):.3f} s of a {lease_s} s lease"
    finally:
        for closable in (client, server):
            if closable is not None:
                closable.close()
        for c in (writer, server_store):
            if c is not None:
                c.close()
        master.kill()
