"""Child processes the tools start (a Mooncake master, a lookup server): state, freeze, thaw, die with parent."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable


def process_state(pid: int) -> str | None:
    """The one-letter state from ``/proc/PID/stat`` (``T`` = stopped), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def signal_and_wait(pid: int, sig: signal.Signals, reached: Callable[[str | None], bool], timeout_s: float,
                    what: str) -> None:
    """Send ``sig`` to ``pid`` and return once its state satisfies ``reached``; TimeoutError naming ``what``."""
    os.kill(pid, sig)
    deadline = time.perf_counter() + timeout_s
    while not reached(process_state(pid)):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{what} (pid {pid}) did not reach the state after {sig.name} in {timeout_s}s")
        time.sleep(0.002)


def freeze(pid: int, timeout_s: float, what: str) -> None:
    """SIGSTOP ``pid`` and return once the kernel reports it stopped (a hung process, for fault tests)."""
    signal_and_wait(pid, signal.SIGSTOP, lambda s: s == "T", timeout_s, what)


def thaw(pid: int, timeout_s: float, what: str) -> None:
    """SIGCONT ``pid`` and return once it runs again."""
    signal_and_wait(pid, signal.SIGCONT, lambda s: s not in ("T", "t"), timeout_s, what)


def stop_process(proc: subprocess.Popen, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 5.0) -> None:
    """Stop ``proc`` by pid: ``sig`` (SIGCONT first, since a paused process cannot act on SIGTERM), then
    SIGKILL if it has not exited after ``timeout_s``; always reaped."""
    if proc.poll() is None:
        try:
            if sig == signal.SIGTERM:
                os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to SIGKILL the child when the thread that started it dies (None off Linux).

    ``prctl`` is looked up here, in the parent: the child between fork and exec must not import.
    """
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig, sigkill = 1, int(signal.SIGKILL)
    return lambda: prctl(pr_set_pdeathsig, sigkill, 0, 0, 0)


def wait_for_line(proc: subprocess.Popen[str], prefix: str, bound_s: float = 60.0) -> str:
    """The first stdout line of ``proc`` starting with ``prefix`` (stripped), waited for at most ``bound_s``.

    Reads on a daemon thread and stops reading at that line: the rest of stdout is the caller's.
    Raises AssertionError if the process exits or the time runs out first.
    """
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
            if line.startswith(prefix):
                return

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.perf_counter() + bound_s
    while True:
        remaining = deadline - time.perf_counter()
        if remaining <= 0 or proc.poll() is not None:
            raise AssertionError(f"no {prefix!r} line from pid {proc.pid} (exit code {proc.poll()})")
        try:
            line = lines.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            continue
        if line.startswith(prefix):
            return line.strip()


__all__ = ["die_with_parent", "stop_process", "freeze", "process_state", "signal_and_wait", "thaw", "wait_for_line"]
