"""The measured HA failover figures docs/helm.md quotes: ``docs/bench/ha-failover.json``, written by the real
failover test (tests/test_ha_failover.py) when ``LOOKOUT_RECORD_FAILOVER=1``, rendered into the doc's
``ha-failover`` block by ``python helm/tools/failover_doc.py`` (``--check``: fail if the block is stale).

Without ``LOOKOUT_RECORD_FAILOVER``, the test checks its own counts against the committed record instead: a doc
that quotes a count the code no longer shows fails the suite.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from mooncake_lookout.connector.cli.docs import extract, splice

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "docs" / "bench" / "ha-failover.json"
DOC = ROOT / "docs" / "helm.md"
BLOCK = "ha-failover"
COUNTS = ("keys_written", "keys_found_after")  # what the test must reproduce; times are only reported


def versions() -> dict[str, str]:
    """The Mooncake wheel and the etcd the failover ran with."""
    etcd = subprocess.run(["etcd", "--version"], capture_output=True, text=True, timeout=30).stdout.split()
    return {"mooncake": importlib.metadata.version("mooncake-transfer-engine-non-cuda"),
            "etcd": etcd[etcd.index("Version:") + 1] if "Version:" in etcd else "unknown"}


def load(path: Path = RECORD) -> dict[str, Any]:
    """The committed record: {"versions": ..., "runs": {"oplog-off": {...}, "oplog-on": {...}}}."""
    return json.loads(path.read_text())


def mode(run: dict[str, Any]) -> str:
    return "oplog-on" if run["oplog"] else "oplog-off"


def check_or_record(run: dict[str, Any], path: Path = RECORD) -> None:
    """Write ``run`` into the record (LOOKOUT_RECORD_FAILOVER=1), else fail if its counts differ from it."""
    if os.environ.get("LOOKOUT_RECORD_FAILOVER") == "1":
        record = load(path) if path.exists() else {"runs": {}}
        record["versions"] = versions()
        record["runs"][mode(run)] = {**run, "loadavg": [round(x, 2) for x in os.getloadavg()]}
        path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        return
    committed = load(path)["runs"].get(mode(run))
    assert committed is not None, f"{path} has no {mode(run)} run: record one with LOOKOUT_RECORD_FAILOVER=1"
    differs = {k: (committed[k], run[k]) for k in COUNTS if committed[k] != run[k]}
    assert not differs, (f"{path} (quoted by docs/helm.md) says {differs} (committed, now): re-run the test with "
                         f"LOOKOUT_RECORD_FAILOVER=1, then python helm/tools/failover_doc.py")


def render(record: dict[str, Any]) -> str:
    """The doc block: one row per mode."""
    v = record["versions"]
    lines = [f"Measured by `tests/test_ha_failover.py` with `mooncake_master` {v['mooncake']} and Debian's etcd "
             f"{v['etcd']} on loopback (`docs/bench/ha-failover.json`; the times come from one run on a shared "
             "machine, the counts are checked on every run):", "",
             "| `master.ha.oplog` | keys stored before the leader was killed | found after the failover "
             "| lookups answered again after | a prefix stored after the kill hit in full after "
             "| operation log left in etcd |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in ("oplog-off", "oplog-on"):
        run = record["runs"][name]
        log = (f"{run['oplog_records_in_etcd']} records, {run['oplog_bytes_in_etcd'] / 1024:.1f} KiB (about "
               f"{run['oplog_bytes_in_etcd'] / run['keys_written']:.0f} bytes per key stored)"
               if run["oplog_records_in_etcd"] else "none")
        lines.append(f"| `{str(run['oplog']).lower()}` | {run['keys_written']} | {run['keys_found_after']} "
                     f"| {run['lookups_answered_after_s']:.1f} s | {run['new_prefix_hit_after_s']:.1f} s | {log} |")
    return "\n".join(lines) + "\n"


def stale(doc: Path = DOC, path: Path = RECORD) -> bool:
    """True if the doc's block differs from what the record renders."""
    return extract(doc.read_text(), BLOCK) != render(load(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the doc's block is stale")
    args = parser.parse_args(argv)
    if args.check:
        if stale():
            print(f"{DOC}: block {BLOCK} is stale: run python helm/tools/failover_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(splice(DOC.read_text(), BLOCK, render(load())))
    return 0


__all__ = ["BLOCK", "RECORD", "check_or_record", "load", "render", "stale"]

if __name__ == "__main__":
    sys.exit(main())
