"""Claims in the docs that a user acts on, checked against the code, so that they cannot drift.

* Every Python block of the docs imports names that exist; docs/store.md's walk-through runs on a real master
  and gets the answers its comments state.
* The ``serve`` flags docs/protocol.md names exist; no doc puts our lookup server "in place of" vLLM's (it runs
  beside it) or gives it worker threads or a pool (one loop makes every store call).
* README's "Verified here, and not" names test files that exist, and says what is not verified.
* No committed doc or source cites the design notes this repository does not ship, or a path of the machine
  the project was developed on.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from mooncake_lookout.connector.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md", ROOT / "SECURITY.md", ROOT / "CHANGELOG.md",
               ROOT / "helm" / "mooncake-lookout" / "README.md"])
SKIP_DIRS = {".git", ".venv", ".venv-engine", ".tools", "build", "out", "__pycache__", ".mypy_cache", ".ruff_cache",
             ".import_linter_cache", ".hypothesis", ".benchmarks", "mooncake_lookout.egg-info"}


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def import_lines(block: str) -> str:
    """The block's import statements (multi-line ones joined), without the rest."""
    lines, out, open_paren = block.splitlines(), [], False
    for line in lines:
        if line.startswith(("from ", "import ")) or open_paren:
            out.append(line)
            open_paren = line.rstrip().endswith("(") or (open_paren and not line.rstrip().endswith(")"))
    return "\n".join(out)


@pytest.mark.parametrize("path", [p for p in DOCS if python_blocks(p)], ids=lambda p: p.name)
def test_every_python_block_imports_what_exists(path: Path) -> None:
    for block in python_blocks(path):
        exec(compile(import_lines(block), f"{path.name} imports", "exec"), {})


def test_the_store_walk_through_runs_and_answers_as_its_comments_say() -> None:
    block = python_blocks(ROOT / "docs" / "store.md")[0]
    scope: dict = {}
    exec(compile(block, "docs/store.md", "exec"), scope)
    assert scope["hit"].hit_length == 128
    assert len(scope["answers"]) == 64 and all(a.hit_length >= 64 for a in scope["answers"][:8])


def serve_flags() -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    return {s for a in sub._actions for s in a.option_strings}


def test_the_serve_flags_the_protocol_doc_names_exist() -> None:
    text = (ROOT / "docs" / "protocol.md").read_text()
    named = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", text.split("## Frames", 1)[0]))
    assert {"--vllm-layout", "--model", "--master", "--tcp-port"} <= named
    assert sorted(named - serve_flags()) == []
    assert "--workers" not in serve_flags()  # the server has one loop: a doc naming the flag is stale


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_doc_puts_our_server_in_place_of_vllms_or_gives_it_a_pool(path: Path) -> None:
    text = re.sub(r"\s+", " ", path.read_text())
    assert not re.search(r"in place of (vLLM's|upstream's) (own )?(lookup )?server", text), path.name
    assert not re.search(r"server's (pool|worker) threads|`--workers N`|workers store calls", text), path.name


def test_the_readme_says_what_is_verified_here_and_what_is_not() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Verified here, and not", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`(tests/test_[a-z_]+\.py)`", section)
    assert len(named) >= 10
    assert [n for n in named if not (ROOT / n).exists()] == []
    verified, missing = section.split("Not verified here:", 1)
    assert "real `vllm serve` engines on CPU" in verified  # the real engine moved to the verified side
    for gap in ("GPUs", "vLLM 0.33.0 serving", "tensor parallelism > 1", "RDMA", "images", "cluster"):
        assert gap in missing, gap
    assert text.index("## Verified here, and not") < text.index("## Development")  # before the developers' part


def committed_text_files() -> list[Path]:
    out = []
    for path in ROOT.rglob("*"):
        if any(part in SKIP_DIRS for part in path.relative_to(ROOT).parts) or not path.is_file():
            continue
        if path.suffix in {".md", ".py", ".sh", ".txt", ".toml", ".yaml", ".yml", ".json", ".tpl", ".cfg"} or \
                path.name in {"Makefile", "run"} or path.name.endswith("Dockerfile"):
            out.append(path)
    return out


def test_nothing_cites_the_design_notes_the_repository_does_not_ship() -> None:
    word = "ANCH" + "ORS"  # spelled apart so that this file does not cite them either
    found = [str(p.relative_to(ROOT)) for p in committed_text_files() if word in p.read_text(errors="replace")]
    assert found == []


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_doc_names_a_path_of_the_development_machine(path: Path) -> None:
    text = path.read_text()
    for pattern in (r"/work/", r"/root/", r"/home/\w+", r"/opt/wheels", r"pytest-of-"):
        assert not re.search(pattern, text), (path.name, pattern)


def test_every_chart_value_the_operations_doc_names_exists() -> None:
    """Backticked dotted chart keys in docs/operations.md exist in values.yaml (a free-form object, such as
    ``engine.connector.extraConfig``, takes any key below it)."""
    import chart  # helm/tools/chart.py (conftest puts helm/tools on sys.path)

    values = chart.load_values()
    text = (ROOT / "docs" / "operations.md").read_text()
    named = set(re.findall(r"`((?:engine|master|store|monitoring|networkPolicy)(?:\.[A-Za-z0-9_]+)+)", text))
    assert len(named) >= 8
    missing = []
    for key in sorted(named):
        node = values
        for part in key.split("."):
            if isinstance(node, dict) and node == {}:
                break  # free-form: anything below is the user's
            if not isinstance(node, dict) or part not in node:
                missing.append(key)
                break
            node = node[part]
    assert missing == []


def test_the_stats_interval_the_docs_state_is_the_collectors() -> None:
    """docs/metrics.md and docs/architecture.md tell how often vLLM gets our stats record: the collector's own
    interval, not a copy that can drift."""
    from mooncake_lookout.metrics.vllm_stats import RECORD_EVERY_S

    stated = f"at most every {RECORD_EVERY_S * 1000:g} ms"
    for name in ("metrics.md", "architecture.md"):
        assert stated in (ROOT / "docs" / name).read_text(), f"docs/{name} does not say {stated!r}"
