"""Observers: fan-out that survives a failing observer, and a background thread that keeps order and bounds memory."""

from __future__ import annotations

import threading

from mooncake_lookout.connector.events import (
    BackgroundObserver,
    LookupRecord,
    NullObserver,
    ObserverSet,
    Outcome,
    OutcomeCounter,
)


def _rec(i: int, outcome: Outcome = Outcome.HIT) -> LookupRecord:
    rec = LookupRecord(f"r{i}", 32, 2, "upstream", 0, 0.0)
    rec.outcome = outcome
    return rec


class Boom(NullObserver):
    def consumed(self, rec: LookupRecord) -> None:
        raise RuntimeError("observer bug")


class Order(NullObserver):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []

    def submitted(self, rec: LookupRecord) -> None:
        self.seen.append(("submitted", rec.req_id, threading.current_thread().name))

    def consumed(self, rec: LookupRecord) -> None:
        self.seen.append(("consumed", rec.req_id, threading.current_thread().name))


def test_a_failing_observer_does_not_stop_the_others() -> None:
    counter = OutcomeCounter()
    fan = ObserverSet([Boom(), counter])
    fan.consumed(_rec(1))
    assert counter.outcomes[Outcome.HIT] == 1


def test_only_overridden_events_are_dispatched() -> None:
    fan = ObserverSet([OutcomeCounter()])
    fan.started(_rec(1))  # OutcomeCounter has no 'started': nothing to call, nothing to fail
    assert fan._handlers["started"] == () and len(fan._handlers["consumed"]) == 1


def test_background_observer_keeps_order_off_the_callers_thread() -> None:
    order = Order()
    bg = BackgroundObserver(order, name="bg-test")
    fan = ObserverSet([bg])
    for i in range(100):
        fan.submitted(_rec(i))
        fan.consumed(_rec(i))
    assert bg.flush()
    assert [(e, r) for e, r, _ in order.seen] == [(e, f"r{i}") for i in range(100) for e in ("submitted", "consumed")]
    assert {t for _, _, t in order.seen} == {"bg-test"}
    bg.close()


def test_background_observer_survives_a_failing_observer_and_drops_past_its_backlog() -> None:
    gate = threading.Event()

    class Slow(OutcomeCounter):
        def consumed(self, rec: LookupRecord) -> None:
            gate.wait(5)
            if rec.req_id == "r0":
                raise RuntimeError("observer bug")
            super().consumed(rec)

    slow = Slow()
    bg = BackgroundObserver(slow, max_backlog=10, interval_s=0.001)
    for i in range(50):
        bg.consumed(_rec(i))
    assert bg.dropped >= 39  # at most one is being handled, ten wait, the rest are dropped, not queued
    gate.set()
    assert bg.flush()
    assert slow.outcomes[Outcome.HIT] == 50 - 1 - bg.dropped
    bg.close()
