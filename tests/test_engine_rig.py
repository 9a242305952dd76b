"""The engine rig's guarantees that need no engine: a process tree started under its supervisor ends, whole,
when the process that started it dies, even by SIGKILL, and a member that ignores SIGTERM is killed after the
grace, and no later than its server's exit; ``/metrics`` text is parsed with its labels. (tests/test_engine_modes.py
starts real engines.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mooncake_lookout.connector.rigs.engine import _group_pids, parse_metrics, supervised

# A stand-in for a test process: it starts a tree under the supervisor (a shell, a sleep that ignores SIGTERM,
# a plain sleep), prints the tree's process group and waits to be killed.
STARTER = r"""
import subprocess, sys, time
from mooncake_lookout.connector.rigs.engine import supervised
tree = subprocess.Popen(supervised(["bash", "-c", "(trap '' TERM; sleep 300) & sleep 300 & wait"]),
                        start_new_session=True)
print(tree.pid, flush=True)
time.sleep(300)
"""


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)


def test_the_tree_ends_whole_when_its_starter_is_killed(tmp_path: Path) -> None:
    env = {**os.environ, "LOOKOUT_ENGINE_STOP_S": "1"}
    starter = subprocess.Popen([sys.executable, "-c", STARTER], stdout=subprocess.PIPE, text=True, env=env)
    group = 0
    try:
        assert starter.stdout is not None
        group = int(starter.stdout.readline())
        # bash, the subshell and two sleeps (the subshell may exec its sleep), and the supervisor
        wait_for(lambda: len(_group_pids(group)) >= 3, 30, "the tree did not start")
        time.sleep(0.5)
        assert len(_group_pids(group)) >= 3, "the tree ended before its starter died (the control)"
        starter.kill()
        starter.wait(10)
        wait_for(lambda: not _group_pids(group), 30, "the tree outlived its starter")
    finally:
        starter.kill()
        starter.wait(10)
        if group and _group_pids(group):
            os.killpg(group, signal.SIGKILL)


# A server that exits at once on SIGTERM, beside a member that ignores it (as vLLM's API server ends and leaves
# what it started behind).
PROMPT_EXIT = "trap 'exit 0' TERM; (trap '' TERM; sleep 300) & while true; do sleep 0.05; done"
GRACE_S = 60.0


@pytest.mark.timed
def test_a_stopped_tree_ends_when_its_server_exits_not_after_the_grace() -> None:
    """Every engine stop waited the whole grace (20 s) before: the supervisor's handler polled a server its own
    main thread was waiting on. The bound is half the configured grace, not the machine's speed."""
    env = {**os.environ, "LOOKOUT_ENGINE_STOP_S": str(GRACE_S)}
    tree = subprocess.Popen(supervised(["bash", "-c", PROMPT_EXIT]), start_new_session=True, env=env)
    try:
        wait_for(lambda: len(_group_pids(tree.pid)) >= 3, 30, "the tree did not start")
        t0 = time.monotonic()
        os.killpg(tree.pid, signal.SIGTERM)
        wait_for(lambda: not _group_pids(tree.pid), GRACE_S + 10, "the tree outlived its grace")
        assert time.monotonic() - t0 < GRACE_S / 2, "the tree ended only after the grace, not when its server exited"
    finally:
        if _group_pids(tree.pid):
            os.killpg(tree.pid, signal.SIGKILL)
        tree.wait(10)


def test_metrics_text_is_parsed_with_labels() -> None:
    text = ('# HELP vllm:x A counter.\n# TYPE vllm:x counter\n'
            'vllm:x_total{engine="0",model_name="tiny"} 3.0\n'
            'vllm:y{le="+Inf",path="a\\"b"} 1e3\nvllm:z 7\n')
    assert parse_metrics(text) == [("vllm:x_total", {"engine": "0", "model_name": "tiny"}, 3.0),
                                   ("vllm:y", {"le": "+Inf", "path": 'a\\"b'}, 1000.0), ("vllm:z", {}, 7.0)]
