"""``--help`` on the README's scripts answers at once and installs nothing; the demo's help lists every demo flag.

The scripts are run with ``LOOKOUT_VENV`` / ``LOOKOUT_TOOLS`` pointing at folders that do not exist: the set-up
would create them (and take minutes filling them) before anything else, so their absence afterwards, within a
bound far below a set-up's time, shows that nothing was installed.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
from pathlib import Path

import pytest

from mooncake_lookout.connector.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 30  # a help text; the set-up it must not run takes minutes


def run_script(script: str, args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[Path]]:
    venv, tools, cache, engine = tmp_path / "venv", tmp_path / "tools", tmp_path / "cache", tmp_path / "engine"
    env = {**os.environ, "LOOKOUT_VENV": str(venv), "LOOKOUT_TOOLS": str(tools), "LOOKOUT_CACHE": str(cache),
           "LOOKOUT_ENGINE_VENV": str(engine)}
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / script), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=BOUND_S)
    except subprocess.TimeoutExpired:  # it went on to install: stop it and everything it started, by group
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"{script} {args} still ran after {BOUND_S} s (installing?): {err[-2000:]}")
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done, [p for p in (venv, tools, cache, engine) if p.exists()]


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["--duration", "small", "--help"]])
def test_demo_help_prints_the_generated_help_and_installs_nothing(args: list[str], tmp_path: Path) -> None:
    done, created = run_script("demo.sh", args, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (ROOT / "scripts" / "demo-help.txt").read_text()
    assert created == [] and "[setup" not in done.stderr


def test_demo_help_lists_every_flag_of_the_demo() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["demo"]
    text = (ROOT / "scripts" / "demo-help.txt").read_text()
    flags = [s for a in sub._actions if not isinstance(a, argparse._HelpAction) for s in a.option_strings]
    assert len(flags) >= 10
    assert [f for f in flags if f not in text] == []


@pytest.mark.parametrize("script,expect", [("test.sh", "usage: bash scripts/test.sh"),
                                           ("setup.sh", "Installs everything mooncake-lookout needs"),
                                           ("setup-engine.sh", "Installs the real-engine environment"),
                                           ("prereqs.sh", "bash scripts/prereqs.sh --dry-run"),
                                           ("clean-root.sh", "bash scripts/clean-root.sh --check")])
def test_other_scripts_help_installs_nothing(script: str, expect: str, tmp_path: Path) -> None:
    done, created = run_script(script, ["--help"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert expect in done.stdout
    assert created == [] and "[setup" not in done.stderr
