"""Bench scenario (i) at its quick size: upstream's and our connector in real ``vllm serve`` engines, in turns.

Not a speed test: it checks that both engines served every request of both workloads, that the store served
prompt tokens to both (vLLM's own counter), that the lookup-timing hook measured the engine-core thread in both
(steps and time inside lookup calls, none off that thread) and agrees with ours' own ``scheduler_blocked_seconds``,
and that the targets i1-i4 are computed from these figures. Needs the engine venv (``scripts/setup-engine.sh``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from mooncake_lookout.connector.bench import real_engine
from mooncake_lookout.connector.bench.report import i_block
from mooncake_lookout.connector.bench.targets import targets
from mooncake_lookout.connector.rigs import engine_timing
from mooncake_lookout.connector.rigs.engine import engine_python

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]  # engines start in 22-59 s; ~4 min on a loaded host


@pytest.fixture(scope="module")
def results() -> dict:
    return {"i": real_engine.run(real_engine.QUICK, log=print)}


def test_targets_i1_to_i4_are_computed_from_the_run(results: dict) -> None:
    found = {t["id"]: t for t in targets(results)}
    assert list(found) == ["i1", "i2", "i3", "i4"]
    (wave,) = results["i"]["waves"]
    (ours,), upstream = wave["ours"], wave["upstream"]
    assert found["i1"]["ours"] == ours["hit_tokens"] and found["i1"]["upstream"] == upstream["hit_tokens"]
    assert found["i4"]["ratio"] == pytest.approx(ours["lookup_us_per_step"] / upstream["lookup_us_per_step"])
    assert found["i1"]["met"] == (found["i1"]["ratio"] >= 0.99)
    (per_request,) = found["i4"]["per_request"]
    assert per_request["ours"] == ours["lookup_us_per_request"] > 0
    assert found["i2"]["pairs"] == [{"pair": "ours auto / upstream async", "ours": ours["ttft_ms"]["p50"],
                                     "upstream": upstream["ttft_ms"]["p50"], "ratio": found["i2"]["ratio"]}]
    assert len(i_block(results)) == 4


def test_the_timing_hook_patches_vllms_scheduler_only_when_asked(tmp_path: Path) -> None:
    python = engine_python()
    probe = "import vllm.v1.core.sched.scheduler as s; print(s.Scheduler.schedule.__name__)"
    env = {"PYTHONPATH": str(engine_timing.FOLDER), "HF_HUB_OFFLINE": "1"}
    on = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120,
                        env={**env, engine_timing.ENV: str(tmp_path)})
    off = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert on.stdout.split() == ["patched_schedule"], on.stderr[-2000:]
    assert off.stdout.split() == ["schedule"], off.stderr[-2000:]


def test_engines_of_a_wave_take_turns_forwards_then_backwards() -> None:
    assert [real_engine.seats(2, k) for k in range(4)] == [[0, 1], [1, 0], [0, 1], [1, 0]]  # ABBA
    assert [real_engine.seats(3, k) for k in range(2)] == [[0, 1, 2], [2, 1, 0]]
