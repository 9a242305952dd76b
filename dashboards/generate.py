"""Generate the committed dashboards and alert rules from code: ``python dashboards/generate.py [--check]``.

The JSON and the rule file are outputs, not sources: edit the Python, run this, commit both. ``--check``
writes nothing and exits 1 if a committed file differs from what the code produces (CI runs it).
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # dashboards/ is a folder of scripts, not an installed package
    sys.path.insert(0, str(HERE))

from grafana_foundation_sdk.cog.encoder import JSONEncoder  # noqa: E402

import alerts  # noqa: E402
import importable  # noqa: E402
import overview  # noqa: E402
import tuning  # noqa: E402

OVERVIEW_JSON = "mooncake-lookups-overview.json"
TUNING_JSON = "mooncake-lookups-tuning.json"
RULES_YAML = "alerts.rules.yaml"
INHIBIT_YAML = "alertmanager-inhibit.yaml"
# The import form of each dashboard (importable.py): a folder of its own, which the chart's files/dashboards/*.json
# glob does not reach (the ConfigMaps carry the provisioned form).
IMPORT_DIR = "import"


def dashboard_json(builder: Any) -> str:
    """Stable JSON text of a dashboard builder (sorted keys, two-space indent, final newline)."""
    return json.dumps(builder.build(), cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def import_json(provisioned: str) -> str:
    """Stable JSON text of the import form (``__inputs``, ``__requires``) of a provisioned dashboard's text."""
    return json.dumps(importable.for_import(json.loads(provisioned)), indent=2, sort_keys=True) + "\n"


def outputs() -> dict[str, str]:
    """File name (inside dashboards/) to the text the code produces for it."""
    provisioned = {
        OVERVIEW_JSON: dashboard_json(overview.build(tuning.UID)),
        TUNING_JSON: dashboard_json(tuning.build(overview.UID)),
    }
    return {
        **provisioned,
        **{f"{IMPORT_DIR}/{name}": import_json(text) for name, text in provisioned.items()},
        RULES_YAML: alerts.render(),
        INHIBIT_YAML: alerts.render_inhibitions(),
    }


def check(folder: Path = HERE) -> list[str]:
    """Unified diffs of committed files that differ from the generated text (empty when all match)."""
    diffs = []
    for name, text in outputs().items():
        path = folder / name
        old = path.read_text() if path.exists() else ""
        if old != text:
            diffs.append("".join(difflib.unified_diff(old.splitlines(True), text.splitlines(True),
                                                      f"committed/{name}", f"generated/{name}", n=2)))
    return diffs


def main(argv: list[str] | None = None) -> int:
    """Write the outputs, or with ``--check`` report stale ones."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if the committed files are stale; write nothing")
    args = ap.parse_args(argv)
    if args.check:
        diffs = check()
        for d in diffs:
            sys.stdout.write(d[:4000] + "\n")
        if diffs:
            print("stale: run python dashboards/generate.py and commit the result", file=sys.stderr)
        return 1 if diffs else 0
    for name, text in outputs().items():
        (HERE / name).parent.mkdir(exist_ok=True)
        (HERE / name).write_text(text)
        print(f"wrote dashboards/{name}")
    return 0


__all__ = ["IMPORT_DIR", "INHIBIT_YAML", "OVERVIEW_JSON", "RULES_YAML", "TUNING_JSON", "check", "dashboard_json",
           "import_json", "main", "outputs"]

if __name__ == "__main__":
    sys.exit(main())
