"""The suite's parts (scripts/test.sh): a test that times something runs in the timed part, alone; a test that
starts real engines runs in the engine part.

The untimed part runs two test files at a time. A bound on a call's duration judged there would be judged on a
machine the other file is loading, and a flaky test blocks every later landing. So a module that measures a call
(``time.perf_counter``) or allows a slack past a deadline (the soak's ``SLACK_S``) carries
``pytestmark = pytest.mark.timed``; a bounded poll for a condition (``time.monotonic``) needs no quiet machine.
A timed call runs inside the soak's ``collector_held``: a garbage collection is the interpreter's pause, not the
call's.
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path
from typing import Any

import pytest

from mooncake_lookout.connector.rigs.soak import collector_held

TESTS = Path(__file__).parent
CLOCKS = ("perf_counter", "SLACK_S")


def _names(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
           {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
           {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}


def _marked_timed(tree: ast.Module, marker: str = "timed") -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            return any(isinstance(n, ast.Attribute) and n.attr == marker for n in ast.walk(node.value))
    return False


@pytest.mark.parametrize("path", sorted(TESTS.glob("test_*.py")), ids=lambda p: p.name)
def test_a_module_that_times_a_call_runs_in_the_timed_part(path: Path) -> None:
    tree = ast.parse(path.read_text())
    clocks = sorted(set(CLOCKS) & _names(tree))
    assert not clocks or _marked_timed(tree), f"{path.name} reads {', '.join(clocks)}: mark it pytest.mark.timed"


@pytest.mark.parametrize("path", sorted(TESTS.glob("test_*.py")), ids=lambda p: p.name)
def test_a_module_that_starts_engines_runs_in_the_engine_part(path: Path) -> None:
    """Real engines (~3.2 GB each) never run beside another test file: a module using the engine rig is marked."""
    tree = ast.parse(path.read_text())
    uses = {"Engine", "start_all"} & _names(tree)
    assert not uses or _marked_timed(tree, "engine"), f"{path.name} uses {', '.join(sorted(uses))}: mark it engine"



def _cycles(n: int) -> None:
    for _ in range(n):
        cycle: list[Any] = []
        cycle.append(cycle)


def test_a_timed_call_is_not_charged_for_a_garbage_collection() -> None:
    passes: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            passes.append(info["generation"])

    gc.collect()  # the first generation starts empty: nothing before the call is due a collection
    gc.callbacks.append(seen)
    try:
        with collector_held():
            _cycles(50_000)  # cyclic garbage far past the first generation's threshold (700 allocations)
            assert passes == [], "a collection ran inside the timed call"
        assert gc.isenabled()
        _cycles(5_000)
        assert passes, "the collector did not run again after the timed call"
        gc.disable()
        with collector_held():
            pass
        assert not gc.isenabled(), "a collector turned off before the call was turned on by it"
    finally:
        gc.callbacks.remove(seen)
        gc.enable()
