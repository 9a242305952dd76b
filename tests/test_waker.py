"""The waker wakes a polling thread without handing it the GIL (so it cannot run inside vLLM's ``schedule()``)."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import zmq

from mooncake_lookout.connector.waker import Waker

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)


def test_a_wake_reaches_a_polling_thread() -> None:
    waker = Waker()
    poller = zmq.Poller()
    poller.register(waker.fd, zmq.POLLIN)
    try:
        waker.wake()
        assert dict(poller.poll(1000)).get(waker.fd) == zmq.POLLIN
        waker.clear()
        assert poller.poll(0) == []
    finally:
        waker.close()
    waker.wake()  # after close: nothing is written (the descriptor may belong to someone else by now)


def test_waking_keeps_the_gil_so_the_woken_thread_runs_only_when_the_caller_lets_go() -> None:
    """A thread ready to run Python gets the GIL when the caller lets go of it. ``os.write`` lets go for the
    system call (the old wake: the other thread ran between wakes); the wake must not."""
    waker = Waker()
    ran = []
    ready = threading.Event()

    def other() -> None:
        ready.set()
        time.sleep(0.01)  # then wants the GIL while the caller is busy waking
        ran.append(time.perf_counter())

    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)  # no forced switch within the test: only a voluntary let-go hands the GIL over
    thread = threading.Thread(target=other)
    try:
        thread.start()
        ready.wait(5)
        end = time.perf_counter() + 0.1  # ten times the other thread's sleep
        wakes = 0
        while time.perf_counter() < end:
            waker.wake()
            wakes += 1  # plain Python between wakes: nothing else lets go
        ran_during_wakes = list(ran)
    finally:
        sys.setswitchinterval(old)
    thread.join(5)
    waker.close()
    assert wakes > 100
    assert ran_during_wakes == [], "the woken thread took the GIL in the middle of the caller's wakes"
    assert ran, "the other thread ran once the caller let go"
