"""Child processes the rigs start (a Mooncake master, lookup servers, the CLI under test): one way to do it.

:class:`ChildProcess` is the only place that starts a child, reads its output and stops it:

* started by pid, in a session of its own, and (Linux) killed by the kernel if the thread that started
  it dies (:func:`die_with_parent`), so no child outlives a killed test or CLI;
* its output lines are read on a daemon thread into a bounded buffer: :meth:`ChildProcess.wait_line`
  waits (bounded) for a line that matches, such as a server's ``listening on ...``, and fails with the
  child's last lines when it exits or the time runs out;
* stopped by pid (:func:`stop_process`): a signal, SIGKILL if it lingers, always reaped.

:func:`freeze` and :func:`thaw` hang and resume a process (SIGSTOP / SIGCONT) and return once the
kernel reports it, for fault tests.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Union

LineMatch = Union[str, Callable[[str], object]]  # a prefix, or a predicate on the line (without newline)


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


_die_with_parent_fn = die_with_parent  # ChildProcess's parameter of the same name shadows it


def _matcher(match: LineMatch) -> Callable[[str], object]:
    if isinstance(match, str):
        return lambda line: line.startswith(match)
    return match


class ChildProcess:
    """A child process started by pid, its output read line by line on a daemon thread, stopped by pid.

    ``argv`` and ``env`` (default: this process's) start it. ``stdin``: give it a pipe (for
    :meth:`send`), else ``/dev/null``. ``stderr``: ``"stdout"`` merges it into the lines read, or a file
    object / ``subprocess.DEVNULL`` to send it elsewhere. ``keep_lines`` bounds the lines kept (the oldest
    go first; line numbers keep counting). ``die_with_parent``: see :func:`die_with_parent`.
    """

    def __init__(self, argv: Sequence[str], *, env: dict[str, str] | None = None, stdin: bool = False,
                 stderr: str | int | IO[str] | IO[bytes] = "stdout", keep_lines: int = 1000,
                 die_with_parent: bool = True, name: str = "child") -> None:
        self.argv = list(argv)
        self.name = name
        self.t_spawn = time.perf_counter()
        self._lines: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self._count = 0  # lines read so far, including those the buffer let go
        self._eof = False
        self._cond = threading.Condition()
        preexec = _die_with_parent_fn() if die_with_parent else None
        self.proc: subprocess.Popen[str] = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT if stderr == "stdout" else stderr,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, env=env, text=True, errors="replace",
            start_new_session=True,
            preexec_fn=preexec)
        self._reader = threading.Thread(target=self._pump, daemon=True, name=f"lookout-{name}-{self.proc.pid}")
        self._reader.start()

    # -- state ---------------------------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.proc.pid

    @property
    def running(self) -> bool:
        """True while the child exists (paused counts as running)."""
        return self.proc.poll() is None

    @property
    def line_count(self) -> int:
        """How many lines the child has printed so far (pass it as ``after`` to wait for a later one)."""
        with self._cond:
            return self._count

    def lines(self) -> list[str]:
        """The lines kept so far, oldest first, without their newlines."""
        with self._cond:
            return list(self._lines)

    def output(self) -> str:
        """The lines kept so far as one text, for error messages."""
        return "\n".join(self.lines())

    # -- reading ---------------------------------------------------------------------------------------------
    def _pump(self) -> None:
        stdout = self.proc.stdout
        assert stdout is not None
        try:
            for raw in stdout:
                with self._cond:
                    self._lines.append(raw.rstrip("\n"))
                    self._count += 1
                    self._cond.notify_all()
        except (OSError, ValueError):  # the stream was closed under the reader by stop()
            pass
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_line(self, match: LineMatch, timeout_s: float, what: str = "", *, after: int = 0) -> str:
        """The first line numbered ``after`` or later that ``match`` accepts, waited for at most ``timeout_s``.

        ``match`` is a prefix or a predicate. Raises RuntimeError when the child's output ends first (it
        exited), TimeoutError when the time runs out; both name ``what`` and show the child's last lines.
        """
        return self.find_line(match, timeout_s, what, after=after)[1]

    def find_line(self, match: LineMatch, timeout_s: float, what: str = "", *, after: int = 0) -> tuple[int, str]:
        """Like :meth:`wait_line`, with the line's number (count from 0) so a caller can wait past it next."""
        test = _matcher(match)
        what = what or (repr(match) if isinstance(match, str) else "the expected line")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                first = self._count - len(self._lines)  # number of the oldest line kept
                for number, line in enumerate(list(self._lines), start=first):
                    if number >= after and test(line):
                        return number, line
                if self._eof:
                    raise RuntimeError(f"{self.name} (pid {self.pid}) ended its output before {what} "
                                       f"(exit code {self.proc.poll()}); output:\n" + "\n".join(self._lines))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name} (pid {self.pid}): no {what} within {timeout_s} s; output:\n"
                                       + "\n".join(self._lines))
                self._cond.wait(min(left, 0.5))

    def wait_exit(self, timeout_s: float) -> int:
        """Wait (bounded) for the child to exit and its output to be read; returns the exit code."""
        code = self.proc.wait(timeout_s)
        self._reader.join(timeout_s)
        return code

    # -- writing and stopping ---------------------------------------------------------------------------------
    def send(self, text: str) -> None:
        """Write ``text`` to the child's stdin (started with ``stdin=True``) and flush it."""
        assert self.proc.stdin is not None, "started without a stdin pipe"
        self.proc.stdin.write(text)
        self.proc.stdin.flush()

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        """End the child by pid (:func:`stop_process`: ``sig``, then SIGKILL), reap it and close its pipes."""
        stop_process(self.proc, sig, timeout_s)
        self._reader.join(timeout=5.0)
        for stream in (self.proc.stdout, self.proc.stdin):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass

    def kill(self, timeout_s: float = 10.0) -> None:
        """Crash the child: SIGKILL by pid, then reap it."""
        self.stop(signal.SIGKILL, timeout_s)

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ChildProcess({self.name}, pid={self.pid}, running={self.running})"


__all__ = ["ChildProcess", "LineMatch", "die_with_parent", "freeze", "process_state", "signal_and_wait",
           "stop_process", "thaw"]
