"""``mooncake-lookout demo --engine``: the console script in a subprocess, a real ``vllm serve`` engine on CPU.

The end-to-end test runs one mode (ours ``auto``: one engine, about a minute, most of it the engine's start-up)
and reads the table: requests served, time to first token, prompt tokens served from the store (vLLM's own
counter: the warmed prefixes come back from the store), lookups by outcome, the ``/metrics`` URL; then checks
that the engine's processes are gone (by pid). The others check what is refused before anything starts.
Needs the engine venv (``scripts/setup-engine.sh``; ``scripts/test.sh`` installs it).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_lookout.connector.cli import demo_engine_table
from mooncake_lookout.connector.rigs.processes import process_state

SCRIPT = Path(sys.executable).parent / "mooncake-lookout"
pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]  # engines start in 22-59 s; ~4 min on a loaded host
ROW = re.compile(r"^ours auto\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\d+) /\s+(\d+)\s+(\d+)\s+(.*)$")


def _demo(*args: str, env: dict[str, str] | None = None, timeout_s: float = 400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), "demo", *args], capture_output=True, text=True, timeout=timeout_s,
                          env=dict(os.environ, **(env or {})))


def test_demo_engine_serves_prefixes_from_the_store_and_reports_them() -> None:
    done = _demo("--engine", "--mode", "auto", "--duration", "3")
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]
    row = next((ROW.match(line) for line in out.splitlines() if ROW.match(line)), None)
    assert row is not None, out
    requests, p50, p99, hits, prompt, deferrals, lookups = row.groups()
    assert int(requests) > 0 and 0 < float(p50) <= float(p99), out
    # Every measured request's shared prefix (4 blocks of 32) was warmed into the store: vLLM counted it served.
    assert int(hits) >= 128 * int(requests) and int(hits) < int(prompt), out
    assert re.fullmatch(r"(\w+ \d+ ?)+", lookups) and "hit " in lookups, lookups
    assert int(deferrals) >= 0
    url = re.search(r"ours auto pid (\d+) (http://127\.0\.0\.1:\d+/metrics)", out)
    assert url is not None and f"ours auto {url.group(2)}" in out, out
    assert process_state(int(url.group(1))) is None, "the engine's API server outlived the demo"
    for _, legend in demo_engine_table.COLUMNS:
        assert legend in out


def test_demo_engine_refuses_the_budget_mode_before_starting_anything() -> None:
    done = _demo("--engine", "--mode", "budget", timeout_s=60)
    assert done.returncode == 2 and "--engine runs upstream-sync, upstream-async, sync, async or auto" in done.stdout


def test_demo_engine_without_an_engine_venv_says_how_to_make_one(tmp_path: Path) -> None:
    done = _demo("--engine", env={"LOOKOUT_ENGINE_VENV": str(tmp_path / "none")}, timeout_s=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"no engine venv at {tmp_path / 'none'}" in done.stdout and "setup-engine.sh" in done.stdout
