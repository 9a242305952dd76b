"""Bounded waits that end on time: the waiting thread's timer slack, tightened for the length of the wait.

Why: Linux may fire a sleeping thread's timer up to its timer slack late (50 us by default), on top of the
wake-up itself. On these VMs a 300 us ``select`` that ran out returned 95-100 us late (p50); with a 1 us slack,
45-50 us. A scheduler call that waits for an answer is bounded by the step's budget (``lookup_wait_us``) or the
lookup's deadline, and whatever the wait overruns is time vLLM's ``schedule()`` pays, in exactly the calls
that set its p99. The slack is restored after the wait: the rest of vLLM's thread keeps its own.

Linux only (``prctl(PR_SET_TIMERSLACK)``, per thread); elsewhere :class:`tight_slack` does nothing. The prctl
calls keep the GIL (``ctypes.PyDLL``): they never block, and letting go of the GIL mid-call would let another
thread in.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

TIGHT_NS = 1_000  # the slack during a bounded wait (the kernel's floor is 1 ns; 1 us is already below a wake-up)
_PR_SET_TIMERSLACK, _PR_GET_TIMERSLACK = 29, 30


def _libc_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.PyDLL(None).prctl
    except (OSError, AttributeError):  # pragma: no cover - no libc symbols in the process image
        return None
    prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong)
    prctl.restype = ctypes.c_int
    return prctl


_PRCTL = _libc_prctl()


def slack_ns() -> int:
    """This thread's timer slack in nanoseconds (-1 where it cannot be read)."""
    return _PRCTL(_PR_GET_TIMERSLACK, 0, 0, 0, 0) if _PRCTL is not None else -1


class tight_slack:  # lower case: used as a statement, ``with tight_slack():``, like contextlib's helpers
    """For the ``with`` block: this thread's timer slack at :data:`TIGHT_NS`, then its own again (left alone where it
    is already as tight, or cannot be read)."""

    __slots__ = ("_own",)

    def __enter__(self) -> None:
        self._own = own = slack_ns()
        if own > TIGHT_NS and _PRCTL is not None:
            _PRCTL(_PR_SET_TIMERSLACK, TIGHT_NS, 0, 0, 0)

    def __exit__(self, *exc: object) -> None:
        if self._own > TIGHT_NS and _PRCTL is not None:  # never 0: that resets the slack to the thread's default
            _PRCTL(_PR_SET_TIMERSLACK, self._own, 0, 0, 0)


__all__ = ["TIGHT_NS", "slack_ns", "tight_slack"]
