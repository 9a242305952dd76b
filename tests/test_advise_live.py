"""``mooncake-lookout advise`` against a real Prometheus scraping a real ``demo``, one lookup mode per test.

Each test starts, on 127.0.0.1: a ``prometheus`` scraping one port every second, and ``demo`` on that port
in one mode (``--mode``) with ``--keep-running`` (so /metrics stays up after the run). Once Prometheus holds
the run's last figures, ``advise`` runs as a user runs it (the console script, ``--json``) over a window
that covers the whole run. Each test checks the advice against the demo's own closing table (the same
run, measured by the bench's probe around the scheduler's call) and states why that advice is the one
those measurements support. Every wait is bounded; demo (which stops its master and lookup servers) and
Prometheus are stopped by pid.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mooncake_lookout.connector.config import TIMEOUT_MS
from mooncake_lookout.connector.rigs.master import free_port
from mooncake_lookout.connector.rigs.processes import ChildProcess
from mooncake_lookout.metrics import catalogue as cat

from live_stack import Prometheus  # noqa: E402 - dashboards/ is on sys.path (conftest)

pytestmark = pytest.mark.timed  # bounds a time: runs alone (scripts/test.sh)

SCRIPT = Path(sys.executable).parent / "mooncake-lookout"
START_TIMEOUT_S = 120.0  # demo's start (vLLM import, master, lookup servers) and run, on a loaded 2-core machine
SCRAPED_TIMEOUT_S = 20.0  # until Prometheus holds the figures /metrics serves after the run
LOAD_S = "6"  # seconds of load per scenario: thousands of lookups, far above advise's minimum of 100


@dataclass
class Scenario:
    """One demo run as advise saw it: the advice (``--json``), the text report and the demo's closing table."""

    advice: dict[str, Any]
    report: str
    table_row: list[str]
    demo_lines: list[str]

    def key(self, name: str) -> dict[str, Any]:
        (item,) = [a for a in self.advice["advice"] if a["key"] == name]
        return item

    @property
    def demo_blocked_per_step_us(self) -> float:
        return float(self.table_row[-7])

    @property
    def demo_deferred_per_request(self) -> float:
        return float(self.table_row[-5])


def _scraped(prom: Prometheus, metrics_url: str, deadline: float) -> None:
    """Wait until Prometheus' newest sample of the lookup total equals what /metrics serves now (the demo's
    telemetry thread may still be recording the run's last events when the run ends)."""
    expr = f"sum({cat.REQUESTS.sample_names[0]})"
    served = stored = None
    while time.monotonic() < deadline:
        served = _total(metrics_url)
        result = prom.api("query", query=expr)["data"]["result"]
        stored = float(result[0]["value"][1]) if result else None
        if stored == served:
            return
        time.sleep(0.5)  # poll interval at a 1 s scrape, bounded by the deadline
    raise AssertionError(f"Prometheus did not catch up with /metrics in time: it holds {stored} lookups, "
                         f"/metrics serves {served}")


def _total(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    prefix = cat.REQUESTS.sample_names[0] + "{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))


@pytest.fixture
def run_scenario(prometheus_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    started: list[Any] = []

    def run(*demo_args: str) -> Scenario:
        port = free_port()
        workdir = tmp_path_factory.mktemp("prometheus")
        prom = Prometheus({"demo": [f"127.0.0.1:{port}"]}, workdir, binary=prometheus_binary)
        started.append(prom)
        prom.start()
        t0 = time.time()
        demo = ChildProcess([str(SCRIPT), "demo", "--port", str(port), "--keep-running", "--duration", LOAD_S,
                             *demo_args], env=dict(os.environ), name="demo")
        started.append(demo)
        demo.wait_line(lambda line: "/metrics stays up" in line, START_TIMEOUT_S, "the end of the run")
        lines = demo.lines()
        head = next(i for i, line in enumerate(lines) if line.startswith("mode "))
        row = lines[head + 2].split()
        _scraped(prom, f"http://127.0.0.1:{port}/metrics", time.monotonic() + SCRAPED_TIMEOUT_S)
        window = f"{math.ceil(time.time() - t0) + 5}s"
        argv = [str(SCRIPT), "advise", "--prometheus", prom.url, "--selector", f'{{instance="127.0.0.1:{port}"}}',
                "--window", window]
        done = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        text = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert text.returncode == 0, text.stderr
        print(text.stdout)  # shown with -s, and in the report of a failing test
        return Scenario(json.loads(done.stdout), text.stdout, row, lines)

    yield run
    for part in reversed(started):
        if isinstance(part, ChildProcess):
            part.stop(signal.SIGINT, timeout_s=30.0)  # demo stops its master and lookup servers, by pid
        else:
            part.stop()


def _wait_matches_the_rule(s: Scenario) -> None:
    """``lookup_wait_us`` follows advise's stated rule on the figures it printed (used where either value is right)."""
    wait = s.key("lookup_wait_us")
    f = wait["figures"]
    fits = f["rpc_p90_us"] is not None and f["rpc_p90_us"] + f["auto_margin_us"] <= f["auto_cap_us"]
    assert wait["value"] == ("auto" if fits else 0), wait


def test_sync_costing_a_share_of_every_step_is_advised_async(run_scenario) -> None:
    """Sync, 1.5 ms model steps, 4 new requests a step: each step blocks for the step's round trips (the demo's
    table: hundreds of us per step, a large share of a ~2-3 ms step; the bench's scenario (c) measured the same,
    1.5 ms per step). Every request pays that slice, so async is advised; nothing timed out or piled up, so the
    deadline and bounds stay."""
    s = run_scenario("--mode", "sync")
    assert s.advice["in_force"]["mode"] == "sync"
    use_async = s.key("lookup_async")
    assert use_async["value"] is True and use_async["changed"], use_async
    assert use_async["figures"]["blocked_share"] >= 0.05
    # The blocked time advise read from Prometheus is the one the demo's probe measured around the same calls
    # (advise's also counts the admission calls, so it is the larger).
    blocked_us = use_async["figures"]["blocked_per_step_us"]
    assert 0.5 * s.demo_blocked_per_step_us <= blocked_us <= 2 * s.demo_blocked_per_step_us + 100, (blocked_us,
                                                                                                     s.table_row)
    assert s.demo_deferred_per_request == 0.0
    _wait_matches_the_rule(s)
    deadline = s.key("lookup_timeout_ms")  # the default, kept (auto: 2 s)
    assert deadline["value"] == TIMEOUT_MS and not deadline["changed"], deadline
    assert not s.key("lookup_max_pending")["changed"] and not s.key("lookup_max_held")["changed"]
    assert '"lookup_async": true' in s.report and "lookup_async: true" in s.report  # both fragments


def test_async_with_a_round_trip_well_under_a_step_is_advised_auto(run_scenario) -> None:
    """Async, 10 ms model steps: answers come back in well under a step (the demo's table: about one step
    deferred per request, i.e. the answer was there at the next step; the bench measured a round trip of
    0.4-1 ms), while each deferral costs a whole 10 ms step. Auto may wait up to a quarter of the step
    (2.5 ms), room for the round trip: it uses most answers in the step they were asked for."""
    s = run_scenario("--mode", "async", "--model-step-ms", "10")
    assert s.advice["in_force"]["mode"] == "async"
    assert s.key("lookup_async")["value"] is True and not s.key("lookup_async")["changed"]
    wait = s.key("lookup_wait_us")
    assert wait["value"] == "auto" and wait["changed"], wait
    assert wait["figures"]["auto_cap_us"] >= 2000  # a quarter of a >= 8 ms step without lookups
    assert s.demo_deferred_per_request <= 1.5  # answers by the next step, as advise's deferred p90 <= 1 says
    assert s.advice["costs"]["deferred_p90"] <= 1
    assert not s.key("lookup_timeout_ms")["changed"]


def test_a_fixed_budget_shorter_than_the_round_trip_is_advised_auto(run_scenario) -> None:
    """Budget mode with lookup_wait_us 100 and 10 ms steps: 100 us is below any round trip of this path (one ZMQ
    hop between processes plus a store call: p50 ~0.4 ms at best), so a wait for a lookup that left late in the
    model step runs out (most leave on arrival, early enough: the demo's requests arrive during the model step).
    The step leaves auto 2.5 ms: it waits about the measured round trip instead."""
    s = run_scenario("--mode", "budget", "--budget-us", "100", "--model-step-ms", "10")
    assert s.advice["in_force"]["mode"] == "budget"
    assert s.advice["in_force"]["lookup_wait_us"] == 100
    wait = s.key("lookup_wait_us")
    assert wait["value"] == "auto" and wait["current"] == 100, wait
    assert wait["figures"]["rpc_p90_us"] > 100  # the round trip the advice read: longer than the budget in force
    assert s.key("lookup_async")["value"] is True
    assert not s.key("lookup_timeout_ms")["changed"]


def test_a_stalled_store_is_advised_to_keep_deferring_with_the_same_deadline(run_scenario) -> None:
    """Async with a 100 ms deadline and the master frozen (SIGSTOP) for 2 of the 6 s: lookups sent meanwhile time
    out, the breaker opens and answers misses (the demo's table lists the timeouts). Advice: keep async and do not
    wait (a wait would be spent on answers that do not come; deferring already frees the scheduler). The deadline stays:
    answers that did come were far below it, so the timeouts are a stall, not a tail a longer deadline
    would catch; it would only hold requests longer."""
    # The deadline given (async's auto, 2 s, outlasts this freeze: the demo's own loop then waits it out).
    s = run_scenario("--mode", "async", "--timeout-ms", "100", "--pause-master", "2")
    assert any("paused (SIGSTOP)" in line for line in s.demo_lines) and any("resumed" in line for line in s.demo_lines)
    assert any("timeout" in line for line in s.demo_lines if "without the store's answer" in line)
    assert s.advice["costs"]["failing"] is True
    assert s.advice["outcomes"].get("timeout", 0) > 0
    assert s.key("lookup_async")["value"] is True
    assert s.key("lookup_wait_us")["value"] == 0
    timeout = s.key("lookup_timeout_ms")
    assert timeout["value"] == 100 and not timeout["changed"], timeout
    assert timeout["figures"]["answered_in_last_half_before_deadline"] < 0.2 * timeout["figures"]["timeouts"]
    assert not s.key("lookup_max_pending")["changed"]
