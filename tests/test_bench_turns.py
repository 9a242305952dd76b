"""Children taking turns (bench/turns.py): two real child processes step in ABBA turns, never at once.

Why: (d) compares two variants in processes of their own on a machine whose speed drifts over seconds; the
comparison holds only if their steps are timed side by side, each while the other waits.
"""

from __future__ import annotations

import io
import textwrap
from pathlib import Path

import pytest

from mooncake_lookout.connector.bench.child import JsonChild
from mooncake_lookout.connector.bench.turns import Turns, take_turns

CHILD = textwrap.dedent('''
    import time
    from mooncake_lookout.connector.bench.child import serve
    from mooncake_lookout.connector.bench.turns import Turns


    class Run:
        steps = 0


    def handle(command):
        turns, run, spans = Turns(command["turn_steps"], settle_s=0.0), Run(), []
        turns.begin()
        while run.steps < command["steps"]:
            t0 = time.perf_counter()
            time.sleep(0.002)  # a step
            spans.append([t0, time.perf_counter()])
            run.steps += 1
            turns.after_step(run)
        return {"spans": spans, "turns": turns.turns}


    if __name__ == "__main__":
        serve(handle)
''')


def test_two_children_step_in_abba_turns_and_never_at_once(tmp_path: Path) -> None:
    """Failed before bench/turns.py: the two (d) processes ran one whole run after the other."""
    (tmp_path / "turn_child.py").write_text(CHILD)
    env = {"PYTHONPATH": str(tmp_path)}
    children = [JsonChild("turn_child", name=f"child {i}", env=env, wait=False) for i in range(2)]
    try:
        for child in children:
            child.wait_ready(60)
        results = take_turns(children, [{"steps": 12, "turn_steps": 3}] * 2, timeout_s=60)
    finally:
        for child in children:
            child.close()
    assert [r["turns"] for r in results] == [5, 5]  # the first go, then one after each of the 4 turns
    steps = sorted((t0, t1, who) for who, r in enumerate(results) for t0, t1 in r["spans"])
    for (_, end, _), (start, _, _) in zip(steps, steps[1:]):
        assert end <= start, "two children stepped at once"
    owners = [who for _, _, who in steps]
    assert owners[::3] == [0, 1, 1, 0, 0, 1, 1, 0] and all(owners[i] == owners[i - i % 3] for i in range(24))


def test_a_child_refuses_anything_but_go_between_turns() -> None:
    turns = Turns(2, settle_s=0.0, stdin=io.StringIO("result {}\n"), stdout=io.StringIO())
    with pytest.raises(RuntimeError, match="expected 'go'"):
        turns.begin()
    with pytest.raises(ValueError, match=">= 1"):
        Turns(0)
