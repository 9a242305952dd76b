"""Generate the values table of docs/helm.md from the chart's values.schema.json (one source).

``python helm/tools/values_table.py`` rewrites the table between the markers, ``--check`` fails if it is stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "helm" / "mooncake-lookout" / "values.schema.json"
DOC = ROOT / "docs" / "helm.md"
START, END = "<!-- values-table:start -->", "<!-- values-table:end -->"


def leaves(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every documented key: strict objects are walked into, anything else is a row."""
    props = schema.get("properties")
    if props is not None and schema.get("additionalProperties") is False:
        for name, sub in props.items():
            yield from leaves(sub, f"{path}.{name}" if path else name)
    elif path:
        yield path, schema


def kind(schema: dict[str, Any]) -> str:
    """A short type description: type plus enum, limits or pattern."""
    text = schema.get("type", "any")
    if "enum" in schema:
        return f"{text}: {' / '.join(v if isinstance(v, str) else json.dumps(v) for v in schema['enum'])}"
    low = ("> " + str(schema["exclusiveMinimum"])) if "exclusiveMinimum" in schema else (
        (">= " + str(schema["minimum"])) if "minimum" in schema else "")
    high = ("<= " + str(schema["maximum"])) if "maximum" in schema else ""
    limits = ", ".join(x for x in (low, high) if x)
    return f"{text} ({limits})" if limits else text


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")


def table(schema: dict[str, Any]) -> str:
    """The markdown table (key, type, default, description)."""
    rows = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for path, sub in leaves(schema):
        default = json.dumps(sub.get("default"), separators=(", ", ": "))
        rows.append(f"| `{path}` | {cell(kind(sub))} | `{cell(default)}` | {cell(sub.get('description', ''))} |")
    return "\n".join(rows) + "\n"


def splice(doc: str, body: str) -> str:
    """The document with the text between the markers replaced by body."""
    if START not in doc or END not in doc:
        raise SystemExit(f"{DOC} lacks the markers {START} / {END}")
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{body}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the table in docs/helm.md is stale")
    args = parser.parse_args(argv)
    doc = DOC.read_text()
    new = splice(doc, table(json.loads(SCHEMA.read_text())))
    if args.check:
        if new != doc:
            print(f"the values table in {DOC} is stale: run python helm/tools/values_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


__all__ = ["END", "START", "leaves", "splice", "table"]

if __name__ == "__main__":
    sys.exit(main())
