"""Render the metric catalogue as the Markdown table README carries, and keep README in step with it.

README holds the table between ``<!-- metrics-table:start -->`` and ``<!-- metrics-table:end -->``;
``python -m mooncake_lookout.metrics.markdown README.md`` rewrites that block, ``--check`` only compares.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mooncake_lookout.metrics.catalogue import CATALOGUE, SECONDS_BUCKETS, MetricSpec

_WHERE = {"client": "scheduler", "server": "lookup server"}
START = "<!-- metrics-table:start -->"
END = "<!-- metrics-table:end -->"


def _buckets(spec: MetricSpec) -> str:
    if not spec.buckets:
        return ""
    if spec.buckets == SECONDS_BUCKETS:
        return "10 us .. 10 s"
    return ", ".join(f"{b:g}" for b in spec.buckets)


def render_table(specs: tuple[MetricSpec, ...] = CATALOGUE) -> str:
    """The catalogue as a Markdown table: series name, type, labels, where measured, buckets, meaning."""
    rows = ["| series | type | labels | measured in | buckets | meaning |", "| --- | --- | --- | --- | --- | --- |"]
    for spec in specs:
        series = spec.sample_names[0] if spec.kind == "counter" else spec.name
        labels = ", ".join(spec.labels)
        rows.append(f"| `{series}` | {spec.kind} | {labels} | {_WHERE.get(spec.side, spec.side)} | {_buckets(spec)} | {spec.help} |")
    return "\n".join(rows) + "\n"


def extract_block(text: str) -> str | None:
    """The text between the markers (without them), or ``None`` if README has no such block."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start + len(START):end].strip("\n") + "\n"


def replace_block(text: str, table: str) -> str:
    """``text`` with the block between the markers replaced by ``table``; the markers must exist."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"markers {START} ... {END} not found")
    return text[:start + len(START)] + "\n" + table + text[end:]


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or ``--check``) the metrics table in a Markdown file; exit 1 when it is out of date."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="Markdown file holding the markers (README.md)")
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 if different")
    args = parser.parse_args(argv)
    text = args.path.read_text()
    table = render_table()
    if args.check:
        ok = extract_block(text) == table
        if not ok:
            print(f"{args.path}: metrics table differs from the catalogue; run without --check", file=sys.stderr)
        return 0 if ok else 1
    args.path.write_text(replace_block(text, table))
    return 0


__all__ = ["END", "START", "extract_block", "render_table", "replace_block"]

if __name__ == "__main__":
    sys.exit(main())
