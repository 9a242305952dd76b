"""What ``advise`` decides: the lookup settings the window's figures support, each with its reasons.

The rules, in the order they are applied (thresholds are the constants below):

* **Traffic.** Fewer than :data:`MIN_LOOKUPS` lookups or :data:`MIN_STEPS` scheduler steps in the window
  is too little to say anything (exit 4).
* **The step.** The step interval ``T`` is the mean time between scheduler steps (the median when idle
  gaps inflate the mean). ``b`` is the time one step spent inside the lookup path, ``T - b`` the step
  without it.
* **Contention is not failure.** Timeouts in fewer than :data:`CONTENTION_SHARE` of lookups, with no error and the
  breaker never open, are what a busy host alone costs (bench scenario (j) holds the defaults to that share with
  every core busy): no rule below treats them as a failing store or a deadline to raise, and nothing asks for a
  restart. Why 0.5%: each such timeout is one prompt recomputed, so below it the loss is under 0.5% of the
  store's hits, less than rolling a new setting out to every engine costs (the trial that prompted this read 4
  timeouts in 53,097 lookups, 0.0075%, as a reason to act). Timeouts whose replies mostly came late
  (:data:`SLOW_LATE` late replies per timeout or more) with the breaker never open are slowness, not failure:
  the server is alive (with the breaker open, they are the answers of a stall that ended).
* **lookup_async.** A store that fails (timeouts with no late reply, errors or breaker short-circuits in at least
  :data:`FAILING_SHARE` of lookups, or the breaker opened) -> ``true``: in sync mode each such lookup
  blocks the scheduler up to the deadline. In sync mode, ``b`` at least :data:`SYNC_SHARE` of ``T``
  -> ``true``: every request pays that slice of every step. Below it, sync stays (lookups are rare or fast:
  async would defer each request a step for little). Async stays async.
* **lookup_wait_us** (async only). A failing store -> ``0``: keep deferring, a wait would be spent on
  answers that do not come. Otherwise the round trip's p90 plus the auto margin against the largest wait
  auto allows, ``lookup_wait_auto_share x (T - b)``: if it fits, ``auto`` (it waits about the p90 and uses
  most answers in the step they were asked for; a fixed budget that already covers the p90 and fits is
  kept); if not, ``0`` (a wait shorter than the round trip adds blocked time without saving deferrals).
  In sync mode the call waits for its reply, so the round trip is exact. In async mode an answer nobody
  waited for is read at the next step, so the round trip read is only an upper bound: when answers are
  there by the next step (deferred steps p90 <= 1) the round trip is under a step and ``auto`` finds out
  whether it fits (and stops waiting if not); answers later than that -> ``0``.
* **lookup_timeout_ms.** Kept below :data:`CONTENTION_SHARE` (above). Raised (doubled) only when timeouts are
  real: lookups timed out *and* answers kept coming right up to the deadline (at least :data:`NEAR_DEADLINE`
  answers in the last half before the deadline per timeout: a latency tail the deadline cuts), or their replies
  came late (a server slower than the deadline, alive). Timeouts while answers stayed far below the
  deadline mean the store stalled: a longer deadline would only hold requests (and a sync scheduler)
  longer for answers that do not come.
* **Bounds.** ``lookup_max_pending`` is doubled after rejections or a peak at :data:`NEAR_BOUND` of it,
  unless the store was failing (then the pile-up waits on the store, not the bound); ``lookup_max_held``
  is doubled after evictions or a peak near it.
* **Transport.** ``upstream`` with more than one lookup per step -> ``pipelined`` (one lookup in flight
  makes a step's lookups wait for each other).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from mooncake_lookout.connector.cli.advise_prom import AdviseError, Figures, bucket_quantile, count_upto
from mooncake_lookout.connector.config import KEYS_BY_NAME, ConfigError, LookupConfig
from mooncake_lookout.connector.events import Outcome
from mooncake_lookout.connector.transport.names import PIPELINED, UPSTREAM
from mooncake_lookout.connector.wait_budget import MARGIN_S
from mooncake_lookout.metrics import catalogue as cat

MIN_LOOKUPS = 100
MIN_STEPS = 100
SYNC_SHARE = 0.05  # sync's blocked share of the step above which async pays off
FAILING_SHARE = 0.01  # share of lookups ending in timeout/error/breaker_open that marks a failing store
CONTENTION_SHARE = 0.005  # timeouts below this share, breaker closed, no error: a busy host, not a setting to change
SLOW_LATE = 0.5  # late replies per timeout from which timeouts are slowness (the server alive), not failure
NEAR_DEADLINE = 0.2  # answers in the last half before the deadline per timeout that mark a tail the deadline cuts
NEAR_BOUND = 0.8
IDLE_SKEW = 1.5  # a mean step interval over this many medians is inflated by idle gaps: use the median
FAILURES = (Outcome.TIMEOUT.value, Outcome.ERROR.value, Outcome.BREAKER_OPEN.value)
DECIDED = ("lookup_async", "lookup_wait_us", "lookup_timeout_ms", "lookup_max_pending", "lookup_max_held",
           "lookup_transport")


@dataclass(frozen=True)
class InForce:
    """The configuration the window ran with, read off the ``info`` series (defaults for labels it lacks)."""

    mode: str
    transport: str
    lookup_async: bool
    lookup_wait_us: int | str | None  # None: the exporter predates the label
    auto_share: float
    timeout_ms: float
    block_ms: float  # sync mode: the longest one call blocks (past it the request is deferred)
    max_pending: int

    @classmethod
    def from_labels(cls, labels: dict[str, str]) -> InForce:
        """Parse ``info`` labels (strings) into typed settings."""
        def key(name: str) -> Any:
            return KEYS_BY_NAME[name].default

        wait = labels.get("lookup_wait_us")
        is_async = labels.get("lookup_async", "false") == "true"
        auto = LookupConfig(lookup_async=is_async)
        timeout = float(labels.get("lookup_timeout_ms") or auto.lookup_timeout_ms)
        block = min(float(labels.get("lookup_block_ms") or auto.lookup_block_ms), timeout)  # absent: an older exporter
        return cls(mode=labels.get("mode", "?"), transport=labels.get("transport", key("lookup_transport")),
                   lookup_async=is_async,
                   lookup_wait_us=None if wait is None else (wait if wait == "auto" else int(float(wait))),
                   auto_share=float(labels.get("lookup_wait_auto_share", key("lookup_wait_auto_share"))),
                   timeout_ms=timeout, block_ms=block,
                   max_pending=int(float(labels.get("lookup_max_pending", key("lookup_max_pending")))))


@dataclass(frozen=True)
class Costs:
    """What the mode in force cost over the window, per step and per request (seconds)."""

    lookups: float
    steps: float
    lookups_per_step: float
    step_s: float  # T
    blocked_per_step_s: float  # b
    blocked_share: float  # b / T
    base_step_s: float  # T - b
    blocked_per_lookup_s: float
    deferred_mean: float
    deferred_p90: float | None
    deferral_delay_s: float  # deferred steps x T: what deferral adds to a request's wait
    failures: float
    failing_share: float
    failing: bool
    timeouts: float
    contention: bool  # timeouts below CONTENTION_SHARE, no error, the breaker never open: a busy host alone
    slow: bool  # most timed-out lookups' replies came late: the server is alive, slower than the deadline
    rpc_p50_s: float | None  # round trips of lookups answered by their deadline (timeouts left out)
    rpc_p90_s: float | None
    rpc_p99_s: float | None
    answered_in_time: float
    near_deadline: float  # answered in the last half before the deadline


@dataclass
class Advice:
    """One setting: the value advised, the value in force, why (one sentence) and the figures behind it."""

    key: str
    value: Any
    current: Any
    reason: str
    figures: dict[str, float | None] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        """True when the advice differs from what runs."""
        return self.current is None or str(self.value) != str(self.current)


def costs(f: Figures, now: InForce) -> Costs:
    """The per-step and per-request costs; :class:`AdviseError` (code 4) when the window is too quiet.

    Round trips come from the histogram's buckets up to the deadline: a timed-out lookup is recorded at the
    moment it was given up on, at or past the deadline, so the buckets beyond it are timeouts, not answers.
    """
    lookups = f.lookups
    if lookups >= MIN_LOOKUPS and not f.steps:
        raise AdviseError(f"{lookups:.0f} lookups but no {cat.STEP_INTERVAL_SECONDS.name} under {f.selector}: the "
                          "deployment runs a mooncake-lookout that does not count scheduler steps yet; upgrade it",
                          code=3)
    if lookups < MIN_LOOKUPS or f.steps < MIN_STEPS:
        raise AdviseError(f"too little traffic under {f.selector} in the last {f.window}: {lookups:.0f} lookups "
                          f"in {f.steps:.0f} scheduler steps (advise needs at least {MIN_LOOKUPS} and {MIN_STEPS}); "
                          "widen --window or wait for traffic", code=4)
    step = f.step_mean_s or 0.0
    if f.step_p50_s and step > IDLE_SKEW * f.step_p50_s:
        step = f.step_p50_s
    blocked = f.blocked_s / f.steps
    base = max(step - blocked, 0.1 * step)
    deferred = f.deferred_sum / f.deferred_count if f.deferred_count else 0.0
    failures = sum(f.outcomes.get(o, 0.0) for o in FAILURES)
    share = failures / lookups
    timeouts = f.outcomes.get(Outcome.TIMEOUT.value, 0.0)
    errors = f.outcomes.get(Outcome.ERROR.value, 0.0)
    contention = not f.breaker_opened and not errors and failures < CONTENTION_SHARE * lookups
    # Late replies after a silence long enough to open the breaker are a stall that ended, not a slow server.
    slow = timeouts > 0 and f.late_replies >= SLOW_LATE * timeouts and not f.breaker_opened
    deadline = now.timeout_ms / 1e3
    answered = count_upto(f.rpc_buckets, deadline)
    rpc_p50, rpc_p90, rpc_p99 = (bucket_quantile(f.rpc_buckets, q, deadline) for q in (0.5, 0.9, 0.99))
    return Costs(lookups=lookups, steps=f.steps, lookups_per_step=lookups / f.steps, step_s=step,
                 blocked_per_step_s=blocked, blocked_share=blocked / step if step else 0.0, base_step_s=base,
                 blocked_per_lookup_s=f.blocked_s / lookups, deferred_mean=deferred, deferred_p90=f.deferred_p90,
                 deferral_delay_s=deferred * step, failures=failures, failing_share=share,
                 failing=not contention and (f.breaker_opened or (share >= FAILING_SHARE and not slow)),
                 timeouts=timeouts, contention=contention, slow=slow, rpc_p50_s=rpc_p50, rpc_p90_s=rpc_p90,
                 rpc_p99_s=rpc_p99, answered_in_time=answered,
                 near_deadline=answered - count_upto(f.rpc_buckets, deadline / 2))


def in_force(f: Figures) -> InForce:
    """The one configuration in force under the selector; :class:`AdviseError` when there are several."""
    if not f.configs:
        raise AdviseError(f"no {cat.INFO.name} series in force under {f.selector}: the lookup path's exporter is not "
                          "scraped now (check the target, or the selector)", code=3)
    if len(f.configs) > 1:
        modes = "; ".join(f"{c.get('mode')} ({c.get('transport')})" for c in f.configs)
        raise AdviseError(f"{f.selector} covers {len(f.configs)} lookup configurations ({modes}): narrow "
                          "--selector to one deployment", code=3)
    return InForce.from_labels(f.configs[0])


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e6, 1)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f} ms"


def decide_async(f: Figures, c: Costs, now: InForce) -> Advice:
    """``lookup_async``: leave sync when it costs a noticeable share of the step or the store fails."""
    figures = {"blocked_per_step_us": _us(c.blocked_per_step_s), "step_us": _us(c.step_s),
               "blocked_share": round(c.blocked_share, 4), "failing_share": round(c.failing_share, 4)}
    if now.lookup_async:
        return Advice("lookup_async", True, True, f"async keeps the scheduler free: it spent "
                      f"{_ms(c.blocked_per_step_s)} of each {_ms(c.step_s)} step interval ({c.blocked_share:.1%}) in "
                      f"lookups; requests waited {c.deferred_mean:.2f} steps for answers", figures)
    if c.failing:
        return Advice("lookup_async", True, False, f"the store failed or stalled ({c.failing_share:.1%} of lookups "
                      f"ended in timeout/error/breaker{', the breaker opened' if f.breaker_opened else ''}): in "
                      f"sync mode each of them blocks the scheduler up to lookup_block_ms "
                      f"({now.block_ms:g} ms)", figures)
    if c.blocked_share >= SYNC_SHARE:
        return Advice("lookup_async", True, False, f"sync blocks the scheduler {_ms(c.blocked_per_step_s)} of "
                      f"every {_ms(c.step_s)} step interval ({c.blocked_share:.1%} >= {SYNC_SHARE:.0%}): every request "
                      "pays it; async frees that time and defers only the requests whose answer is late", figures)
    return Advice("lookup_async", False, False, f"sync costs {c.blocked_share:.1%} of the step (< {SYNC_SHARE:.0%}): "
                  "lookups are rare or fast, async would defer each request a step for little gain", figures)


def decide_wait(f: Figures, c: Costs, now: InForce, use_async: bool) -> Advice:
    """``lookup_wait_us``: ``auto`` when the round trip fits auto's cap, else 0 (defer at once)."""
    current = now.lookup_wait_us
    cap = now.auto_share * c.base_step_s
    need = None if c.rpc_p90_s is None else c.rpc_p90_s + MARGIN_S
    figures = {"rpc_p90_us": _us(c.rpc_p90_s), "auto_margin_us": _us(MARGIN_S), "step_without_lookups_us":
               _us(c.base_step_s), "auto_share": now.auto_share, "auto_cap_us": _us(cap),
               "deferred_steps_mean": round(c.deferred_mean, 3), "budget_in_force_us": _us(f.budget_now_s)}
    if not use_async:
        return Advice("lookup_wait_us", current if current is not None else 0, current,
                      "not used while lookup_async is false", figures)
    if c.failing:
        return Advice("lookup_wait_us", 0, current, f"keep deferring: {c.failing_share:.1%} of lookups got no "
                      "answer in time; a wait would be spent on answers that do not come, while a deferral "
                      "already frees the scheduler", figures)
    if need is None:
        return Advice("lookup_wait_us", 0, current, "no answered round trip in the window to size a wait by",
                      figures)
    fixed = current if isinstance(current, int) and now.mode == "budget" else None
    if need <= cap and fixed is not None and c.rpc_p90_s is not None and fixed * 1e-6 >= c.rpc_p90_s \
            and fixed * 1e-6 <= cap:
        return Advice("lookup_wait_us", fixed, current, f"{fixed} us already covers the round trip's p90 "
                      f"({_ms(c.rpc_p90_s)}) within auto's cap ({_ms(cap)}): keep it", figures)
    saved = f" (now {c.deferred_mean:.2f} steps, {_ms(c.deferral_delay_s)} per request)" if c.deferred_mean else ""
    if need <= cap:
        return Advice("lookup_wait_us", "auto", current, f"the round trip's p90 {_ms(c.rpc_p90_s)} + "
                      f"{_ms(MARGIN_S)} fits in {now.auto_share:g} x the {_ms(c.base_step_s)} step without lookups "
                      f"({_ms(cap)}): auto waits about that long and uses most answers in the step they were asked for"
                      f"{saved}", figures)
    too_long = (f"{now.auto_share:g} x the {_ms(c.base_step_s)} step without lookups ({_ms(cap)}): a wait that short "
                "would mostly run out, adding blocked time without saving deferrals; defer at once")
    if now.lookup_async is False:  # a sync call waits for its reply: the round trip is measured exactly
        return Advice("lookup_wait_us", 0, current, f"the round trip's p90 {_ms(c.rpc_p90_s)} + {_ms(MARGIN_S)} "
                      f"exceeds {too_long}", figures)
    # Async: an answer nobody waited for is read at the next step, so the round trip read is an upper bound.
    if c.deferred_p90 is not None and c.deferred_p90 <= 1:
        return Advice("lookup_wait_us", "auto", current, f"answers are there by the next step (deferred steps "
                      f"p90 {c.deferred_p90:.1f}, mean {c.deferred_mean:.2f}, {_ms(c.deferral_delay_s)} per request): "
                      f"the round trip is under the {_ms(c.step_s)} step interval (read "
                      f"here as p90 {_ms(c.rpc_p90_s)}, since an answer not waited for is read a step later); "
                      f"auto measures it while waiting, waits about it but at most {_ms(cap)}, and stops "
                      "waiting if most waits that long run out", figures)
    return Advice("lookup_wait_us", 0, current, f"answers take more than a step to be used (deferred steps p90 "
                  f"{c.deferred_p90 if c.deferred_p90 is not None else 'n/a'}): the round trip exceeds {too_long}",
                  figures)


def _nice_ms(ms: float) -> float:
    """``ms`` rounded up to 1, 2 or 5 times a power of ten."""
    power = 10 ** math.floor(math.log10(ms))
    return float(next(m * power for m in (1, 2, 5, 10) if m * power >= ms))


def decide_timeout(f: Figures, c: Costs, now: InForce) -> Advice:
    """``lookup_timeout_ms``: raised only when the deadline cuts a tail of real answers."""
    timeouts = f.outcomes.get(Outcome.TIMEOUT.value, 0.0)
    figures = {"timeouts": timeouts, "answered_in_time": c.answered_in_time, "answered_in_last_half_before_deadline":
               c.near_deadline, "rpc_p99_us": _us(c.rpc_p99_s), "deadline_ms": now.timeout_ms}
    half = f"({now.timeout_ms / 2:g}, {now.timeout_ms:g}] ms"
    figures["late_replies"] = f.late_replies
    if timeouts and c.contention:
        return Advice("lookup_timeout_ms", now.timeout_ms, now.timeout_ms, f"{timeouts:.0f} timeouts in "
                      f"{c.lookups:.0f} lookups ({timeouts / c.lookups:.3%}), no error, the breaker never open: below "
                      f"the {CONTENTION_SHARE:.1%} a busy host alone costs (bench scenario (j)); slowness under load, "
                      "not a deadline to change nor a reason to restart anything", figures)
    if timeouts and c.slow:
        value = min(60_000.0, _nice_ms(2 * now.timeout_ms))
        return Advice("lookup_timeout_ms", value, now.timeout_ms, f"{f.late_replies:.0f} late replies for "
                      f"{timeouts:.0f} timeouts: the server is alive and answers after the deadline; each timeout is a "
                      "recompute an answer would have saved (raise it, then re-run advise)", figures)
    if timeouts and c.near_deadline >= NEAR_DEADLINE * timeouts:
        value = min(60_000.0, _nice_ms(2 * now.timeout_ms))
        return Advice("lookup_timeout_ms", value, now.timeout_ms, f"answers come right up to the deadline: "
                      f"{c.near_deadline:.0f} answered in {half}, {timeouts:.0f} timed out; the deadline cuts off a "
                      "tail of answers that were coming (raise it, then re-run advise)", figures)
    if timeouts:
        return Advice("lookup_timeout_ms", now.timeout_ms, now.timeout_ms, f"{timeouts:.0f} lookups timed out but "
                      f"only {c.near_deadline:.0f} were answered in {half} (answered p99 {_ms(c.rpc_p99_s)}): the "
                      f"store stalled rather than ran slow; a longer deadline would only hold requests"
                      f"{'' if now.lookup_async else ' and the scheduler'} longer for answers that do not come",
                      figures)
    return Advice("lookup_timeout_ms", now.timeout_ms, now.timeout_ms, f"no timeouts; answers read by p99 "
                  f"{_ms(c.rpc_p99_s)} ({(c.rpc_p99_s or 0) * 1e3 / now.timeout_ms:.1%} of the deadline)", figures)


def _grown(bound: float, limit: int) -> int:
    return min(limit, 1 << math.ceil(math.log2(2 * bound)))


def decide_max_pending(f: Figures, c: Costs, now: InForce) -> Advice:
    """``lookup_max_pending``: doubled after rejections or a peak near it, unless the store was failing."""
    bound = f.max_pending or now.max_pending
    peak = f.pending_peak or 0.0
    rejected = f.outcomes.get(Outcome.REJECTED.value, 0.0)
    figures = {"pending_peak": peak, "bound": bound, "rejected": rejected}
    if (rejected or peak >= NEAR_BOUND * bound) and not c.failing:
        return Advice("lookup_max_pending", _grown(bound, 1_000_000), now.max_pending, f"{rejected:.0f} lookups "
                      f"rejected, peak {peak:.0f} pending against a bound of {bound:.0f}: bursts outgrow it", figures)
    why = f"peak {peak:.0f} pending ({peak / bound:.0%} of the bound), {rejected:.0f} rejected"
    if rejected or peak >= NEAR_BOUND * bound:
        why += "; the pile-up waited on a failing store, which a larger bound would not fix"
    return Advice("lookup_max_pending", int(bound), now.max_pending, why, figures)


def decide_max_held(f: Figures, c: Costs) -> Advice:
    """``lookup_max_held``: doubled after evictions or a peak near it."""
    bound = f.max_held or float(KEYS_BY_NAME["lookup_max_held"].default)
    peak = f.held_peak or 0.0
    evicted = f.dropped.get("evicted", 0.0)
    figures = {"held_peak": peak, "bound": bound, "evicted": evicted, "expired": f.dropped.get("expired", 0.0)}
    if evicted or peak >= NEAR_BOUND * bound:
        return Advice("lookup_max_held", _grown(bound, 10_000_000), int(bound), f"{evicted:.0f} held answers "
                      f"evicted, peak {peak:.0f} held against a bound of {bound:.0f}: evicted answers are asked "
                      "again", figures)
    return Advice("lookup_max_held", int(bound), int(bound), f"peak {peak:.0f} answers held ({peak / bound:.1%} of "
                  "the bound), none evicted", figures)


def decide_transport(c: Costs, now: InForce) -> Advice:
    """``lookup_transport``: pipelined when the upstream wire has more than one lookup per step to carry."""
    figures = {"lookups_per_step": round(c.lookups_per_step, 3)}
    if now.transport == UPSTREAM and c.lookups_per_step > 1:
        return Advice("lookup_transport", PIPELINED, now.transport, f"{c.lookups_per_step:.1f} lookups per step on "
                      "a wire with one lookup in flight wait for each other; pipelined sends a step's lookups in "
                      "one frame", figures)
    return Advice("lookup_transport", now.transport, now.transport, f"{now.transport}, "
                  f"{c.lookups_per_step:.1f} lookups per step", figures)


def decide(f: Figures) -> tuple[InForce, Costs, list[Advice]]:
    """The configuration in force, its costs and one :class:`Advice` per key of :data:`DECIDED`."""
    now = in_force(f)
    c = costs(f, now)
    use_async = decide_async(f, c, now)
    advice = [use_async, decide_wait(f, c, now, bool(use_async.value)), decide_timeout(f, c, now),
              decide_max_pending(f, c, now), decide_max_held(f, c), decide_transport(c, now)]
    extra = settings(advice)
    try:  # the advice must be a configuration the connector accepts (its own checks, not a copy)
        LookupConfig.from_extra_config(extra)
    except ConfigError as e:  # a rule produced an out-of-range value: a bug, said plainly
        raise AdviseError(f"advise produced an invalid setting ({e}); please report it", code=1) from e
    return now, c, advice


def settings(advice: list[Advice]) -> dict[str, Any]:
    """The advised ``kv_connector_extra_config`` entries, in :data:`DECIDED` order."""
    by_key = {a.key: a.value for a in advice}
    return {k: by_key[k] for k in DECIDED if k in by_key}


__all__ = ["Advice", "CONTENTION_SHARE", "Costs", "DECIDED", "FAILING_SHARE", "InForce", "MIN_LOOKUPS", "MIN_STEPS",
           "NEAR_BOUND", "NEAR_DEADLINE", "SLOW_LATE", "SYNC_SHARE",
           "costs", "decide", "in_force", "settings"]
