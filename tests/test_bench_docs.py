"""The docs' measured figures come from the committed runs, and a doc that drifts from them fails the suite.

* A hand edit of a generated figure (README, tuning guide, bench results, reliability, metrics and security
  pages) is caught by ``cli.docs --check``,
  and so is a committed run whose figures changed under docs that were not regenerated.
* Whatever targets a run lists are rendered, with their ``what`` and ``bound`` texts: a new scenario's targets
  need no change to the renderer. Several runs render a column (or a ``/``-separated figure) each, beside
  their load averages; a run that lacks a scenario renders ``-`` there.
* Outside the generated blocks, the tuning guide and the bench results carry no hand-typed latency.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_lookout.connector.bench import doc_tables, security_tables, soak_tables
from mooncake_lookout.connector.bench.records import RUNS_DIR, Run, across, load_runs, load_soaks
from mooncake_lookout.connector.bench.run import format_report
from mooncake_lookout.connector.cli.docs import BLOCKS, end_marker, extract, stale_blocks, start_marker
from mooncake_lookout.connector.rigs.machine import commit

ROOT = Path(__file__).resolve().parents[1]
BENCH_BLOCKS = [b for b in BLOCKS if b.name.startswith(("bench-", "demo-output", "soak-", "first-run", "sink-cost",
                                                         "security-"))]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A copy of every file a generated block reads or is written to, and of the committed runs."""
    for rel in {b.path for b in BLOCKS} | {"helm/mooncake-lookout/values.schema.json"}:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    shutil.copytree(ROOT / RUNS_DIR, tmp_path / RUNS_DIR)
    return tmp_path


def check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mooncake_lookout.connector.cli.docs", "--check", "--root", str(root)],
                          capture_output=True, text=True, timeout=120)


def runs_of(*results: dict) -> list[Run]:
    return [Run(i + 1, f"docs/bench/run-{i + 1}.json", r) for i, r in enumerate(results)]


def first_run() -> dict:
    return json.loads((ROOT / RUNS_DIR / "run-1.json").read_text())


def cell(text: str, header_start: str, row_start: str, column: str) -> str:
    """The cell of ``column`` in the first table row of ``text`` that starts with ``row_start``, the columns named
    by the first line that starts with ``header_start``."""
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith(header_start))
    row = next(line for line in lines if line.startswith(row_start))
    return [c.strip() for c in row.split("|")][[c.strip() for c in header.split("|")].index(column)]


def test_the_committed_docs_are_the_committed_runs(checkout: Path) -> None:
    assert BENCH_BLOCKS, "no generated block draws on the committed runs"
    assert stale_blocks(checkout) == []
    done = check(checkout)
    assert done.returncode == 0, done.stderr


def test_a_hand_edit_of_any_generated_figure_is_caught(checkout: Path) -> None:
    """One digit edited by hand in every generated block at once; the check names each block (one check for all:
    a check per block cost the suite ~8 s each)."""
    for block in BENCH_BLOCKS:
        path = checkout / block.path
        text = path.read_text()
        body = extract(text, block.name)
        assert body is not None and re.search(r"\d", body), f"{block.path} has no figure in {block.name}"
        edited = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), body, count=1)  # one digit, by hand
        start = text.index(start_marker(block.name)) + len(start_marker(block.name))
        path.write_text(text[:start] + "\n" + edited + text[text.index(end_marker(block.name)):])
    done = check(checkout)
    assert done.returncode == 1
    missed = [f"{b.path}: {b.name}" for b in BENCH_BLOCKS if f"stale: {b.path}: {b.name}" not in done.stderr]
    assert not missed, f"hand edits the check did not catch: {missed}"


def test_a_run_whose_figures_changed_makes_the_docs_stale(checkout: Path) -> None:
    path = checkout / RUNS_DIR / "run-1.json"
    results = json.loads(path.read_text())
    results["targets"][0]["ratio"] = (results["targets"][0]["ratio"] or 0) + 0.5
    results["c"]["modes"][0]["call_us"]["p99"] += 1000.0
    path.write_text(json.dumps(results))
    stale = stale_blocks(checkout)
    assert "docs/bench-results.md: bench-targets" in stale and "docs/bench-results.md: bench-targets-per-run" in stale
    assert "docs/tuning.md: bench-modes" in stale
    stale_blocks(checkout, write=True)  # the generator brings the docs back in step
    assert stale_blocks(checkout) == []


def test_every_target_a_run_lists_is_rendered_with_its_what_and_bound() -> None:
    run = first_run()
    new = {"id": "g", "what": "multi-turn: keys sent per lookup from the second turn, ours / upstream",
           "ours": 3.0, "upstream": 60.0, "vs": "upstream", "unit": "keys", "ratio": 0.05, "bound": "<= 0.1",
           "met": True}
    run["targets"].append(new)
    runs = runs_of(run)
    summary, per_run = doc_tables.render_targets_summary(runs), doc_tables.render_targets_per_run(runs)
    for t in run["targets"]:
        assert f"({t['id']}) {doc_tables.target_label(t)}" in summary
        assert f"| {t['id']} | {t['what']} |" in per_run
        assert t["bound"] in summary and t["bound"] in per_run
    assert "3.00 vs 60.0 keys, ratio 0.05: met" in summary
    assert "| g | multi-turn" in per_run and "**missed**" not in per_run.split("| g |")[1].splitlines()[0]


def test_a_target_judged_at_its_worst_size_names_each_runs_size_in_its_own_cell() -> None:
    """f-delay is judged at whichever prompt size was worst in that run: the row's label cannot name one size for
    every run (it once said 64 blocks beside a run whose worst was 512), so each cell names its own."""
    one = first_run()
    two = copy.deepcopy(one)
    for run, worst in ((one, 64), (two, 512)):
        entry = next(t for t in run["targets"] if t["id"] == "f-delay")
        entry["what"] = f"answer delay p50, ours / upstream, at the worst size ({worst} blocks)"  # as old runs wrote
        entry["sizes"] = [{"blocks": b, "ratio": 1.02 if b == worst else 0.9} for b in (8, 64, 512, 4096)]
    row = next(line for line in doc_tables.render_targets_summary(runs_of(one, two)).splitlines()
               if line.startswith("| (f-delay) "))
    label, cells = row.split(" | ")[0], row.split(" | ")[2:4]
    assert "blocks)" not in label and "each run names its own" in label
    assert " at 64 blocks, " in cells[0] and " at 512 blocks, " in cells[1]


def test_the_prompt_length_table_shows_each_clients_whole_engine_step() -> None:
    """A request waits for engine steps (arrivals, schedule(), the model step, vLLM's update), not for schedule()
    alone: (f)'s table shows each client's mean step, the run's seconds over its steps (failed before: no such
    column, so a client cheaper in schedule() and dearer around it looked cheaper)."""
    run = first_run()
    mode = run["f"]["lengths"][0]["modes"]["ours async"]
    mode["seconds"], mode["steps"] = 6.5, 2000
    table = doc_tables.render_scenarios(runs_of(run)).split("(f) prompt length", 1)[1]
    row = f"| {run['f']['lengths'][0]['blocks']} | ours async |"
    assert cell(table, "| blocks ", row, "engine step mean (ms)") == "3.25"


def test_the_auto_calls_are_set_beside_the_step_round_trip_floor() -> None:
    """c2 divides a call that waits for a whole step's answers, after a model step, by one lookup asked warm: (c)'s
    section also sets it beside the floor of that same step (failed before: no such floor, no such line)."""
    run = first_run()
    run["floors"]["step_round_trip_us"] = {**run["floors"]["round_trip_us"], "p99": 500.0}
    auto = next(m for m in run["c"]["modes"] if m["label"] == doc_tables.AUTO)
    auto["call_us"]["p99"] = 600.0
    section = doc_tables.render_scenarios(runs_of(run)).split("**(c) vLLM's scheduler", 1)[1].split("**(d)", 1)[0]
    line = next(line for line in section.splitlines() if "step round-trip floor" in line)
    assert line.endswith(": 1.20")
    assert "| step round-trip floor |" in doc_tables.render_scenarios(runs_of(run))


def test_the_kernel_socket_floor_is_shown_beside_the_zmq_one_when_a_run_measured_it() -> None:
    """The round-trip floor is a ZMQ round trip: a run that also measured the same over a Unix socket shows it
    beside it, in (a)'s table and the tuning figures, so a reader sees what ZMQ adds (failed before: no such rows);
    runs from before it show no empty row."""
    run = first_run()
    before = copy.deepcopy(run)
    before["floors"].pop("socket_round_trip_us", None)  # a run from before the kernel-socket floor
    assert "kernel-socket" not in doc_tables.render_scenarios(runs_of(before))
    run["floors"]["socket_round_trip_us"] = {**run["floors"]["round_trip_us"], "p50": 21.5, "p99": 48.0}
    section = doc_tables.render_scenarios(runs_of(run)).split("**(a) one lookup call", 1)[1].split("**(a4)", 1)[0]
    assert cell(section, "| client ", "| kernel-socket round-trip floor |", "sync p50") == "21.5"
    figures = doc_tables.render_tuning_figures(runs_of(run))
    assert "| kernel-socket floor (the same over a Unix socket, no ZMQ), p50 | floors | 21.5 us |" in figures


def test_the_telemetry_table_shows_how_far_each_variants_processes_spread() -> None:
    """(d) judges 5% between variants measured in separate processes: its table also shows how far one variant's
    processes moved apart in the same run, so a reader sees whether the run resolves 5% (failed before: no such
    column, and a run whose processes spread 40% read as a telemetry cost)."""
    run = first_run()
    processes = run["d"]["processes"]
    for p, mean in zip((p for p in processes if p["variant"] == "off"), (500.0, 700.0, 550.0, 600.0, 650.0, 520.0)):
        p["schedule_us"]["mean"] = mean
    section = doc_tables.render_scenarios(runs_of(run)).split("**(d)", 1)[1].split("**(e)", 1)[0]
    assert cell(section, "| telemetry ", "| off |", "spread of its processes' means (%)") == "40.0"


def test_several_runs_render_one_column_or_figure_each_beside_their_load() -> None:
    one = first_run()
    two = copy.deepcopy(one)
    two["machine"]["loadavg_at_start"] = [0.25, 0.3, 0.4]
    two["machine"]["loadavg_at_end"] = [1.5, 0.5, 0.5]
    two["targets"] = [t for t in two["targets"] if t["id"] != "a"]  # a target one run lacks
    for m in two["c"]["modes"]:
        m["mean_deferred_steps"] = 9.99
    runs = runs_of(one, two)
    summary = doc_tables.render_targets_summary(runs)
    head = summary.splitlines()[0]
    assert "run 1 (full)" in head and "run 2 (full)" in head
    load_row = summary.splitlines()[2]
    assert runs[0].load_text in load_row and "0.25 -> 1.50" in load_row
    a_row = next(line for line in summary.splitlines() if line.startswith("| (a) "))
    met = next(t["met"] for t in one["targets"] if t["id"] == "a")
    assert a_row.endswith(f"| - | {int(met)} of 1 |")  # judged in the one run that has it
    modes = doc_tables.render_modes(runs)
    assert " / 9.99 |" in modes and "Each cell: run 1 / run 2." in modes
    assert doc_tables.render_reports(runs).count("### Run ") == 2
    assert doc_tables.render_runs(runs).count("`docs/bench/run-") == 2


def test_a_run_that_lacks_a_scenario_renders_dashes_not_errors() -> None:
    run = first_run()
    for key in ("f", "a4", "backends"):
        del run[key]
    runs = runs_of(run)
    assert "(f) prompt length" not in doc_tables.render_scenarios(runs)
    assert "(f) prompt length" not in format_report(run)
    assert across(runs, lambda r: r.get("f")) == "-"
    for render in (doc_tables.render_guarantees, doc_tables.render_modes, doc_tables.render_tuning_figures):
        assert render(runs)


def test_no_committed_run_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="run-1.json"):
        load_runs(tmp_path)
    (tmp_path / RUNS_DIR).mkdir(parents=True)
    (tmp_path / RUNS_DIR / "run-1.json").write_text(json.dumps({"quick": True}))
    with pytest.raises(ValueError, match="not a bench.json: no machine, targets"):
        load_runs(tmp_path)


def test_each_committed_run_is_a_bench_json_with_its_load_average() -> None:
    runs = load_runs(ROOT)
    for r in runs:
        m = r.results["machine"]
        assert len(m["loadavg_at_start"]) == 3 == len(m["loadavg_at_end"]), r.path
        assert m.get("date") and m.get("versions", {}).get("vllm"), r.path
        assert r.results["targets"] and all({"id", "what", "ours", "ratio", "bound", "met"} <= set(t)
                                            for t in r.results["targets"]), r.path


def test_each_committed_soak_renders_a_column_with_its_settings_and_load() -> None:
    soaks = load_soaks(ROOT)
    assert {s.transport for s in soaks} >= {"pipelined"}
    table = soak_tables.render_soak_table(soaks)
    assert table.splitlines()[0] == "| figure | " + " | ".join(s.transport for s in soaks) + " |"
    for s in soaks:
        assert s.results["machine"]["loadavg_at_end"] and s.results["settings"]["fault_rate"] > 0
        assert f"`{s.path}`" in table and s.load_text in table
        assert f"**{s.results['calls_over_bound']:,}** over" in table



def test_the_soak_commands_reproduce_the_committed_settings() -> None:
    """docs/reliability.md's "run it yourself" gives each committed soak's own settings (not the defaults), with
    flags the soak accepts."""
    soaks = load_soaks(ROOT)
    flags = subprocess.run([sys.executable, "-m", "mooncake_lookout.connector.rigs.soak", "--help"],
                           capture_output=True, text=True, timeout=60, check=True).stdout
    for s in soaks:
        command = soak_tables.soak_command(s)
        given = dict(re.findall(r"--([a-z-]+) (\S+)", command))
        assert float(given["fault-rate"]) == s.results["settings"]["fault_rate"]
        assert int(given["master-kills"]) == s.results["settings"]["master_kills"]
        assert int(given["lookups"]) == s.results["lookups"] and given["transport"] == s.transport
        assert float(given["timeout-ms"]) == s.results["timeout_ms"]
        assert [f for f in re.findall(r"--[a-z-]+", command) if f not in flags] == []
        assert command in (ROOT / "docs" / "reliability.md").read_text()


def test_no_committed_soak_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="soak-pipelined.json"):
        load_soaks(tmp_path)


def test_a_run_records_the_commit_it_measured(tmp_path: Path) -> None:
    assert re.fullmatch(r"[0-9a-f]{12}(\+dirty)?", commit() or ""), commit()
    assert commit(tmp_path) is None  # not a checkout: no commit claimed


def _prose(text: str) -> str:
    """``text`` without its generated blocks and code fences: what a person typed."""
    text = re.sub(r"<!-- ([\w-]+):start -->.*?<!-- \1:end -->", "", text, flags=re.S)
    return re.sub(r"```.*?```", "", text, flags=re.S)


# Settings and scenario set-ups (not measurements) that the prose may name.
SETTINGS = {"50 us", "1.5 ms", "20 ms", "40 ms", "100 ms", "200 ms"}


@pytest.mark.parametrize("name", ["docs/tuning.md", "docs/bench-results.md", "docs/security.md"])
def test_no_hand_typed_latency_outside_the_generated_blocks(name: str) -> None:
    typed = set(re.findall(r"\b\d[\d,.]*\s?(?:us|ms)\b", _prose((ROOT / name).read_text())))
    assert typed <= SETTINGS, f"{name}: figures typed by hand (generate them from docs/bench/): {typed - SETTINGS}"
    assert not re.search(r"\brun \d+ of\b|\bruns? [1-9]\d*(-\d+)? (?:of|on)\b", _prose((ROOT / name).read_text()))


def test_a_security_run_whose_figures_changed_makes_the_security_doc_stale(checkout: Path) -> None:
    path = checkout / security_tables.SECURITY_FILE
    results = json.loads(path.read_text())
    results["flood"]["rounds"][0]["flood_us"]["shared"]["p99"] += 1000.0
    results["curve"]["curve"]["single_us"]["p50"] += 7.0
    path.write_text(json.dumps(results))
    stale = stale_blocks(checkout)
    assert "docs/security.md: bench-security-flood" in stale and "docs/security.md: bench-security-curve" in stale
    stale_blocks(checkout, write=True)
    assert stale_blocks(checkout) == []


def test_the_flood_verdict_is_rendered_as_the_run_judged_it() -> None:
    results = security_tables.load_security(ROOT)
    rounds = results["flood"]["rounds"]
    table = security_tables.render_security_flood(results)
    assert f"**met in {sum(r['met'] for r in rounds)} of {len(rounds)} rounds**" in table
    missed = copy.deepcopy(results)
    missed["flood"]["rounds"][0].update(met=False, p99_ratio=2.5)
    assert "**2.50**: **missed**" in security_tables.render_security_flood(missed)
    assert f"**met in {sum(r['met'] for r in rounds[1:])} of {len(rounds)} rounds**" in \
        security_tables.render_security_flood(missed)


def test_no_committed_security_run_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="security.json"):
        security_tables.load_security(tmp_path)
