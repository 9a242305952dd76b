"""Adoption defects of the docs and the tools that write them (issue 50, item 9): what a figure says comes from the
committed runs, a run recorded on a checkout with local changes is named as such (and ``record`` refuses one), and
the modes section does not count its rows wrongly."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

from mooncake_lookout.connector.bench import doc_tables
from mooncake_lookout.connector.bench.records import Run, load_runs
from mooncake_lookout.connector.cli import docs
from mooncake_lookout.connector.cli.record import dirty_refusal

ROOT = Path(__file__).resolve().parents[1]
NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6}


def test_tuning_says_how_long_a_full_bench_took_from_the_committed_runs() -> None:
    """tuning.md's "Measure" once said "about 20 minutes" by hand while the committed runs took under 10: the
    sentence is now a generated block whose seconds are the runs' own."""
    body = docs.extract((ROOT / "docs/tuning.md").read_text(), "bench-took")
    assert body is not None, "docs/tuning.md has no bench-took block"
    took = [r.results["seconds"] for r in load_runs(ROOT) if r.kind == "full"]
    assert f"{min(took):.0f}-{max(took):.0f} s" in body or f"took {min(took):.0f} s" in body, body
    assert "20 minutes" not in (ROOT / "docs/tuning.md").read_text()


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, timeout=30)


def test_record_refuses_a_checkout_with_local_changes(tmp_path: Path) -> None:
    """A real git checkout: clean, record may go on; a tracked file changed, it refuses, unless --allow-dirty."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "one")
    assert dirty_refusal("demo", tmp_path) is None
    (tmp_path / "a.txt").write_text("two\n")
    refusal = dirty_refusal("demo", tmp_path)
    assert refusal is not None and "+dirty" in refusal and "commit first" in refusal, refusal
    assert dirty_refusal("demo", tmp_path, allow=True) is None
    assert dirty_refusal("first-run", tmp_path) is None  # it clones HEAD: what it measures is a commit


def test_a_run_recorded_on_a_dirty_checkout_is_named_under_the_runs_table() -> None:
    runs = load_runs(ROOT)
    clean = [Run(r.number, r.path, {**r.results, "machine": {**r.results["machine"], "commit": "0123456789ab"}})
             for r in runs]
    assert "local changes" not in doc_tables.render_runs(clean)
    dirty = copy.deepcopy(clean)
    dirty[-1].results["machine"]["commit"] = "0123456789ab+dirty"
    text = doc_tables.render_runs(dirty)
    assert f"Run {dirty[-1].number}: the commit ends in `+dirty`: it ran with local changes" in text, text


def test_the_modes_section_counts_the_modes_its_table_lists() -> None:
    """configuration.md once said "The three modes" over a table of four rows (the README's line to it repeated it)."""
    text = (ROOT / "docs/configuration.md").read_text()
    heading = re.search(r"^## (The .*modes.*)$", text, re.M)
    assert heading, "no modes section"
    section = text[heading.end():].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith(("| mode", "| ---"))]
    assert len(rows) == 4, rows
    (readme_line,) = [line for line in (ROOT / "README.md").read_text().splitlines()
                      if "(docs/configuration.md)" in line and "modes" in line]
    for where, line in (("docs/configuration.md", heading.group(1)), ("README.md", readme_line)):
        for word, n in NUMBERS.items():
            if re.search(rf"\b{word} modes\b", line, re.I):
                assert n == len(rows), f"{where} says {word} modes; the table lists {len(rows)}"
