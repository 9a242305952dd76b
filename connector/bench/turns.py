"""Child processes that take turns of a few steps each, so that what they are compared on is timed side by side.

Why: this machine's speed drifts over seconds. A fixed Python loop, timed every 50 ms for 20 s, ran at 5.0-5.6
ms for 8 s, then at 9.2-11.7 ms for the rest. Two variants timed one whole run after the other land in different
spells and differ by up to 25% with no difference between them; the same variant in 8 processes in a row
ranged 488-728 us of mean ``schedule()`` per step. Turns of a few steps (tens of milliseconds) put both
variants in the same spells.

The child's side is :class:`Turns`: after the scheduler's driver is built it says ``turn 0`` and waits; after
every ``steps``-th step it lets its in-flight replies land (``settle_s``), says ``turn N`` and waits for the
parent's ``go``. The parent's side is :func:`take_turns`: it starts both children's runs, then hands out the
turns in ABBA order (:func:`abba_seat`: each child follows the other as often as itself) until both runs have
answered with their results.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import IO, Any

from mooncake_lookout.connector.bench.child import GO, TURN, JsonChild

TURN_STEPS = 25  # about 50 ms of (f)'s 64-block run: well inside one of the machine's spells
SETTLE_S = 0.003  # a turn's in-flight lookups are answered before the other child's turn starts


class Turns:
    """The child's side: wait for the parent's go before the first step and after every ``steps``-th step."""

    def __init__(self, steps: int = TURN_STEPS, *, settle_s: float = SETTLE_S, stdin: IO[str] | None = None,
                 stdout: IO[str] | None = None) -> None:
        if steps < 1:
            raise ValueError(f"turn steps must be >= 1, got {steps}")
        self.steps = steps
        self.settle_s = settle_s
        self._stdin = stdin
        self._stdout = stdout
        self.turns = 0

    def wait(self, step: int) -> None:
        """Say that the turn ended at ``step`` and block until the parent says go."""
        print(f"{TURN}{step}", file=self._stdout or sys.stdout, flush=True)
        line = (self._stdin or sys.stdin).readline()
        if line.strip() != GO:
            raise RuntimeError(f"expected {GO!r} from the parent between turns, got {line!r}")
        self.turns += 1

    def begin(self) -> None:
        """Before the first step (from a run's ``prepare`` hook): the first turn starts on the parent's go."""
        self.wait(0)

    def after_step(self, run: Any) -> None:
        """After each step (a run's ``pace`` hook): at a turn's end, settle, then wait for the next go."""
        if run.steps % self.steps == 0:
            time.sleep(self.settle_s)
            self.wait(run.steps)


def take_turns(children: Sequence[JsonChild], commands: Sequence[dict[str, Any]],
               timeout_s: float) -> list[dict[str, Any]]:
    """Send ``commands[i]`` to ``children[i]`` (two of each), then hand out turns in ABBA order; each child's
    result."""
    if len(children) != 2 or len(commands) != 2:
        raise ValueError("two children take turns, one command each")
    deadline = time.perf_counter() + timeout_s
    seen = [child.send(command) for child, command in zip(children, commands)]
    results: list[dict[str, Any] | None] = [None] * len(children)
    for i, child in enumerate(children):  # each child has built its driver and waits for its first go
        seen[i], result = child.next_turn(seen[i], _left(deadline))
        if result is not None:
            raise RuntimeError(f"{child.name} answered before its first turn")
    turn = 0
    while any(r is None for r in results):
        i = abba_seat(turn)
        turn += 1
        if results[i] is not None:
            continue
        children[i].go()
        seen[i], results[i] = children[i].next_turn(seen[i], _left(deadline))
    return [r for r in results if r is not None]


def abba_seat(i: int) -> int:
    """Which of two goes ``i``-th in ABBA order: 0, 1, 1, 0, 0, 1, ... (each follows the other as often as
    itself, so drift between them hits both alike)."""
    return (i + i // 2) % 2


def _left(deadline: float) -> float:
    left = deadline - time.perf_counter()
    if left <= 0:
        raise TimeoutError("children taking turns ran past their time")
    return left


__all__ = ["GO", "SETTLE_S", "TURN", "TURN_STEPS", "Turns", "abba_seat", "take_turns"]
