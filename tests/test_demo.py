"""``mooncake-lookout demo`` as a user runs it: the console script in a subprocess, real everything.

Checks the table, scrapes ``/metrics`` during and after the run, ends it with SIGINT/SIGTERM and checks
that it exits cleanly and that the Mooncake master and the lookup server process it started are gone
(by pid). Every wait is bounded; the subprocess is killed by pid if a test fails midway.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from mooncake_lookout.connector.rigs.processes import ChildProcess
from mooncake_lookout.metrics import catalogue

SCRIPT = Path(sys.executable).parent / "mooncake-lookout"
START_TIMEOUT_S = 120.0


class Demo:
    """The demo subprocess (a :class:`ChildProcess`: its lines read by a thread) and a cursor past the last match."""

    def __init__(self, *args: str) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - read back in failure messages, closed by kill()
        self.child = ChildProcess([str(SCRIPT), "demo", *args], env=dict(os.environ), stderr=self.stderr, name="demo")
        self.proc = self.child.proc
        self._next = 0  # number of the first line the next wait looks at

    @property
    def lines(self) -> list[str]:
        return self.child.lines()

    def _explain(self) -> str:
        self.stderr.seek(0)
        return "\n--- stderr tail ---\n" + self.stderr.read()[-3000:]

    def wait_for(self, pattern: str, timeout_s: float = START_TIMEOUT_S) -> re.Match[str]:
        """Take lines until one matches ``pattern`` (bounded); returns the match."""
        rx = re.compile(pattern)
        try:
            number, line = self.child.find_line(rx.search, timeout_s, f"line matching {pattern!r}", after=self._next)
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{e}{self._explain()}") from None
        self._next = number + 1
        match = rx.search(line)
        assert match is not None
        return match

    def rest(self, timeout_s: float = 60.0) -> int:
        """Wait for every remaining line and the exit code (bounded)."""
        return self.child.wait_exit(timeout_s)

    def kill(self) -> None:
        self.child.kill()
        self.stderr.close()


@pytest.fixture
def demo_factory() -> Iterator[type]:
    started: list[Demo] = []

    def make(*args: str) -> Demo:
        d = Demo(*args)
        started.append(d)
        return d

    yield make  # type: ignore[misc]
    for d in started:
        d.kill()


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def sample(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert m, f"{name}{labels} not in the scrape"
    return float(m.group(1))


def gone(pid: int, timeout_s: float = 15.0) -> bool:
    """True once /proc has no such process (polled, bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not os.path.exists(f"/proc/{pid}"):
            return True
        time.sleep(0.05)
    return False


FIVE = ("upstream sync", "upstream async", "ours sync", "ours async", "ours auto")


def test_short_demo_prints_the_table_serves_metrics_and_exits_cleanly(demo_factory) -> None:
    """The default demo: five rows (vLLM's own client and ours, blocking and async, ours with auto), a legend
    naming every column, two lines reading the run; the progress of each mode counts from its first step."""
    demo = demo_factory("--duration", "small", "--keep-running")
    url = demo.wait_for(r"^metrics: (http://127\.0\.0\.1:\d+/metrics)$").group(1)
    pids = demo.wait_for(r"Mooncake master pid (\d+) .* lookup servers pid (\d+)")
    master_pid, servers_pid = int(pids.group(1)), int(pids.group(2))
    demo.wait_for(r"^prefix cache: off in this run .* --workload multi-turn shows the cache on$")
    assert os.path.exists(f"/proc/{master_pid}")

    demo.wait_for(r"^\[ours async ")  # our client's run is on: /metrics answers with our families
    during = scrape(url)
    assert f"# TYPE {catalogue.REQUESTS.sample_names[0]} counter" in during

    head = demo.wait_for(r"^mode +requests +steps/s .*hit ratio$").group(0)
    rows = {m: demo.wait_for(rf"^{m} +\d.*").group(0).split()[2:] for m in FIVE}
    for m, fields in rows.items():
        assert int(fields[0]) > 0 and float(fields[1]) > 0, (m, fields)  # requests, steps/s
    for m in ("upstream sync", "ours sync"):
        assert float(rows[m][4]) == 0.0, f"{m} never defers"
    assert rows["upstream sync"][-1] == "-" and float(rows["ours sync"][-1]) > 0  # upstream's client counts no hits
    legend = []
    while not (line := demo.wait_for(r".*").group(0)).startswith("Reading:"):
        legend.append(line)
    words = head.split()[1:]  # every word of every column's name is in the legend
    assert [w for w in words if not re.search(rf"(^|\s){re.escape(w)}\b", " ".join(legend))] == [], (words, legend)
    reading = line + "\n" + demo.wait_for(r"^ours auto waited .*").group(0)
    blocked = {m: float(rows[m][2]) for m in FIVE}
    assert f"{blocked['upstream sync']:.0f} -> {blocked['upstream async']:.0f} us" in reading, reading
    assert f"{blocked['ours sync']:.0f} -> {blocked['ours async']:.0f} us" in reading, reading
    demo.wait_for(r"/metrics stays up at ")

    after = scrape(url)
    requested = sum(sample(after, catalogue.REQUESTS.name + "_total", f'{{outcome="{o}"}}') for o in ("hit", "miss"))
    assert requested > 0
    for m in catalogue.MODES:
        assert sample(after, catalogue.SCHEDULER_BLOCKED_SECONDS.name + "_count", f'{{mode="{m}"}}') > 0
    assert sample(after, catalogue.HIT_TOKENS.name + "_total") > 0

    firsts = {}
    for text in demo.lines:
        progress = re.match(r"^\[(.+?) *\] +([\d.]+)/([\d.]+) s +steps +(\d+)", text)
        if progress:
            firsts.setdefault(progress.group(1), progress.groups()[1:])
    assert sorted(firsts) == sorted(FIVE), firsts
    for m, (elapsed, _, steps) in firsts.items():  # each mode's clock starts at its first step, not before
        assert (elapsed, steps) == ("0.0", "1"), (m, elapsed, steps)

    assert gone(master_pid) and gone(servers_pid), "the master or the server process outlived the run"
    demo.proc.send_signal(signal.SIGINT)
    assert demo.rest() == 0
    with pytest.raises(OSError):
        scrape(url)


def test_sigterm_mid_run_stops_every_process(demo_factory) -> None:
    demo = demo_factory("--duration", "60")
    pids = demo.wait_for(r"Mooncake master pid (\d+) .* lookup servers pid (\d+)")
    demo.wait_for(r"^\[upstream sync ")
    demo.proc.send_signal(signal.SIGTERM)
    assert demo.rest() == 130
    assert any("interrupted" in line for line in demo.lines)
    assert gone(int(pids.group(1))) and gone(int(pids.group(2)))


def test_multi_turn_demo_shows_what_the_prefix_cache_spared_the_store(demo_factory) -> None:
    """``--workload multi-turn``: conversations through vLLM's scheduler; the table's prefix-cache columns are real
    counts (keys counted at the lookup server's store client), not estimates."""
    context = 128
    demo = demo_factory("--workload", "multi-turn", "--mode", "async", "--duration", "1.5", "--prompt-blocks",
                        str(context), "--turns", "4", "--conversations", "4")
    pids = demo.wait_for(r"Mooncake master pid (\d+) .* lookup servers pid (\d+)")
    demo.wait_for(rf"^workload: multi-turn, 4 conversations at once, each a {context}-block context .* 4 turns")
    demo.wait_for(r"within the master's key lease \(10000 ms\)")
    head = demo.wait_for(r"^mode +requests .* known +keys/lookup +no-RTT$")
    assert head
    fields = demo.wait_for(r"^ours async\b.*").group(0).split()[1:]
    requests, known, keys_per_lookup, no_rtt = int(fields[1]), float(fields[10]), float(fields[11]), int(fields[12])
    assert requests > 16, fields  # more than four conversations' worth of turns
    # A quarter of the lookups are first turns (every block asked); a later turn knows what came before.
    assert 0.2 < known < 1, fields
    # Without the cache every lookup would ask at least the context's blocks.
    assert 1 <= keys_per_lookup < context, fields
    assert no_rtt == 0, "lookup_prefix_cache_confirm_ms is 0: every lookup goes to the server"
    assert demo.rest() == 0
    assert gone(int(pids.group(1))) and gone(int(pids.group(2)))


def test_an_unknown_workload_is_refused_before_anything_starts(demo_factory) -> None:
    demo = demo_factory("--workload", "chat")
    assert demo.rest(30.0) == 2
    demo.stderr.seek(0)
    assert "invalid choice: 'chat'" in demo.stderr.read()
