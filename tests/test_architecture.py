"""The file tree stays the architecture: the tools that keep it so, run as the suite runs everything else.

* import-linter: the runtime never imports the tools (cli, bench, rigs), and only ``metrics/`` imports
  prometheus_client and opentelemetry (the contracts live in pyproject.toml);
* ruff: lint and import order over the whole tree;
* mypy: the runtime packages and ``metrics/``, at the strictness pyproject.toml states;
* no runtime module over 400 lines;
* every generated block of the docs (tables, the package graph) matches its source.

Each tool runs as a subprocess of the installed venv, so a failure shows its own report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MAX_RUNTIME_LINES = 400


def _run(*argv: str | Path, env: dict[str, str] | None = None, timeout_s: float = 300) -> str:
    """Run a tool from the project root; fail the test with its output unless it exits 0."""
    done = subprocess.run([str(a) for a in argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                          env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def runtime_modules() -> list[str]:
    """connector's runtime: the bottom layer of the import-linter contract (exhaustive, so complete)."""
    (contract,) = [c for c in PYPROJECT["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    return [name.strip() for name in contract["layers"][-1].split(":")]


def runtime_files() -> list[Path]:
    """Every source file of the runtime: its top-level modules and sub-packages, and metrics/."""
    files: list[Path] = []
    for name in runtime_modules():
        path = ROOT / "connector" / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    return files + [ROOT / "connector" / "__init__.py", *sorted((ROOT / "metrics").glob("*.py"))]


def test_import_contracts_hold() -> None:
    out = _run(BIN / "lint-imports", "--no-cache", "--no-logo")
    assert "0 broken" in out, out


def test_ruff_finds_nothing() -> None:
    _run(BIN / "ruff", "check", "--no-cache", ".")


def test_mypy_passes_on_the_runtime(tmp_path: Path) -> None:
    # connector/ and metrics/ import as mooncake_lookout.connector and mooncake_lookout.metrics (a package-dir
    # mapping mypy cannot follow through the editable install): a folder of links gives mypy those names.
    src = tmp_path / "src" / "mooncake_lookout"
    src.mkdir(parents=True)
    (src / "connector").symlink_to(ROOT / "connector")
    (src / "metrics").symlink_to(ROOT / "metrics")
    targets: list[str] = ["-m", "mooncake_lookout.connector", "-p", "mooncake_lookout.metrics"]
    for name in runtime_modules():
        kind = "-p" if (ROOT / "connector" / name).is_dir() else "-m"
        targets += [kind, f"mooncake_lookout.connector.{name}"]
    out = _run(BIN / "mypy", "--config-file", ROOT / "pyproject.toml", "--cache-dir", tmp_path / "cache", *targets,
               env=dict(os.environ, MYPYPATH=str(tmp_path / "src")))
    assert "Success" in out, out


def test_no_runtime_module_is_over_400_lines() -> None:
    files = runtime_files()
    assert len(files) > 20 and all(f.exists() for f in files), files
    long = {str(f.relative_to(ROOT)): n for f in files if (n := len(f.read_text().splitlines())) > MAX_RUNTIME_LINES}
    assert long == {}, f"runtime modules over {MAX_RUNTIME_LINES} lines: split them by job"


def test_generated_doc_blocks_are_current() -> None:
    _run(sys.executable, "-m", "mooncake_lookout.connector.cli.docs", "--check")
