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
    rec = LookupRecord(f"r{i}", 32, [b"h" * 32] * 2, "upstream", 0, 0.0)
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


def test_observers_added_after_the_client_hear_late_replies_breaker_changes_and_cache_clears(tmp_path) -> None:
    """vLLM's connector adds its metrics observers after building the client: the transport's late-reply
    callback, the breaker's change callback and the prefix cache's clears must reach them (they were bound
    once, at construction)."""
    from mooncake_lookout.connector.client import LookupClient
    from mooncake_lookout.connector.config import LookupConfig
    from mooncake_lookout.connector.transport.pipelined import PipelinedTransport

    class Listener(NullObserver):
        def __init__(self) -> None:
            self.late = 0
            self.changes: list[bool] = []
            self.clears: list[tuple[str, int]] = []

        def late_reply(self) -> None:
            self.late += 1

        def breaker_changed(self, is_open: bool) -> None:
            self.changes.append(is_open)

        def cache_cleared(self, reason: str, blocks: int) -> None:
            self.clears.append((reason, blocks))

    config = LookupConfig(lookup_transport="pipelined", lookup_breaker_failures=1)
    client = LookupClient(config, PipelinedTransport(f"ipc://{tmp_path}/nobody.sock", timeout_s=0.01))
    try:
        listener = Listener()
        client.observers.add(listener)
        client.transport.on_late_reply()  # what the transport calls for a reply whose lookup already ended
        client.breaker.failed(0.0, 0.0, timeout=False)  # one error event opens it (lookup_breaker_failures=1)
        assert client.enable_prefix_cache(16) and client.cache is not None
        client.cache.add([b"h" * 32], 0, 1, until=float("inf"))
        client.store_view.clear("epoch")  # what a reply naming a new store epoch does
        assert listener.late == 1 and listener.changes == [True] and listener.clears == [("epoch", 1)]
    finally:
        client.close()
