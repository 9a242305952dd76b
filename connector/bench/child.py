"""Bench work in a child process of its own: JSON commands in on stdin, one JSON line out per command.

Why: some figures must not share a process with the clients they are compared with (a client with no
telemetry timed while another client's telemetry thread takes the GIL; the engines of a fleet, each with its
own interpreter as in a deployment). :class:`JsonChild` starts ``python -m MODULE ARGS`` as a
:class:`~mooncake_lookout.connector.rigs.processes.ChildProcess` (stopped by pid, killed with the thread that
started it), waits for its ready line and sends it commands; the child's side is :func:`serve`, which answers
each command with ``result {...}`` or ``error ...``. Other output (vLLM's log lines) passes by.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from mooncake_lookout.connector.rigs.processes import ChildProcess

READY = "child ready"
RESULT = "result "
ERROR = "error "
TURN = "turn "  # children taking turns (:mod:`.turns`): a turn ended
GO = "go"  # ... and the parent's word that the next one starts


def _json_default(obj: Any) -> Any:
    return str(obj)


def _finite(value: Any) -> Any:
    """NaN and infinities as None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class JsonChild:
    """``python -m module *args`` serving :func:`serve`: ``ask`` a command, get its result; a context manager."""

    def __init__(self, module: str, args: Sequence[str] = (), *, name: str, env: dict[str, str] | None = None,
                 start_timeout_s: float = 120.0, wait: bool = True) -> None:
        self.name = name
        environ = dict(os.environ, MC_LOG_LEVEL=os.environ.get("MC_LOG_LEVEL", "ERROR"), PYTHONUNBUFFERED="1")
        environ.update(env or {})
        self._child = ChildProcess([sys.executable, "-m", module, *args], env=environ, stdin=True, keep_lines=400,
                                   name=name)
        if wait:
            self.wait_ready(start_timeout_s)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait for the child's ready line (``wait=False`` children: start several, then wait for each)."""
        try:
            self._child.wait_line(READY, timeout_s, f"{self.name}'s ready line")
        except BaseException:
            self._child.kill()
            raise

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._child.pid

    def send(self, command: dict[str, Any]) -> int:
        """Send ``command`` without waiting; returns the line count to pass to :meth:`result`."""
        seen = self._child.line_count
        self._child.send(json.dumps(command) + "\n")
        return seen

    def result(self, after: int, timeout_s: float) -> dict[str, Any]:
        """The answer to the command sent when the child had printed ``after`` lines; RuntimeError on its error."""
        _, line = self._child.find_line(lambda ln: ln.startswith((RESULT, ERROR)), timeout_s,
                                        f"{self.name}'s answer", after=after)
        if line.startswith(ERROR):
            raise RuntimeError(f"{self.name} (pid {self.pid}) failed: {line[len(ERROR):]}")
        out: dict[str, Any] = json.loads(line[len(RESULT):])
        return out

    def go(self) -> None:
        """Start the child's next turn (:mod:`.turns`)."""
        self._child.send(GO + "\n")

    def next_turn(self, after: int, timeout_s: float) -> tuple[int, dict[str, Any] | None]:
        """Wait for the end of the child's turn or for its result: ``(after, None)`` or ``(after, result)``, with
        the line count to pass next time; RuntimeError on its error."""
        n, line = self._child.find_line(lambda ln: ln.startswith((TURN, RESULT, ERROR)), timeout_s,
                                        f"{self.name}'s turn", after=after)
        if line.startswith(TURN):
            return n + 1, None
        return n + 1, self.result(n, timeout_s)

    def ask(self, command: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send ``command`` and wait (at most ``timeout_s``) for its result."""
        return self.result(self.send(command), timeout_s)

    def close(self) -> None:
        """Stop the child by pid (SIGTERM, then SIGKILL)."""
        self._child.stop()

    def __enter__(self) -> JsonChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve(handler: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """The child's loop: print the ready line, then answer each JSON line of stdin with ``handler``'s result."""
    print(READY, flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            out = handler(json.loads(line))
        except Exception as exc:
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip().replace("\n", " | ")
            print(traceback.format_exc(), file=sys.stderr, flush=True)
            print(ERROR + detail, flush=True)
        else:
            print(RESULT + json.dumps(_finite(out), default=_json_default), flush=True)
    return 0


__all__ = ["ERROR", "GO", "READY", "RESULT", "TURN", "JsonChild", "serve"]
