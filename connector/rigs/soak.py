"""The lookup path under a long run of random real faults: the soak, and the rig fault tests share.

:class:`FaultRig` assembles the real parts: a Mooncake master (:class:`EmbeddedMaster`), a writer client
that holds the truth (what was stored), a lookup server in a child process
(:class:`~.server_process.ServerProcess`, either transport) and our
:class:`~mooncake_lookout.connector.client.LookupClient` in this process. It checks every served hit
against the truth: a hit above what the store holds is *wrong*; a hit for a lookup that was both asked
and answered while the store was known to be empty (after a reset or a master crash, before re-filling)
is *stale*.

:func:`run_soak` drives the client like vLLM's scheduler does (lookups started at admission, polled once
per step, some blocking), injects random faults between and during steps, and reports the figures the
README's reliability section quotes (``python -m mooncake_lookout.connector.rigs.soak --lookups 100000``
prints them). Every random choice comes from one seed (:class:`SoakPlan`), so ``--seed`` reproduces a run.
"""

from __future__ import annotations

import argparse
import array
import collections
import contextlib
import dataclasses
import gc
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mooncake_lookout.connector.client import LookupClient
from mooncake_lookout.connector.config import LookupConfig
from mooncake_lookout.connector.events import LookupRecord, NullObserver, Outcome
from mooncake_lookout.connector.job import LookupResult
from mooncake_lookout.connector.rigs.machine import load_average, machine
from mooncake_lookout.connector.rigs.master import MOONCAKE_LEASE_MS, EmbeddedMaster
from mooncake_lookout.connector.rigs.server_process import ServerProcess
from mooncake_lookout.connector.rigs.workload import WorkloadRequest, shared_prefix_workload
from mooncake_lookout.connector.server.prefix_index import PrefixIndex
from mooncake_lookout.connector.server.store import open_writer_store
from mooncake_lookout.connector.transport import make_transport
from mooncake_lookout.connector.transport.names import PIPELINED, TRANSPORTS

BLOCK_SIZE = 16
FAULTS = ("server_pause", "server_kill", "store_delay", "master_pause", "reset", "master_kill",
          "abort_storm", "id_reuse")
RECOVERED_FAULTS = frozenset(("server_kill", "server_pause", "master_pause", "master_kill", "store_delay", "reset"))
WIPING_FAULTS = frozenset(("reset", "master_kill"))  # the store is empty afterwards: the truth is put back
SOAK_STEP_S = 0.001  # time between two scheduler steps (stands in for a model's forward pass)


def rss_bytes() -> int:
    """Resident memory of this process, from ``/proc/self/status``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def poll_until(condition: Callable[[], bool], timeout_s: float, interval_s: float = 0.005) -> float | None:
    """Call ``condition`` until true (bounded); seconds it took, or None if ``timeout_s`` passed."""
    t0 = time.perf_counter()
    while True:
        if condition():
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout_s:
            return None
        time.sleep(interval_s)


# How far past its deadline a call may end before a test calls it slow: the OS may run a woken thread tens of
# milliseconds late on a loaded 2-core machine (the suite's own master, servers and clients compete for the
# cores). A wedge, what upstream's client does when its server stalls, is caught by the hard limits instead.
SLACK_S = 0.025


@contextlib.contextmanager
def collector_held() -> Iterator[None]:
    """Keep Python's cyclic collector from running while a call is timed against its deadline.

    A collection lands in whichever allocation crosses its threshold and stops every thread of the process
    meanwhile: 15-90 ms measured in this suite (Hypothesis's garbage), up to 400 ms over vLLM's heap. That is
    the interpreter's pause, not the lookup path waiting (vLLM's engine freezes its start-up heap for the same
    reason), and it once put a 50 ms call at 137 ms. The collection runs at the first allocation after."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CallBudget:
    """Times of calls that must stay within ``timeout_s`` + ``slack_s`` (the acceptance bound).

    On a loaded 2-core machine the OS may run a woken thread a few milliseconds late; such an outlier is
    not the lookup path waiting. A *wedge* (what upstream's client does when its server stalls) shows as a
    call far past the deadline: ``hard_factor`` x ``timeout_s`` catches it. :meth:`problems` allows at
    most ``outliers_allowed`` calls (or one in 2,000, if more) over the bound and none over the hard limit.
    """

    def __init__(self, timeout_s: float, *, slack_s: float = SLACK_S, hard_factor: float = 2.0,
                 outliers_allowed: int = 1) -> None:
        self.bound_s = timeout_s + slack_s
        self.hard_s = hard_factor * timeout_s
        self.outliers_allowed = outliers_allowed
        self.calls = 0
        self.longest = 0.0
        self.over: list[float] = []

    def record(self, seconds: float) -> None:
        """One call's duration, in seconds."""
        self.calls += 1
        self.longest = max(self.longest, seconds)
        if seconds > self.bound_s:
            self.over.append(seconds)

    def problems(self) -> str | None:
        """None if within budget, else what broke it."""
        if self.longest > self.hard_s:
            return f"a call took {self.longest * 1000:.1f} ms (wedged: limit {self.hard_s * 1000:.0f} ms)"
        if len(self.over) > max(self.outliers_allowed, self.calls // 2000):
            return (f"{len(self.over)} of {self.calls} calls over {self.bound_s * 1000:.0f} ms: "
                    f"{[round(x * 1000, 1) for x in self.over[:5]]} ms")
        return None


class Tally(NullObserver):
    """Counts outcomes and scheduler-call times without keeping records (a soak must not grow)."""

    def __init__(self) -> None:
        self.outcomes: collections.Counter[str] = collections.Counter()

    def consumed(self, rec: LookupRecord) -> None:
        self.outcomes[rec.outcome.value if rec.outcome else "?"] += 1

    def discarded(self, rec: LookupRecord) -> None:
        self.outcomes["discarded"] += 1


@dataclass
class Violations:
    """Served hits that break a guarantee; all must stay empty."""

    wrong: list[str] = field(default_factory=list)  # hit above what the store holds
    stale: list[str] = field(default_factory=list)  # hit while the store was known empty
    slow_calls: list[float] = field(default_factory=list)  # lookup() calls over the deadline + SLACK_S
    late_answers: list[float] = field(default_factory=list)  # None (ask again) served past the deadline
    pending_left: list[int] = field(default_factory=list)  # pending lookups after a round ended

    def empty(self) -> bool:
        """True when no guarantee was broken."""
        return not (self.wrong or self.stale or self.slow_calls or self.late_answers or self.pending_left)


class SendClock(NullObserver):
    """When a client last sent a lookup: the bound on one still queued ends with the one sent ahead of it.

    Its ``started`` events say when, except with the ``upstream`` transport, whose thread sends after the hand-over
    (the event's ``t_start`` is then ``None``): that thread records its own last send (a float, written whole),
    read here too. Read :attr:`last_sent` after the call being judged: a send in between can only make the bound
    later, never a false violation.
    """

    def __init__(self, transport: Any = None) -> None:
        self.transport = transport
        self._started = 0.0

    @property
    def last_sent(self) -> float:
        """The latest send, as the events and the transport itself know it."""
        return max(self._started, getattr(self.transport, "last_sent", 0.0))

    def started(self, rec: LookupRecord) -> None:
        if rec.t_start is not None and rec.t_start > self._started:
            self._started = rec.t_start


class _ClientLog(SendClock):
    """When the latest lookup was sent, and how each request's latest lookup ended."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, Outcome] = {}
        self.cache = {"countable_blocks": 0, "known_blocks": 0, "answered_from_cache": 0}
        self.cache_clears: dict[str, int] = {}

    def consumed(self, rec: LookupRecord) -> None:
        if rec.outcome is not None:
            self.outcomes[rec.req_id] = rec.outcome
        self.cache["countable_blocks"] += rec.countable_blocks
        self.cache["known_blocks"] += rec.known_blocks
        self.cache["answered_from_cache"] += rec.from_cache

    def cache_cleared(self, reason: str, blocks: int) -> None:
        self.cache_clears[reason] = self.cache_clears.get(reason, 0) + 1


class FaultRig:
    """A real master, a truth-holding writer, a lookup server process and our client, with truth checks.

    ``transport``: ``pipelined`` or ``upstream``. ``config``: extra :class:`LookupConfig` fields (the
    transport is set here). ``server_kwargs`` go to :class:`ServerProcess`.
    """

    def __init__(self, transport: str, *, config: dict[str, Any] | None = None,
                 server_kwargs: dict[str, Any] | None = None, master: EmbeddedMaster | None = None) -> None:
        self.transport = transport
        self._stack = contextlib.ExitStack()
        self.own_master = master is None
        self.namespace = f"soak-{uuid.uuid4().hex[:10]}"
        self.rpc_base = tempfile.mkdtemp(prefix="lookout-rig-")
        self._stack.callback(shutil.rmtree, self.rpc_base, True)
        self.stored: dict[bytes, int] = {}  # last hash of a stored prefix -> its blocks
        self.empty_since: float | None = None  # the store is known empty from then until re-filled
        self.violations = Violations()
        self._log = _ClientLog()
        try:  # a failed start must not leave a master or a server process behind
            # A master of its own leases found keys as Mooncake does unless told (10 s), as in production.
            self.master = master if master is not None else self._stack.enter_context(
                EmbeddedMaster(kv_lease_ttl_ms=MOONCAKE_LEASE_MS))
            self.writer = open_writer_store(self.master.rpc_address, rpc_timeout_ms=2000)
            self._stack.callback(self._close_writer)
            self.truth_index = PrefixIndex(self.writer, BLOCK_SIZE, self.namespace)
            # keep_epoch: our server keeps the store's epoch as it does inside vLLM, so the clients' prefix
            # caches are on (what the faults must not fool).
            kwargs = dict(namespace=self.namespace, rpc_port=os.getpid() % 50_000 + 1,
                          rpc_base_path=self.rpc_base, block_size=BLOCK_SIZE, keep_epoch=True)
            kwargs.update(server_kwargs or {})
            self.server = ServerProcess(transport, self.master.rpc_address, **kwargs)
            self._stack.callback(self.server.close)
            self.server.start()
            # Found blocks are trusted for at most half the master's lease (the rule the chart and docs give).
            ttl_ms = min(LookupConfig().lookup_answer_ttl_ms, self.master.kv_lease_ttl_ms / 2)
            self.config = LookupConfig(**{"lookup_transport": transport, "lookup_answer_ttl_ms": ttl_ms,
                                          **(config or {})})
            self.budget = CallBudget(self.config.timeout_s)
            self.client = self.new_client()
            self._log.transport = self.client.transport
        except BaseException:
            self._stack.close()
            raise

    def _close_writer(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()

    def reset_checks(self) -> None:
        """Forget the violations and call times seen so far (each test judges its own)."""
        self.violations = Violations()
        self.budget = CallBudget(self.config.timeout_s)

    @property
    def last_sent(self) -> float:
        """When the rig's clients last sent a lookup (:class:`SendClock`)."""
        return self._log.last_sent

    def cache_figures(self) -> dict[str, Any]:
        """The rig's clients' prefix cache so far: blocks that could count, blocks it knew, answers with no
        round trip, and its clears by reason."""
        return {**self._log.cache, "clears": dict(self._log.cache_clears)}

    def outcome(self, req_id: str) -> Outcome | None:
        """How the latest lookup of ``req_id`` by the rig's clients ended."""
        return self._log.outcomes.get(req_id)

    def new_client(self, observer: Any = None, **config: Any) -> LookupClient:
        """A client of this rig's transport on the server's address (closed with the rig); ``config``
        overrides fields of the rig's :class:`LookupConfig`."""
        cfg = dataclasses.replace(self.config, **config) if config else self.config
        client = LookupClient(cfg, make_transport(cfg, self.server.address), observer=observer)
        client.observers.add(self._log)
        client.enable_prefix_cache(BLOCK_SIZE)  # as the scheduler adapter does for this layout (on by default)
        self._stack.callback(client.close)
        return client

    # -- truth ----------------------------------------------------------------------------------------------
    def store(self, requests: Sequence[WorkloadRequest], blocks: Callable[[WorkloadRequest], int]) -> None:
        """Store ``blocks(req)`` leading blocks of each request; they become the truth."""
        prefixes = [p for p in (r.block_hashes[:blocks(r)] for r in requests) if p]
        self._put(prefixes)
        for p in prefixes:
            for i in range(1, len(p) + 1):
                self.stored[p[i - 1]] = i
        self.empty_since = None

    def _put(self, prefixes: list[tuple[bytes, ...]]) -> None:
        # Right after a master restart the writer needs a moment to reconnect: retry (bounded).
        deadline = time.perf_counter() + 15.0
        while True:
            try:
                self.truth_index.store_prefixes(prefixes)
                return
            except Exception:
                if time.perf_counter() > deadline:
                    raise
                time.sleep(0.05)

    def truth(self, num_tokens: int, hashes: Sequence[bytes]) -> int:
        """Tokens of the prefix the store holds, as the lookup server should count them."""
        countable = min(len(hashes), max(0, (num_tokens - 1) // BLOCK_SIZE))
        hit = 0
        for i in range(countable):
            if self.stored.get(hashes[i]) != i + 1:
                break
            hit = i + 1
        return hit * BLOCK_SIZE

    def check(self, req_id: str, num_tokens: int, hashes: Sequence[bytes], result: LookupResult,
              t_submit: float) -> None:
        """Record a violation if ``result`` is wrong or stale for the truth at the time."""
        hit = result.hit_length
        if hit > self.truth(num_tokens, hashes) or hit % BLOCK_SIZE:
            self.violations.wrong.append(f"{req_id}: hit {hit} > truth {self.truth(num_tokens, hashes)}")
        if hit and self.empty_since is not None and t_submit >= self.empty_since:
            self.violations.stale.append(f"{req_id}: hit {hit} while the store was empty")

    # -- faults -----------------------------------------------------------------------------------------------
    def wipe(self) -> bool:
        """``client.reset()`` (the server wipes the store, fenced); the store is empty until :meth:`restore`."""
        ok = self.client.reset()
        if ok:
            self.empty_since = time.perf_counter()
        return ok

    def kill_master(self) -> None:
        """Crash the master (SIGKILL) and start it on the same ports: every key is gone."""
        self.master.kill()
        self.empty_since = time.perf_counter()
        self.master.start()

    def restore(self, requests: Sequence[WorkloadRequest]) -> None:
        """Put the truth back (after a wipe or a master crash)."""
        prefixes = []
        for r in requests:
            n = max((self.stored.get(h, 0) for h in r.block_hashes), default=0)
            if n:
                prefixes.append(r.block_hashes[:n])
        self.empty_since = None
        self._put(prefixes)

    def recovery_s(self, req: WorkloadRequest, timeout_s: float = 15.0) -> float | None:
        """Seconds until a lookup of a stored request hits its truth again (bounded; the same client)."""
        want = self.truth(req.num_tokens, req.block_hashes)
        n = [0]

        def hits() -> bool:
            n[0] += 1
            rid = f"recover-{n[0]}"
            result = self.client.lookup(rid, req.num_tokens, req.block_hashes)
            self.client.discard(rid)
            return result.hit_length == want

        return poll_until(hits, timeout_s, 0.01)

    def assert_recovers(self, requests: Sequence[WorkloadRequest], bound_s: float) -> float:
        """:meth:`recovery_s` of the request whose stored prefix is longest (the clearest sign of recovery);
        AssertionError if lookups do not hit again within ``bound_s``."""
        took = self.recovery_s(max(requests, key=lambda r: self.truth(r.num_tokens, r.block_hashes)), bound_s)
        assert took is not None, f"lookups did not hit again within {bound_s} s"
        return took

    def close(self) -> None:
        """Stop the client, the server process (and its standby), the writer and, if the rig made it, the master."""
        self._stack.close()

    def __enter__(self) -> FaultRig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class SoakReport:
    """What a soak measured; ``ok`` is the verdict on every guarantee."""

    transport: str
    lookups: int
    seconds: float
    outcomes: dict[str, int]
    faults: dict[str, int]
    wrong_hits: int
    stale_hits: int
    max_call_ms: float
    calls_over_bound: int  # lookup() calls over the deadline + slack_ms
    blocking_call_ms: dict[str, float]  # percentiles of blocking (sync-mode) lookup() calls
    max_late_ms: float
    pending_left_rounds: int
    rss_growth_mb: float
    max_recovery_s: float | None
    recoveries_failed: int
    timeout_ms: float
    slack_ms: float
    ok: bool
    # The prefix cache under the faults: blocks that could count, blocks it knew, answers with no round trip;
    # and its clears by reason (reset, epoch, failure).
    prefix_cache: dict[str, Any] = field(default_factory=dict)
    examples: dict[str, list[Any]] = field(default_factory=dict)  # first few violations of each kind

    def as_text(self) -> str:
        """A human-readable summary."""
        return "\n".join(f"{k:>20}: {v}" for k, v in asdict(self).items())


class SoakPlan:
    """Every random choice of a soak, drawn from one seed, so ``--seed`` reproduces a run.

    Which blocks of each request the store holds, which requests each round asks for, which fault a round
    carries (each kind once per cycle, in a seeded order; at most ``master_kills`` master crashes, later
    ones become master pauses), which requests a reused id switches to, and which calls block. Nothing here
    depends on the process (no salted ``hash()``), only on the seed and the order of the calls.
    """

    def __init__(self, seed: int, *, work_size: int, fault_rate: float, master_kills: int) -> None:
        self.seed = seed
        self.work_size = work_size
        self.fault_rate = fault_rate
        self.kills_left = master_kills
        self._rng = random.Random(seed)
        self._order: list[str] = []

    def stored_blocks(self) -> int:
        """How many leading blocks of the next request the store holds (0 for about a third)."""
        return self._rng.choice((0, 0, 2, 4, 6, 8))

    def batch(self, size: int) -> list[int]:
        """Indices into the workload of the next round's ``size`` requests (repeats allowed)."""
        return [self._rng.randrange(self.work_size) for _ in range(size)]

    def fault(self) -> str | None:
        """The fault the next round carries, or None (with probability ``1 - fault_rate``)."""
        if self._rng.random() >= self.fault_rate:
            return None
        if not self._order:  # every kind in turn, in a seeded order, so a short soak has each
            self._order = self._rng.sample(FAULTS, len(FAULTS))
        fault = self._order.pop()
        if fault == "master_kill":
            if self.kills_left <= 0:
                return "master_pause"
            self.kills_left -= 1
        return fault

    def replacement(self) -> int:
        """The workload index a reused id switches to."""
        return self._rng.randrange(self.work_size)

    def blocking(self, req_id: str) -> bool:
        """Whether the scheduler asks ``req_id`` blocking (about one in eight, as sync mode does)."""
        return zlib.crc32(f"{self.seed}/{req_id}".encode()) % 8 == 0


@dataclass
class _Tracking:
    """What a soak has counted so far."""

    t_start: float = field(default_factory=time.perf_counter)
    done: int = 0
    rounds: int = 0
    rss0: int | None = None
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    recoveries: list[float] = field(default_factory=list)
    recoveries_failed: int = 0
    max_call: float = 0.0
    max_late: float = 0.0
    blocking_calls: array.array[float] = field(default_factory=lambda: array.array("d"))


@dataclass
class _Round:
    """One round's requests, by id, with their lookups' records (a fault may restart some of them)."""

    ids: list[str]
    batch: list[WorkloadRequest]
    records: dict[str, LookupRecord]
    inject_s: float = 0.0  # how long injecting the fault stopped the steps (harness time, not the client's)


def run_soak(lookups: int = 100_000, *, transport: str = PIPELINED, seed: int = 0, round_size: int = 64,
             fault_rate: float = 0.02, timeout_ms: float = 50.0, master_kills: int = 1,
             workload_size: int = 512, progress: Callable[[str], None] | None = None) -> SoakReport:
    """Run ``lookups`` lookups with random real faults; returns the figures (see :class:`SoakReport`).

    Each round admits ``round_size`` requests (lookups start at admission), then polls them once per
    step, as vLLM's async scheduler does; one in eight asks blocking, as its sync mode does. With
    probability ``fault_rate`` a round carries the next fault of :data:`FAULTS` (see :class:`SoakPlan`),
    injected while its lookups are in flight and cleared before the round ends. ``master_kills`` bounds
    master crashes (each costs seconds: Mooncake calls to a dead master block ~4.4 s).
    """
    config = dict(lookup_timeout_ms=timeout_ms, lookup_breaker_failures=20, lookup_breaker_cooldown_s=0.2,
                  lookup_max_pending=4096)
    work = shared_prefix_workload(workload_size, prefix_blocks=4, unique_blocks=4, num_prefixes=8, seed=seed)
    work += shared_prefix_workload(workload_size // 4, prefix_blocks=0, unique_blocks=8, seed=seed + 1)  # cold
    plan = SoakPlan(seed, work_size=len(work), fault_rate=fault_rate, master_kills=master_kills)
    tally = Tally()
    track = _Tracking()
    with FaultRig(transport, config=config, server_kwargs=dict(delay_ms=timeout_ms * 2)) as rig:
        rig.client.observers.add(tally)
        rig.store(work, lambda r: plan.stored_blocks())
        probe = next(r for r in work if rig.truth(r.num_tokens, r.block_hashes) > 0)
        gc.freeze()  # as vLLM's engine does once started (rigs/scheduler_driver.freeze_startup_heap)
        while track.done < lookups:
            track.rounds += 1
            if track.rss0 is None and track.done >= min(lookups // 20, 5000):
                track.rss0 = rss_bytes()
            fault = _soak_round(rig, plan, work, track, min(round_size, lookups - track.done), timeout_ms / 1000)
            if fault in RECOVERED_FAULTS:
                _recover(rig, work, probe, track, wiped=fault in WIPING_FAULTS)
            if progress is not None and track.rounds % 200 == 0:
                progress(f"{track.done} lookups, {dict(track.faults)}, {len(track.recoveries)} recoveries, "
                         f"rss {rss_bytes() / 2**20:.1f} MiB")
        return _report(rig, transport, tally, track, timeout_ms)


def _soak_round(rig: FaultRig, plan: SoakPlan, work: list[WorkloadRequest], track: _Tracking, size: int,
                timeout_s: float) -> str | None:
    """Admit one round, inject its fault (if any) while its lookups are in flight, poll until all answered.

    Returns the fault the round carried.
    """
    client = rig.client
    batch = [work[i] for i in plan.batch(size)]
    ids = [f"r{track.rounds}-{i}" for i in range(len(batch))]
    fault = plan.fault()
    rnd = _Round(ids, batch, {rid: client.start(rid, req.num_tokens, req.block_hashes)
                              for rid, req in zip(ids, batch)})
    cleanup: Callable[[], None] | None = None
    if fault is not None:
        track.faults[fault] += 1
        t_inject = time.perf_counter()
        cleanup = _inject(fault, rig, plan, rnd, work)
        rnd.inject_s = time.perf_counter() - t_inject
    _poll_round(rig, plan, rnd, track, timeout_s, cleanup)
    if client.pending:
        rig.violations.pending_left.append(client.pending)
    return fault


def _poll_round(rig: FaultRig, plan: SoakPlan, rnd: _Round, track: _Tracking, timeout_s: float,
                cleanup: Callable[[], None] | None) -> None:
    """Poll the round's open lookups once per step until each is answered (or was discarded by a storm).

    The fault is cleared (``cleanup``) after the second step, or at the end if the round ended sooner.
    """
    client = rig.client
    reqs = dict(zip(rnd.ids, rnd.batch))
    open_ids = [rid for rid in rnd.ids if client.has(rid)]
    steps = 0
    while open_ids:
        steps += 1
        open_ids = [rid for rid in open_ids if not _ask(rig, plan, rid, reqs[rid], rnd, track, timeout_s)]
        if cleanup is not None and steps == 2:
            cleanup()
            cleanup = None
        if open_ids:
            time.sleep(SOAK_STEP_S)  # stands in for the model's forward pass between scheduler steps
    if cleanup is not None:
        cleanup()


def _ask(rig: FaultRig, plan: SoakPlan, rid: str, req: WorkloadRequest, rnd: _Round, track: _Tracking,
         timeout_s: float) -> bool:
    """One scheduler call for ``rid``, timed and checked; True once its answer was used."""
    blocking = plan.blocking(rid)
    with collector_held():
        t0 = time.perf_counter()
        result = rig.client.lookup(rid, req.num_tokens, req.block_hashes, non_block=not blocking)
        t1 = time.perf_counter()
    track.max_call = max(track.max_call, t1 - t0)
    if blocking:
        track.blocking_calls.append(t1 - t0)
    if t1 - t0 > timeout_s + SLACK_S:
        rig.violations.slow_calls.append(t1 - t0)
    # The deadline runs from when the lookup was sent (time queued in the client is not the server's). One
    # still queued waits for the lookups ahead of it, as long as the server answers them: the client ends
    # it as soon as the one in flight misses its deadline (tests/test_faults_*.py hold that bound).
    rec = rnd.records[rid]
    deadline = (rec.t_start if rec.t_start is not None else rec.t_submit) + timeout_s
    if result is None:
        if rec.t_start is not None and t0 > deadline:  # told "ask again" after a sent lookup's deadline
            rig.violations.late_answers.append(t0 - deadline)
        return False
    if rnd.inject_s < 0.005:  # steps did not stop for the harness: the figure is the client's
        track.max_late = max(track.max_late, t1 - deadline)
    rig.check(rid, req.num_tokens, req.block_hashes, result, rec.t_submit)
    rig.client.discard(rid)
    track.done += 1
    return True


def _recover(rig: FaultRig, work: list[WorkloadRequest], probe: WorkloadRequest, track: _Tracking, *,
             wiped: bool) -> None:
    """After a fault that broke the path: put the truth back if it was ``wiped``, and time the recovery."""
    if wiped:
        rig.restore(work)
    took = rig.recovery_s(probe)
    if took is None:
        track.recoveries_failed += 1
    else:
        track.recoveries.append(took)


def _report(rig: FaultRig, transport: str, tally: Tally, track: _Tracking, timeout_ms: float) -> SoakReport:
    """The soak's figures and its verdict on every guarantee."""
    rss1 = rss_bytes()
    v = rig.violations
    report = SoakReport(
        transport=transport, lookups=track.done, seconds=round(time.perf_counter() - track.t_start, 1),
        outcomes=dict(tally.outcomes), faults=dict(track.faults), wrong_hits=len(v.wrong), stale_hits=len(v.stale),
        max_call_ms=round(track.max_call * 1000, 2), calls_over_bound=len(v.slow_calls),
        blocking_call_ms=_percentiles(track.blocking_calls), max_late_ms=round(track.max_late * 1000, 2),
        pending_left_rounds=len(v.pending_left),
        rss_growth_mb=round((rss1 - (track.rss0 or rss1)) / 2**20, 2),
        max_recovery_s=round(max(track.recoveries), 3) if track.recoveries else None,
        recoveries_failed=track.recoveries_failed, timeout_ms=timeout_ms, slack_ms=SLACK_S * 1000, ok=False,
        prefix_cache=rig.cache_figures(),
        examples={k: list(getattr(v, k))[:5] for k in ("wrong", "stale", "slow_calls", "late_answers",
                                                        "pending_left")})
    report.ok = (v.empty() and track.recoveries_failed == 0 and report.rss_growth_mb < 10
                 and (report.max_recovery_s or 0) < 5.0 and rig.client.pending == 0)
    return report


def _percentiles(values: array.array[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {}
    pick = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 3)  # noqa: E731
    return {"n": len(ordered), "p50": pick(0.5), "p99": pick(0.99), "p99.9": pick(0.999),
            "max": round(ordered[-1] * 1000, 3)}


def _inject(fault: str, rig: FaultRig, plan: SoakPlan, rnd: _Round,
            work: list[WorkloadRequest]) -> Callable[[], None] | None:
    """Start ``fault`` while the round's lookups are in flight; returns what clears it (or None).

    Lookups the fault restarts (a reset drops them, a reused id replaces them) get their new records.
    """
    client, ids, batch, records = rig.client, rnd.ids, rnd.batch, rnd.records
    if fault == "server_pause":
        rig.server.pause()
        return rig.server.resume
    if fault == "server_kill":
        rig.server.kill()
        return rig.server.start
    if fault == "store_delay":
        rig.server.set_delay(True)
        return lambda: rig.server.set_delay(False)
    if fault == "master_pause":
        rig.master.pause()
        return rig.master.resume
    if fault == "master_kill":
        rig.kill_master()
        return None
    if fault == "reset":
        rig.wipe()
        for rid, req in zip(ids, batch):  # the scheduler asks again: fresh lookups of the new generation
            records[rid] = client.start(rid, req.num_tokens, req.block_hashes)
        return None
    if fault == "abort_storm":  # every request of the round aborted at once, answered or not
        for rid in ids:
            client.discard(rid)
        return None
    if fault == "id_reuse":  # the same ids come back with other prompts: the old answers must not be served
        for i, rid in enumerate(ids[: len(ids) // 2]):
            other = work[plan.replacement()]
            client.discard(rid)
            batch[i] = other
            records[rid] = client.start(rid, other.num_tokens, other.block_hashes)
        return None
    raise ValueError(f"unknown fault {fault!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mooncake_lookout.connector.rigs.soak``: run a soak, print its figures (1 if a guarantee broke)."""
    p = argparse.ArgumentParser(prog="python -m mooncake_lookout.connector.rigs.soak",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--lookups", type=int, default=100_000)
    p.add_argument("--transport", choices=TRANSPORTS, default=PIPELINED)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault-rate", type=float, default=0.02, help="share of rounds that carry a fault")
    p.add_argument("--timeout-ms", type=float, default=50.0)
    p.add_argument("--master-kills", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    started = machine()
    report = run_soak(args.lookups, transport=args.transport, seed=args.seed, fault_rate=args.fault_rate,
                      timeout_ms=args.timeout_ms, master_kills=args.master_kills,
                      progress=lambda s: print(s, file=sys.stderr, flush=True))
    if args.json:  # with the run's settings and machine: the docs print them beside its figures
        settings = {"seed": args.seed, "fault_rate": args.fault_rate, "master_kills": args.master_kills}
        print(json.dumps({**asdict(report), "settings": settings,
                          "machine": {**started, "loadavg_at_end": load_average()}}, indent=2))
    else:
        print(report.as_text())
    return 0 if report.ok else 1


__all__ = ["CallBudget", "FAULTS", "FaultRig", "SendClock", "SoakPlan", "SoakReport", "Tally", "Violations",
           "collector_held", "main", "poll_until", "rss_bytes", "run_soak"]

if __name__ == "__main__":
    sys.exit(main())
