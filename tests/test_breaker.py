"""The circuit breaker's arithmetic (connector/breaker.py), on a fake clock: slow is not dead.

A fake clock and hand-fed outcomes, because what is checked here is counting (events, windows, rates), not
timing; the same rules against a real slow and a real dead lookup server: tests/test_faults_breaker.py.
"""

from __future__ import annotations

from mooncake_lookout.connector.breaker import CircuitBreaker


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Heard:
    """Late replies so far, as a transport counts them."""

    def __init__(self) -> None:
        self.late = 0

    def __call__(self) -> int:
        return self.late


def breaker(**kw: float) -> tuple[CircuitBreaker, Clock, Heard, list[bool]]:
    clock, heard, changes = Clock(), Heard(), []
    b = CircuitBreaker(int(kw.pop("failures", 5)), kw.pop("cooldown_s", 5.0), probe_timeout_s=0.1,
                       rate=kw.pop("rate", 0.5), window_s=kw.pop("window_s", 10.0), heard=heard,
                       on_change=changes.append, clock=clock)
    return b, clock, heard, changes


def test_one_frame_of_16_lookups_timing_out_together_is_one_event() -> None:
    b, _, _, changes = breaker(failures=5)
    for _ in range(16):  # one send at t=1.0, timed out by one poll at t=1.1
        b.failed(1.0, 1.1, timeout=True)
    assert b.closed and changes == []
    for i in range(3):  # three more frames, each its own send and poll: 4 events
        for _ in range(16):
            b.failed(2.0 + i, 2.1 + i, timeout=True)
    assert b.closed
    b.failed(9.0, 9.1, timeout=True)  # the fifth distinct silent send: a dead server
    assert not b.closed and changes == [True]


def test_lookups_of_different_sends_timed_out_by_one_poll_are_one_event() -> None:
    """A starved scheduler thread that wakes up and times out many frames at once saw one stall, not many."""
    b, _, _, _ = breaker(failures=2)
    for i in range(10):
        b.failed(1.0 + i * 0.01, 3.0, timeout=True)
    assert b.closed


def test_a_late_reply_turns_the_silent_timeouts_before_it_into_slowness() -> None:
    b, _, heard, changes = breaker(failures=5)
    for i in range(4):
        b.failed(float(i), i + 0.1, timeout=True)
    heard.late += 1  # the first one's reply came after its deadline: the server is alive
    for i in range(4, 20):  # timeouts sent before the server was last heard from are slow, not dead
        b.failed(float(i), i + 0.1, timeout=True)
        heard.late += 1
    assert b.closed and changes == []


def test_a_timeout_sent_before_an_answer_came_is_slowness() -> None:
    b, _, _, _ = breaker(failures=1)
    b.answered(1.0, 1.5)  # the server answered a lookup at 1.5
    b.failed(1.2, 1.6, timeout=True)  # sent at 1.2, before that answer: the server was heard since
    assert b.closed
    b.failed(2.0, 2.1, timeout=True)  # sent at 2.0, nothing heard since: silence
    assert not b.closed


def test_errors_open_on_a_rate_over_the_window_with_a_minimum_volume() -> None:
    b, _, _, _ = breaker(failures=5, rate=0.5, window_s=10.0)
    t = 0.0
    for _ in range(100):  # 100 answered sends
        t += 0.01
        b.answered(t, t + 0.001)
    for _ in range(10):  # 10 error events among them: 10 / 110, below the rate
        t += 0.01
        b.failed(t, t + 0.001, timeout=False)
        b.answered(t + 0.005, t + 0.006)
    assert b.closed
    b2, _, _, _ = breaker(failures=5, rate=0.5, window_s=10.0)
    for i in range(12):  # errors and answers alternating: 50%, open once the volume (5 error events) is reached
        b2.answered(i + 0.0, i + 0.01)
        b2.failed(i + 0.5, i + 0.51, timeout=False)
        if not b2.closed:
            break
    assert not b2.closed and i == 4


def test_failures_spread_wider_than_the_window_never_reach_the_volume() -> None:
    b, _, _, _ = breaker(failures=3, window_s=1.0)
    for i in range(20):  # one error event every 2 s, each after an answer: never 3 in a window
        b.answered(2.0 * i, 2.0 * i + 0.01)
        b.failed(2.0 * i + 1, 2.0 * i + 1.01, timeout=False)
    assert b.closed


def test_half_open_closes_on_a_late_reply_and_reopens_on_a_silent_probe() -> None:
    b, clock, heard, changes = breaker(failures=1, cooldown_s=5.0)
    b.failed(0.0, 0.1, timeout=True)
    assert not b.closed
    clock.now = 1.0
    assert not b.allow()  # cooling down
    clock.now = 5.2
    assert b.allow()  # half-open: one probe
    assert not b.allow()  # while it is out, no other
    b.failed(5.2, 5.3, timeout=True)  # the probe heard nothing: open again
    assert not b.closed and changes == [True]
    clock.now = 10.4
    heard.late += 1  # a reply came late meanwhile: the server is alive
    assert b.allow() and b.closed and changes == [True, False]
    b.failed(11.0, 11.1, timeout=True)  # the window starts fresh after closing: one new event opens it again
    assert not b.closed


def test_an_answered_probe_closes_it_and_the_old_failures_are_forgotten() -> None:
    b, clock, _, changes = breaker(failures=2, cooldown_s=1.0)
    b.failed(0.0, 0.1, timeout=False)
    b.failed(1.0, 1.1, timeout=False)
    assert not b.closed
    b.answered(0.5, 1.2)  # sent before it opened: an erroring store that answers some lookups must not flap
    assert not b.closed
    clock.now = 2.2
    assert b.allow()
    b.answered(2.2, 2.3)  # the probe
    assert b.closed and changes == [True, False]
    b.failed(2.0, 2.1, timeout=False)
    assert b.closed  # one event since closing
