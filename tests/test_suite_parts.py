"""The suite's two parts (scripts/test.sh): a test that times something runs in the timed part, alone.

The untimed part runs two test files at a time. A bound on a call's duration judged there would be judged on a
machine the other file is loading, and a flaky test blocks every later landing. So a module that measures a call
(``time.perf_counter``) or allows a slack past a deadline (the soak's ``SLACK_S``) carries
``pytestmark = pytest.mark.timed``; a bounded poll for a condition (``time.monotonic``) needs no quiet machine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
CLOCKS = ("perf_counter", "SLACK_S")


def _names(tree: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
           {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
           {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}


def _marked_timed(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            return any(isinstance(n, ast.Attribute) and n.attr == "timed" for n in ast.walk(node.value))
    return False


@pytest.mark.parametrize("path", sorted(TESTS.glob("test_*.py")), ids=lambda p: p.name)
def test_a_module_that_times_a_call_runs_in_the_timed_part(path: Path) -> None:
    tree = ast.parse(path.read_text())
    clocks = sorted(set(CLOCKS) & _names(tree))
    assert not clocks or _marked_timed(tree), f"{path.name} reads {', '.join(clocks)}: mark it pytest.mark.timed"

