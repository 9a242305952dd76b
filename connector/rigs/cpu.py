"""CPU time a process has used, read from its ``/proc`` entry: the master's cost, apart from everyone else's.

Why: on a shared machine, wall time says little about what one process costs; the kernel's own accounting of
the process does. Two readings of the same process, from two clocks:

* :func:`thread_cpu_s`: the sum over the process's live threads of ``/proc/PID/task/TID/schedstat``'s first
  field, the scheduler's on-CPU time of the thread (``sum_exec_runtime``, nanoseconds, kept by the kernel's
  scheduler clock): fine enough for a few thousand lookups. A thread that exits between two readings takes its
  time with it: :class:`CpuMeter` counts such threads (``exited``), so a reading they make short is known (the
  Mooncake master keeps its threads for its whole life);
* :func:`tick_cpu_s`: ``utime + stime`` of ``/proc/PID/stat``, in clock ticks (``SC_CLK_TCK``, 100 a second
  here): whole-process, exited threads included, but 10 ms coarse. A cross-check of the first.

:class:`CpuMeter` reads both before and after a window.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CLOCK_SOURCE = ("the kernel scheduler's per-thread on-CPU time (/proc/PID/task/TID/schedstat, nanoseconds), summed "
                "over the process's threads; cross-checked against utime+stime of /proc/PID/stat (clock ticks)")


def thread_cpu_s(pid: int) -> float:
    """Seconds on a CPU of every live thread of ``pid`` (scheduler clock, nanosecond resolution)."""
    return sum(thread_times_ns(pid).values()) / 1e9


def tick_cpu_s(pid: int) -> float:
    """Seconds of user and system time of ``pid`` and every thread it has had (clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def thread_times_ns(pid: int) -> dict[int, int]:
    """Each live thread of ``pid`` and its on-CPU nanoseconds (scheduler clock)."""
    out = {}
    for path in glob.glob(f"/proc/{pid}/task/*/schedstat"):
        try:
            with open(path) as f:
                out[int(path.split("/")[4])] = int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread exited while we read
            continue
    if not out and not os.path.exists(f"/proc/{pid}"):
        raise ProcessLookupError(f"no process {pid}")
    return out


@dataclass
class CpuReading:
    """CPU seconds of one process over a window, on both clocks; ``exited``: threads that ended within it (their
    time after the window opened is missing from ``threads_s``)."""

    threads_s: float
    ticks_s: float
    exited: int = 0


class CpuMeter:
    """CPU time a process used between :meth:`mark` and :meth:`used`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.mark()

    def mark(self) -> None:
        """Start a new window now."""
        self._threads = thread_times_ns(self.pid)
        self._ticks = tick_cpu_s(self.pid)

    def used(self) -> CpuReading:
        """CPU seconds since the window started, on both clocks (threads born within it count whole)."""
        now = thread_times_ns(self.pid)
        ticks = tick_cpu_s(self.pid)
        spent = sum(ns - self._threads.get(tid, 0) for tid, ns in now.items())
        exited = sum(1 for tid in self._threads if tid not in now)
        return CpuReading(spent / 1e9, ticks - self._ticks, exited)


__all__ = ["CLOCK_SOURCE", "CLOCK_TICKS", "CpuMeter", "CpuReading", "thread_cpu_s", "thread_times_ns", "tick_cpu_s"]
