"""The ``mooncake-lookout`` command line: subcommands wired, bad input refused with a clear message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_lookout.connector.cli import build_parser, main
from mooncake_lookout.connector.cli.demo import parse_duration

SCRIPT = Path(sys.executable).parent / "mooncake-lookout"


def test_console_script_lists_every_subcommand() -> None:
    out = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in ("demo", "bench", "serve", "doctor", "advise", "size"):
        assert name in out.stdout


def test_every_subcommand_has_a_handler() -> None:
    parser = build_parser()
    for argv in (["demo"], ["bench", "--quick"], ["serve", "--embedded-master"], ["doctor"],
                 ["advise", "--prometheus", "http://127.0.0.1:9090"], ["size", "--engines", "4"]):
        assert callable(parser.parse_args(argv).func)


@pytest.mark.parametrize("text,seconds", [("small", 5.0), ("default", 10.0), ("12.5", 12.5)])
def test_duration_accepts_seconds_and_names(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["0", "-3", "soon", "99999"])
def test_bad_duration_is_refused_with_its_value(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--duration", text])
    assert exc.value.code == 2
    assert text in capsys.readouterr().err


@pytest.mark.parametrize("argv,words", [
    (["demo", "--pause-master", "-1"], "--pause-master"), (["demo", "--mode", "fast"], "--mode"),
    (["advise", "--prometheus", "http://p", "--window", "1h30m"], "--window"),
    (["advise", "--window", "1h"], "--prometheus"),
])
def test_bad_demo_and_advise_flags_are_refused(argv: list[str], words: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert words in capsys.readouterr().err


def test_doctor_names_the_bad_config_key(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--config", json.dumps({"lookup_timout_ms": 5})]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "lookup_timout_ms" in out


def test_doctor_accepts_a_good_config_from_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "extra.json"
    path.write_text(json.dumps({"lookup_async": True, "lookup_wait_us": 200, "load_async": False}))
    assert main(["doctor", "--config", f"@{path}"]) == 0
    assert "mode budget" in capsys.readouterr().out


def test_doctor_with_nothing_to_check_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 2
    assert "nothing to check" in capsys.readouterr().out
