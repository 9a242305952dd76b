"""The docs stay true to the code: what a reader acts on is checked against its one source, so a change that makes a
doc false fails here.

* No doc names a code symbol (a backticked ``snake_case``, ``CamelCase`` or dotted name) that cannot be found in
  the code: ours, the chart, the scripts, or the libraries it names (vLLM, Mooncake, OpenTelemetry,
  prometheus_client, pyzmq). A renamed or removed function leaves no doc describing it.
* No user doc cites a tracker number ("issue 19", "#17"): a reader cannot resolve them. Upstream's issues are
  cited with their repository (``vllm-project/vllm#55113``).
* Every relative link leads to a file, and every ``#anchor`` to a heading of it (GitHub's slugs).
* Claims with one source in the code: the GPU Mooncake wheel, the label lists of ``info``, the reasons a help
  text lists, the chart's transfer ports, auto's probe cadence and margin, the plugin's entry-point name, the
  dashboard panels the runbook sends operators to (and that the ``server_*`` ones are a standalone ``serve``'s),
  the messages troubleshooting.md quotes, the lease advice.
* The README is a landing page: at most 200 lines, the sections a newcomer needs, the pages it links to exist.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import sys
from functools import cache
from pathlib import Path

import pytest

from mooncake_lookout.connector import wait_budget
from mooncake_lookout.connector.config import TIMEOUT_MS
from mooncake_lookout.metrics import catalogue as cat

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = sorted([ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "CHANGELOG.md", *ROOT.glob("docs/*.md"),
                    ROOT / "helm" / "mooncake-lookout" / "README.md"])
CODE_DIRS = ("connector", "metrics", "dashboards", "helm", "scripts", "docker", ".ci")
CODE_SUFFIXES = {".py", ".yaml", ".yml", ".json", ".tpl", ".sh", ".txt", ".toml", ".Dockerfile", ""}
LIBRARIES = ("vllm", "mooncake", "opentelemetry", "prometheus_client", "zmq")
# Names a doc may give that no code here or in those libraries spells: each defined elsewhere, said where.
OUTSIDE = {
    "GITHUB_TOKEN": "GitHub Actions' own token (docs/helm.md, publishing images)",
    "IPC_LOCK": "a Linux capability that RDMA pods need (docs/helm.md)",
    "ha_state": "a field of the Mooncake master's /health answer with HA (its binary, not its Python)",
    "leader_address": "a field of the Mooncake master's /health answer with HA",
    "etcd_mvcc_db_total_size_in_bytes": "etcd's own metric of its database size (docs/helm.md, the quota)",
    # vllm-project/production-stack's values keys (docs/integrate.md; tests/test_integrate.py checks each against
    # that chart's values.schema.json, vendored in tests/data/production-stack).
    **{key: "production-stack's values (docs/integrate.md)" for key in (
        "lmcacheConfig", "lmcacheConfig.enabled", "servingEngineSpec.modelSpec",
        "servingEngineSpec.serviceMonitor.enabled", "vllmConfig.extraArgs", "vllmConfig.v0",
        "vllmConfig.enablePrefixCaching")},
}
FILE_NAME = re.compile(r".+\.(py|json|yaml|yml|md|sh|txt|toml|png|tpl)$")


def prose(text: str) -> str:
    """``text`` without fenced code blocks (commands and outputs, checked elsewhere)."""
    return re.sub(r"```.*?```", "", text, flags=re.S)


@cache
def code_files() -> tuple[Path, ...]:
    """Our code (not the tests) and the libraries the docs name."""
    files = [p for d in CODE_DIRS for p in (ROOT / d).rglob("*") if p.is_file() and
             (p.suffix in CODE_SUFFIXES or p.name.endswith("Dockerfile"))]
    files.append(ROOT / "pyproject.toml")
    for name in LIBRARIES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            for folder in spec.submodule_search_locations:
                files += [p for p in Path(folder).rglob("*") if p.suffix in {".py", ".pyi"}]
    return tuple(files)


@cache
def code_index() -> tuple[frozenset[str], dict[str, list[frozenset[str]]]]:
    """Every identifier-like word of :func:`code_files` (and each metric's sample names), and for each class name
    the words of every file that defines it (where ``Class.attribute`` must be found)."""
    words: set[str] = set()
    classes: dict[str, list[frozenset[str]]] = {}
    for path in code_files():
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        found = frozenset(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
        words |= found
        for name in re.findall(r"^\s*class (\w+)", text, re.M):
            classes.setdefault(name, []).append(found)
    for spec in cat.CATALOGUE:  # a counter's samples end in _total: the catalogue spells the family
        for name in (spec.name, *spec.sample_names):
            words.update({name, name.removeprefix(cat.PREFIX)})
    return frozenset(words), classes


@cache
def our_code_text() -> str:
    return "\n".join(p.read_text(errors="replace") for p in code_files() if ROOT in p.parents)


def defined(symbol: str) -> bool:
    """Whether ``symbol`` (``a_b``, ``Class``, ``Class.attr``, ``module.path``, ``file.py``) is in the code."""
    if symbol in OUTSIDE:
        return True
    if FILE_NAME.fullmatch(symbol):  # a file in the repository, or one the code reads or writes by that name
        return any(ROOT.rglob(symbol)) or symbol in our_code_text()
    words, classes = code_index()
    head, *rest = symbol.split(".")
    if rest and head in classes:  # Class.attr: the attribute is in a file that defines the class
        return any(all(part in found for part in rest) for found in classes[head])
    return all(part in words for part in symbol.split("."))


def named_symbols(text: str) -> set[str]:
    """Backticked single tokens that read as code: ``a_b``, ``CamelCase``, ``a.b``, or a call of one (``a.b(x)``)."""
    out = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        token = re.sub(r"\(.*\)$", "", span)  # a call: the name called
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", token):
            continue
        if "_" in token or "." in token or re.search(r"[a-z][A-Z]", token):
            out.add(token)
    return out


@pytest.mark.parametrize("path", [p for p in USER_DOCS if p.name != "CHANGELOG.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_names_a_symbol_the_code_lacks(path: Path) -> None:
    missing = sorted(s for s in named_symbols(path.read_text()) if not defined(s))
    assert missing == [], f"{path.name} names what no code defines (renamed or removed?): {missing}"


def test_the_symbol_check_catches_what_the_tracing_section_once_named() -> None:
    """What docs/metrics.md described before it was rewritten: a method that never existed."""
    stale = named_symbols("the adapter calls `tracing_observer.set_parent_headers(request.request_id, "
                          "request.trace_headers)` before it starts the lookup")
    assert stale == {"tracing_observer.set_parent_headers"}
    assert not defined("tracing_observer.set_parent_headers") and not defined("TracingObserver.set_parent_headers")
    assert defined("LookupRecord.trace_headers") and defined("tracing_observer_from_env") and defined("bench.json")


TRACKER = re.compile(r"(?i)\bissues? \d+|(?<![\w/.(-])#\d+\b")


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_user_doc_cites_a_tracker_number(path: Path) -> None:
    cited = TRACKER.findall(path.read_text())
    assert cited == [], f"{path.name} cites tracker numbers a reader cannot resolve: {cited}"


def test_the_tracker_check_tells_a_bare_number_from_an_upstream_reference() -> None:
    assert TRACKER.findall("the prefix cache (issue 19) and issues 12 and 13, see #17")
    assert not TRACKER.findall("[vllm-project/vllm#55113](https://github.com/vllm-project/vllm/issues/55113)")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a id="([^"]+)"', path.read_text()))
    for heading in re.findall(r"^#{1,6} (.+)$", prose(path.read_text()), re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


@pytest.mark.parametrize("path", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_a_heading(path: Path) -> None:
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(path.read_text())):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    assert broken == [], f"{path.name}: links to nothing: {broken}"


def test_the_link_check_knows_githubs_slugs() -> None:
    assert slug("2. The trade-off, mode by mode") == "2-the-trade-off-mode-by-mode"
    assert slug("4. `doctor` inside an engine pod") == "4-doctor-inside-an-engine-pod"
    assert slug("The engines and store pods: segment, local buffer, /dev/shm") == \
        "the-engines-and-store-pods-segment-local-buffer-devshm"


# -- claims with one source in the code --------------------------------------------------------------------------

def test_gpu_hosts_are_told_the_cuda13_wheel() -> None:
    """The plain ``mooncake-transfer-engine`` is the CUDA 12 build; a doc may name it only to say so or to remove it."""
    wrong = []
    for path in USER_DOCS:
        for line in path.read_text().splitlines():
            if re.search(r"mooncake-transfer-engine(?![-\w])", line) and not re.search(
                    r"cuda13|CUDA 12|remove|uninstall", line, re.I):
                wrong.append(f"{path.name}: {line.strip()}")
    assert wrong == []
    from mooncake_lookout.connector.server.store import INSTALL_HINT

    assert "mooncake-transfer-engine-cuda13" in INSTALL_HINT


def test_every_info_label_list_a_doc_writes_is_the_catalogues() -> None:
    for path in USER_DOCS:
        for labels in re.findall(r"info\{([a-z_, ]+)\}", path.read_text()):
            assert [x.strip() for x in labels.split(",")] == list(cat.INFO.labels), path.name


@pytest.mark.parametrize("spec,values", [(cat.ANSWERS_DROPPED, cat.DROP_REASONS),
                                         (cat.PREFIX_CACHE_CLEARS, cat.CACHE_CLEAR_REASONS),
                                         (cat.SERVER_REQUESTS, cat.SERVER_STATUSES)], ids=lambda x: str(x)[:30])
def test_a_help_text_that_lists_label_values_lists_them_all(spec: cat.MetricSpec, values: tuple[str, ...]) -> None:
    assert [v for v in values if not re.search(rf"\b{v}\b", spec.help)] == [], spec.name


def test_every_drop_reason_the_client_emits_is_catalogued() -> None:
    """The reasons the client drops an answer for: named where it drops one (``_dropped(lookup, "evicted")``), or
    returned by the prefix cache's one trust check (``StoreView.untrusted``), whose verdict it drops for."""
    emitted = set()
    for path in (ROOT / "connector").rglob("*.py"):
        emitted |= set(re.findall(r"_dropped\(\w+, \"(\w+)\"", path.read_text()))
    source = (ROOT / "connector" / "prefix_cache.py").read_text()
    untrusted = source.split("def untrusted(", 1)[1].split("\n    def ", 1)[0]
    emitted |= set(re.findall(r"return \"(\w+)\"", untrusted))
    assert emitted == set(cat.DROP_REASONS), emitted


def test_transfer_port_ranges_in_the_docs_are_the_charts() -> None:
    import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

    ports = chart.load_values()["transferPorts"]
    chart_range = f"{ports['min']}-{ports['max']}"
    docs = [p for p in USER_DOCS if p.name not in ("helm.md", "CHANGELOG.md")]  # helm.md shows value sets' own
    found = {(p.name, r) for p in docs for r in re.findall(r"\b(1\d{4}-1\d{4})\b", p.read_text())}
    assert found and {r for _, r in found} == {chart_range}, found


def test_auto_probe_cadence_and_margin_are_the_codes() -> None:
    for path in USER_DOCS:
        text = path.read_text()
        for n in re.findall(r"one step (?:in|of) (\d+)", text):
            assert int(n) == wait_budget.PROBE_EVERY, path.name
    assert f"one step in {wait_budget.PROBE_EVERY}" in (ROOT / "docs" / "configuration.md").read_text()
    assert f"+ {wait_budget.MARGIN_S * 1e6:.0f} us" in (ROOT / "docs" / "configuration.md").read_text()


def test_the_plugin_name_the_docs_give_is_the_entry_points() -> None:
    (name,) = [e.name for e in importlib.metadata.entry_points(group="vllm.general_plugins")
               if e.value.startswith("mooncake_lookout.")]
    for doc in ("README.md", "docs/deploy.md", "docs/troubleshooting.md"):
        text = (ROOT / doc).read_text()
        assert "VLLM_PLUGINS" in text and f"`{name}`" in text, doc


def dashboard_titles() -> tuple[set[str], set[str]]:
    """(every panel and row title, the titles of panels whose queries read only the lookup server's families)."""
    titles, server_only = set(), set()
    sys.path.insert(0, str(ROOT / "dashboards"))
    try:
        import lint
    finally:
        sys.path.remove(str(ROOT / "dashboards"))
    for name in ("mooncake-lookups-overview.json", "mooncake-lookups-tuning.json"):
        for panel in lint.iter_panels(json.loads((ROOT / "dashboards" / name).read_text())):
            titles.add(panel["title"])
            exprs = [t.get("expr", "") for t in panel.get("targets", [])]
            if exprs and all(re.findall(r"vllm:mooncake_lookup_\w+", e) and
                             all(m.startswith("vllm:mooncake_lookup_server_")
                                 for m in re.findall(r"vllm:mooncake_lookup_\w+", e)) for e in exprs):
                server_only.add(panel["title"])
    return titles, server_only


def test_the_runbook_names_panels_that_exist_and_says_when_server_panels_are_empty() -> None:
    titles, server_only = dashboard_titles()
    assert server_only, "no panel reads only server_* families: the check below would prove nothing"
    text = (ROOT / "docs" / "runbook.md").read_text()
    named = set(re.findall(r"(?<!\*)\*([A-Z][^*\n]+)\*(?!\*)", text))
    rows = {t.split(" (")[0] for t in titles}
    assert [n for n in named if n not in titles and n not in rows and "row" not in n] == []
    for bullet in re.split(r"\n(?=- |\*\*|## )", text):
        for title in server_only:
            if f"*{title}*" in bullet:
                assert "standalone" in bullet, (title, bullet)


def test_no_doc_advises_a_shorter_lease_to_save_keys() -> None:
    """The lease only holds a found key from eviction; under twice lookup_answer_ttl_ms it turns the prefix cache off.
    The runbook once advised it twice, in these words."""
    for path in USER_DOCS:
        text = re.sub(r"\s+", " ", path.read_text())
        assert not re.search(r"with a shorter `--default_kv_lease_ttl`|[Ss]horter lease TTL or", text), path.name


def test_the_messages_troubleshooting_quotes_are_the_codes() -> None:
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    section = text.split("## What `doctor` says", 1)[1].split("\n## ", 1)[0]
    quoted = re.findall(r"^\| [^|]+ \| `([^`]+)`", section, re.M)
    assert len(quoted) >= 10
    code = "\n".join(p.read_text() for p in (ROOT / "connector").rglob("*.py"))
    assert [q for q in quoted if q not in code] == []
    quoted_error = text.split("## The lease ERROR", 1)[1].split("```", 2)[1].strip()
    from mooncake_lookout.connector.server import lease

    source = Path(lease.__file__).read_text()
    assert "raise LeaseTooShort(lease_rule(ttl_s, lease_s, measured=True), lease_s)" in source
    seen = re.search(r"the lease is about (\d+) ms", quoted_error)
    assert seen, quoted_error
    message = lease.lease_rule(5.0, int(seen.group(1)) / 1000, measured=True)  # the defaults' ttl, 5000 ms
    logged = re.search(r'logger\.error\("%s([^"]+)", e\)', source)
    assert logged and quoted_error == f"{message}{logged.group(1)}"


# -- the README is a landing page -------------------------------------------------------------------------------

def test_the_readme_is_a_landing_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    for section in ("## Why", "## Try it: two commands", "## Deploy it", "## Tune it, run it, fix it",
                    "## Verified here, and not"):
        assert section in text, section
    for page in ("docs/deploy.md", "docs/troubleshooting.md", "docs/configuration.md"):
        assert (ROOT / page).exists() and f"]({page})" in text, page
    # Each table lives in one place: the README holds none of the generated reference tables.
    for block in ("config-table", "metrics-table", "bench-targets", "bench-guarantees", "soak-summary"):
        assert f"<!-- {block}:start -->" not in text, block


def test_the_data_path_picture_names_every_process_and_exit() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    picture = text.split("## The data path", 1)[1].split("```mermaid", 1)[1].split("```", 1)[0]
    for part in ("API server", "engine-core", "scheduler", "LookupClient", "rank 0", "LookupServer",
                 "LookupKeyServer", "Mooncake master", "/metrics", "spans", "Prometheus", "ipc://"):
        assert part in picture, part


# -- bench cells: one statistic each ------------------------------------------------------------------------------

@pytest.mark.parametrize("doc,block", [("docs/tuning.md", "bench-figures"), ("docs/tuning.md", "bench-modes"),
                                       ("docs/tuning.md", "bench-multi-turn"),
                                       ("docs/bench-results.md", "bench-scenarios")])
def test_a_bench_cell_holds_one_statistic_one_figure_per_run(doc: str, block: str) -> None:
    """The footer says "each cell: run 1 / run 2 / ..."; a cell that joins two statistics (p50 / p99) with the same
    "/" reads wrong, so each cell holds exactly one figure per run."""
    from mooncake_lookout.connector.bench.records import load_runs
    from mooncake_lookout.connector.cli.docs import extract

    runs = len(load_runs(ROOT))
    body = extract((ROOT / doc).read_text(), block)
    assert body is not None
    wrong = []
    lines = body.splitlines()
    for i, line in enumerate(lines):
        header = i + 1 < len(lines) and lines[i + 1].startswith("| ---")
        if not line.startswith("| ") or header or line.startswith("| ---"):
            continue
        for cell in line.strip("|").split(" | ")[1:]:
            parts = cell.split(" / ")
            if len(parts) > 1 and len(parts) != runs:
                wrong.append(cell)
    assert wrong == [], f"{doc} {block}: cells with other than {runs} figures: {wrong[:5]}"


# Settings and bounds (not measurements) the prose may name: histogram bounds, auto's margin, default deadlines.
SETTINGS = {"10 us", "50 us", "100 ms", "200 ms", "5000 ms",  # settings of a test or a default, not measurements
            f"{TIMEOUT_MS:g} ms"}  # lookup_timeout_ms auto's deadline


@pytest.mark.parametrize("name", ["README.md", "docs/store.md", "docs/metrics.md", "docs/security.md",
                                  "docs/deploy.md", "docs/troubleshooting.md", "docs/configuration.md"])
def test_no_hand_typed_measurement_outside_generated_blocks(name: str) -> None:
    """A measured figure comes from a committed run with its date, commit and load (a generated block); the prose of
    these pages types none (it once quoted store latencies, telemetry costs and security figures by hand)."""
    text = re.sub(r"<!-- ([\w-]+):start -->.*?<!-- \1:end -->", "", (ROOT / name).read_text(), flags=re.S)
    typed = set(re.findall(r"\b\d[\d,.]*\s?(?:us|ms)\b", prose(text)))
    assert typed <= SETTINGS, f"{name}: figures typed by hand (generate them from docs/bench/): {typed - SETTINGS}"


def test_the_committed_demo_output_is_whole_and_says_where_it_ran() -> None:
    """docs/bench/demo.txt is what ``bash scripts/demo.sh --duration small`` printed, stdout and stderr together (the
    set-up's ``[setup]`` lines go to stderr), under a line with its date, commit and load; README shows its end."""
    from mooncake_lookout.connector.bench import doc_tables

    lines = (ROOT / "docs" / "bench" / "demo.txt").read_text().splitlines()
    assert re.fullmatch(r"# bash scripts/demo\.sh --duration small: \d{4}-\d\d-\d\dT[\d:]+Z, commit \S+, \d+ CPUs, "
                        r"load average \(1 min\) [\d.]+ -> [\d.]+; its whole output, stdout and stderr as they came",
                        lines[0]), lines[0]
    assert any(line.startswith("[setup] ") for line in lines), "the set-up's stderr lines are missing"
    noise = re.compile(r"^E\d|.*Failed to import|.*Logging before InitGoogleLogging")
    assert [line for line in lines if noise.match(line)] == []
    with pytest.raises(ValueError, match="say where it ran"):
        doc_tables.render_demo("\n".join(lines[1:]))


def test_the_committed_engine_demo_output_is_whole_and_says_where_it_ran() -> None:
    """docs/bench/engine-demo.txt is what ``bash scripts/demo.sh --engine`` printed (the engine venv's set-up lines
    included), under a line with its date, commit and load; it holds every mode's row and the demo's run time."""
    lines = (ROOT / "docs" / "bench" / "engine-demo.txt").read_text().splitlines()
    assert re.fullmatch(r"# bash scripts/demo\.sh --engine: \d{4}-\d\d-\d\dT[\d:]+Z, commit \S+, \d+ CPUs, "
                        r"load average \(1 min\) [\d.]+ -> [\d.]+; its whole output, stdout and stderr as they came",
                        lines[0]), lines[0]
    assert any(line.startswith("[setup-engine] ") for line in lines), "the engine venv's set-up lines are missing"
    start = next(i for i, line in enumerate(lines) if line.startswith("mode "))
    rows = [line.split()[:2] for line in lines[start + 2:start + 7]]
    assert [" ".join(r) for r in rows] == ["upstream sync", "upstream async", "ours sync", "ours async", "ours auto"]
    assert re.fullmatch(r"the whole demo took \d+ s", lines[-1]), lines[-1]
