"""Keeps README's configuration table in step with ``connector/config.py`` (``python -m ... [--check]``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mooncake_lookout.connector.config import render_config_table

START = "<!-- config-table:start -->"
END = "<!-- config-table:end -->"


def replace_block(text: str, table: str) -> str:
    """``text`` with the block between the markers replaced by ``table``."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"markers {START} / {END} not found")
    return text[:start + len(START)] + "\n" + table + "\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or with ``--check`` verify) the README's configuration table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path", nargs="?", default="README.md")
    parser.add_argument("--check", action="store_true", help="fail if the table is out of date")
    args = parser.parse_args(argv)
    path = Path(args.path)
    text = path.read_text()
    new = replace_block(text, render_config_table())
    if args.check:
        if new != text:
            print(f"{path}: configuration table is out of date; run python -m mooncake_lookout.connector.readme",
                  file=sys.stderr)
            return 1
        return 0
    path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["END", "START", "main", "replace_block"]
