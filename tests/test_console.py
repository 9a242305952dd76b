"""The tools' console (``connector/rigs/console.py``): known harmless start-up lines are held back, counted and
named; every other line, errors included, comes through; ``--verbose`` shows everything.

The first tests write to file descriptor 2 as Mooncake's C++ logging does (``os.write``, no Python in between)
and log through real loggers; the last runs ``bash scripts/demo.sh`` as a newcomer does and reads its combined
stdout and stderr.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from pathlib import Path

import pytest

from mooncake_lookout.connector.rigs.console import KNOWN_LINES, Console, known_line

ROOT = Path(__file__).resolve().parents[1]
GLOG_WARNING = "WARNING: Logging before InitGoogleLogging() is written to STDERR\n"
GLOG_ERROR = "E1201 13:58:18.418861 15188 transfer_metadata.cpp:1098] Local segment descriptor not found\n"
REAL_ERROR = "E1201 13:58:19.000001 15188 client.cpp:77] Failed to connect to master 127.0.0.1:1\n"


def test_native_lines_are_held_and_replayed_without_the_known_ones(capfd: pytest.CaptureFixture[str]) -> None:
    console = Console()
    with console.native():
        os.write(2, (GLOG_WARNING + GLOG_ERROR + REAL_ERROR).encode())
    err = capfd.readouterr().err
    assert err == REAL_ERROR  # the real error comes through, whole; the two known lines do not
    assert sum(console.hidden.values()) == 2
    summary = console.summary()
    assert summary is not None and "--verbose" in summary and "Mooncake" in summary
    assert not re.match(r"^E\d", summary)


def test_native_lines_are_replayed_when_the_block_raises(capfd: pytest.CaptureFixture[str]) -> None:
    console = Console()
    with pytest.raises(RuntimeError), console.native():
        os.write(2, REAL_ERROR.encode())
        raise RuntimeError("set-up failed")
    assert capfd.readouterr().err == REAL_ERROR


def test_verbose_holds_nothing_back(capfd: pytest.CaptureFixture[str]) -> None:
    console = Console(verbose=True)
    with console.native():
        os.write(2, GLOG_ERROR.encode())
    assert capfd.readouterr().err == GLOG_ERROR
    assert console.summary() is None


def test_log_records_of_known_lines_are_dropped_and_others_kept(capfd: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level, os.environ.get("VLLM_CONFIGURE_LOGGING"))
    try:
        console = Console(level="WARNING").install()
        vllm = logging.getLogger("vllm.platforms.interface")
        vllm.warning("Failed to import from vllm._C: %r", ModuleNotFoundError("No module named 'vllm._C'"))
        vllm.error("a real error: %s", "the engine died")
        err = capfd.readouterr().err
        assert "Failed to import" not in err and "a real error: the engine died" in err
        assert console.hidden["Failed to import from vllm._C"] == 1
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
        logging.captureWarnings(False)
        if saved[2] is None:
            os.environ.pop("VLLM_CONFIGURE_LOGGING", None)


def test_every_known_line_is_named_in_the_troubleshooting_page() -> None:
    """docs/troubleshooting.md quotes each line the tools hold back, so a reader who sees one (inside vLLM, or
    with --verbose) finds what it means."""
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert [k.text for k in KNOWN_LINES if k.text not in page] == []
    assert known_line(GLOG_ERROR) is not None and known_line(REAL_ERROR) is None


NOISE = (re.compile(r"^E\d"), re.compile(r"Failed to import"), re.compile(r"Logging before InitGoogleLogging"))


def _demo_script(*args: str) -> list[str]:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout.splitlines()


@pytest.mark.timeout(700)
def test_the_demo_script_prints_no_start_up_noise_unless_verbose() -> None:
    """The README's first command, as a newcomer runs it: combined stdout and stderr hold no line that starts with
    ``E`` and a digit, no ``Failed to import``, no ``Logging before InitGoogleLogging``; one line says what was held
    back. With ``--verbose`` the same lines are there (so the quiet run hid them; it did not just miss them)."""
    quiet = _demo_script("--duration", "small")
    assert [line for line in quiet if any(rx.search(line) for rx in NOISE)] == []
    # Its set-up is the demo's part only: no test tools, helm, dependency wheels or clean Debian root.
    setup = [line for line in quiet if line.startswith("[setup]")]
    assert setup and setup[-1].startswith("[setup] done (the demo's part"), setup
    tools = ("clean", "helm", "wheels", "prometheus", "alertmanager", "etcd", "debootstrap")
    assert [line for line in setup if any(t in line.lower() for t in tools)] == [], setup
    assert any(line.startswith("Reading:") for line in quiet), quiet[-20:]
    assert any("hidden, none of them a fault: --verbose shows them" in line for line in quiet), quiet[-5:]
    loud = _demo_script("--duration", "1", "--mode", "async", "--verbose")
    for rx in NOISE:
        assert any(rx.search(line) for line in loud), (rx.pattern, loud[:20])
